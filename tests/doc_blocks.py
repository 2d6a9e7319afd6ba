"""The fenced code blocks of README.md and docs/**/*.md, each with the marker comment that
stands on the line before it (if any): `<!-- what: tests/test_x.py runs this block -->`
hands a block to the test it names; every other block is run by tests/test_doc_blocks.py."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.MULTILINE | re.DOTALL)
MARKER = re.compile(r"<!-- ([^:]+): (tests/[\w/]+\.py)[^>]*-->\n$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence
    language: str
    text: str
    marker: str | None  # the marker's name, e.g. "python api"
    test_file: str | None  # the test the marker names

    def __str__(self) -> str:
        return f"{self.page}:{self.line} ({self.language or 'no language'})"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page: Path, root: Path = ROOT) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[:match.start()]
        marker = MARKER.search(before[-300:]) if before.endswith("-->\n") else None
        found.append(Block(page.relative_to(root).as_posix(), before.count("\n") + 1,
                           match.group(1), match.group(2),
                           marker.group(1) if marker else None,
                           marker.group(2) if marker else None))
    return found


def all_blocks() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


def marked_block(page: str, marker: str) -> str:
    """The text of the block on `page` (relative to the root) whose marker is `marker`."""
    (block,) = [b for b in blocks(ROOT / page) if b.marker == marker]
    return block.text


def output_labels(text: str) -> list[str]:
    """The label of each line of a printed summary: the words before the column of values."""
    return [re.split(r"\s{2,}", line.strip(), maxsplit=1)[0] for line in text.splitlines()
            if line.strip()]
