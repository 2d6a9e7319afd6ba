"""Relative file paths in a pipeline: a pipeline file's own paths mean places beside it.

A path written in a pipeline file resolves against the file's folder, so the pipeline runs the
same from any current directory (and, in a Ray job, against the job's copy of that folder). A
path given on the command line (`--set`) resolves against the current directory, as a shell
user means it. `run.output_dir` and `budget.ledger` are not touched here: they follow their
own rule (runs/locations.py).
"""

from __future__ import annotations

from pathlib import Path


def resolve_relative_paths(raw: dict, base: Path) -> dict:
    """`raw` (a parsed pipeline, changed in place) with its relative input paths made absolute
    against `base`: data.path, data.test_path, data.validation.path, the file of a
    model.factory and model.loss ("file.py:function"), and a model.name_or_path or
    model.tokenizer that starts with ./ or ../ (without those it may name a hub model, e.g.
    `org/name`).
    Values of the wrong type are left for the schema to refuse."""
    data = raw.get("data")
    if isinstance(data, dict):
        _make_absolute(data, ("path", "test_path"), base)
        if isinstance(data.get("validation"), dict):
            _make_absolute(data["validation"], ("path",), base)
    model = raw.get("model")
    for field in ("name_or_path", "tokenizer"):
        if isinstance(model, dict) and str(model.get(field)).startswith(("./", "../")):
            _make_absolute(model, (field,), base)
    for field in ("factory", "loss"):  # model.kind torch: a file's function
        spec = model.get(field) if isinstance(model, dict) else None
        if isinstance(spec, str) and ".py:" in spec:
            file, _, function = spec.rpartition(":")
            if _relative_path(file):
                model[field] = f"{(base / file).resolve()}:{function}"
    return raw


def _make_absolute(section: dict, fields: tuple[str, ...], base: Path) -> None:
    for field in fields:
        if _relative_path(section.get(field)):
            section[field] = str((base / section[field]).resolve())


def _relative_path(value) -> bool:
    """A non-empty relative path; URIs (s3://...) are not paths to resolve."""
    return isinstance(value, str) and bool(value) and "://" not in value and \
        not Path(value).is_absolute()
