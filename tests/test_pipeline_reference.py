"""The pipeline reference (docs/reference/pipeline.md) cannot drift from the pydantic schema:
its annotated pipeline names every field (a field added to the schema fails this test until
the reference explains it), and its field tables, written from the schema when the site is
built (docs/hooks/pipeline_fields.py), list every field with its type and default."""

import importlib.util
import re
import types
import typing
from pathlib import Path

from pydantic import BaseModel

from raydp_train.config.pipeline import Pipeline

ROOT = Path(__file__).parents[1]
PAGE = ROOT / "docs" / "reference" / "pipeline.md"


def schema_fields(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every field path of `model`, through nested sections and unions of sections."""
    paths = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.add(path)
        for section in _sections(field.annotation):
            paths |= schema_fields(section, f"{path}.")
    return paths


def _sections(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) is dict:  # search spaces, normalize: keyed by the user
        return _sections(typing.get_args(annotation)[1])[:0]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated, list, tuple):
        return [s for arg in typing.get_args(annotation) for s in _sections(arg)]
    return []


def reference_block() -> str:
    from doc_blocks import marked_block

    return marked_block("docs/reference/pipeline.md", "pipeline reference")


def test_every_schema_field_is_in_the_pipeline_reference():
    block = reference_block()
    documented = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", block))
    missing = sorted(path for path in schema_fields(Pipeline)
                     if path.rsplit(".", 1)[-1] not in documented)
    assert not missing, f"the pipeline reference leaves out: {', '.join(missing)}"


def test_the_schema_walk_sees_nested_and_union_sections():
    paths = schema_fields(Pipeline)
    assert {"data.feature_columns", "data.n_samples", "model.name_or_path",
            "privacy.lsg.rank", "tune.search_space", "budget.ledger"} <= paths


def _hook():
    spec = importlib.util.spec_from_file_location(
        "pipeline_fields", ROOT / "docs" / "hooks" / "pipeline_fields.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def tabled_fields(markdown: str) -> set[str]:
    """Field paths of the generated tables: each row's field under its section's heading."""
    paths, section = set(), None
    for line in markdown.splitlines():
        if line.startswith("### "):
            heading = re.match(r"### (?:`([\w.]+)`|the top level)", line)
            section = heading.group(1)
        elif line.startswith("| `"):
            name = re.match(r"\| `(\w+)`", line).group(1)
            paths.add(f"{section}.{name}" if section else name)
    return paths


def test_the_page_is_written_with_tables_of_every_schema_field():
    hook = _hook()
    page = PAGE.read_text()
    assert hook.MARKER in page
    written = hook.on_page_markdown(page)
    assert hook.MARKER not in written
    assert tabled_fields(written) == schema_fields(Pipeline)
    assert "| `epochs` | int | `30` | > 0 |" in written  # type, default and bounds
    assert "| `schedule` | `constant` \\| `linear` \\| `cosine` | `\"constant\"` |  |" in written
    assert hook.on_page_markdown("no marker") == "no marker"
