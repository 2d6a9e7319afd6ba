"""`validate` remembers the model checks that passed, so that checking the same model again
skips seconds of importing torch and transformers (benchmarks/RESULTS.md, validate's time).

A pass is remembered under a key of everything the check reads: the pipeline's model, privacy
and training sections and `data.max_length`, the model folder's files (names, sizes, times of
change; `config.json`'s bytes), the installed torch and transformers, and raydp_train's own
source files. Any change to one of them is a new key, so the check runs again. Only passes are
remembered, only for a model in a local folder (a hub name's files may change unseen), and
only `validate` skips a remembered check: `run` checks everything every time, before anything
is spent, and remembers that the model's part passed.

Kept in `$RAYDP_TRAIN_CACHE/passed_checks` (default `$XDG_CACHE_HOME/raydp_train`, else
`~/.cache/raydp_train`); deleting the folder forgets every pass. A folder that cannot be written only makes `validate` slower.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

from raydp_train.config.pipeline import Pipeline
from raydp_train.data.cache import cache_folder
from raydp_train.models.hf_files import local_folder

_SOURCE = Path(__file__).resolve().parent
_LIBRARIES = ("torch", "transformers")


def passed_before(pipeline: Pipeline) -> bool:
    key = _key(pipeline)
    return key is not None and (_folder() / key).is_file()


def remember_pass(pipeline: Pipeline) -> None:
    key = _key(pipeline)
    if key is None:
        return
    try:
        _folder().mkdir(parents=True, exist_ok=True)
        (_folder() / key).write_text(f"{pipeline.name}\n")
    except OSError:
        pass  # remembering is only for speed: the next validate checks again


def _folder() -> Path:
    return cache_folder("passed_checks")


def _key(pipeline: Pipeline) -> str | None:
    folder = local_folder(pipeline.model)
    if folder is None:
        return None
    what = {
        "pipeline": pipeline.model_dump(mode="json", include={"model", "privacy", "training"}),
        "max_length": pipeline.data.max_length,
        "model_files": _files(folder),
        "model_config": _digest(folder / "config.json"),
        "libraries": {name: _version(name) for name in _LIBRARIES},
        "raydp_train": _files(_SOURCE, "*.py"),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _files(folder: Path, pattern: str = "*") -> list[tuple[str, int, int]]:
    found = []
    for path in sorted(folder.rglob(pattern)):
        if path.is_file():
            stat = path.stat()
            found.append((str(path.relative_to(folder)), stat.st_size, stat.st_mtime_ns))
    return found


def _digest(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
