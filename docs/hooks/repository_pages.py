"""Pages built from files that live at the repository's root, so the site shows them as they
are rather than a copy that could fall behind: the design's math (ARCHITECTURE.md, its
sections 1 and 2; the module map and the Ray facts after them are for the code's readers)
and the measured results (benchmarks/RESULTS.md)."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).parents[2]
MAP_NOTE = ("\n---\n\nThe module map, the layer order the tests enforce, and the Ray facts "
            "that shape the code continue in the repository's ARCHITECTURE.md (sections 3 "
            "and 4). Measured numbers: [measured results](results.md).\n")


def design() -> str:
    """ARCHITECTURE.md up to its module map (section 3)."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    return text.split("\n## 3. ", 1)[0].rstrip() + "\n" + MAP_NOTE


def on_files(files, config):
    files.append(File.generated(config, "design.md", content=design()))
    files.append(File.generated(config, "results.md",
                                content=(ROOT / "benchmarks" / "RESULTS.md").read_text()))
    return files
