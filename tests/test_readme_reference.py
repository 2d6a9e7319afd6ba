"""README's pipeline reference names every field of the pydantic schema, so the two cannot
drift apart: a field added to the schema fails this test until the reference documents it."""

import re
import types
import typing
from pathlib import Path

from pydantic import BaseModel

from raydp_train.config.pipeline import Pipeline

README = Path(__file__).parents[1] / "README.md"


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
    text = README.read_text()
    section = text.split("## Pipeline reference", 1)[1].split("\n## ", 1)[0]
    return section.split("```yaml", 1)[1].split("```", 1)[0]


def test_every_schema_field_is_in_the_pipeline_reference():
    block = reference_block()
    documented = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", block))
    missing = sorted(path for path in schema_fields(Pipeline)
                     if path.rsplit(".", 1)[-1] not in documented)
    assert not missing, f"README's pipeline reference leaves out: {', '.join(missing)}"


def test_the_schema_walk_sees_nested_and_union_sections():
    paths = schema_fields(Pipeline)
    assert {"data.feature_columns", "data.n_samples", "model.name_or_path",
            "privacy.lsg.rank", "tune.search_space", "budget.ledger"} <= paths
