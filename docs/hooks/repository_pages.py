"""Pages built from files that live at the repository's root, so the site shows them as they
are rather than a copy that could fall behind: the design (ARCHITECTURE.md) and the measured
results (benchmarks/RESULTS.md)."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).parents[2]
PAGES = {"design.md": "ARCHITECTURE.md", "results.md": "benchmarks/RESULTS.md"}


def on_files(files, config):
    for page, source in PAGES.items():
        files.append(File.generated(config, page, content=(ROOT / source).read_text()))
    return files
