"""The pipeline reference's field tables, written from the pydantic schema at build time: a
field added, renamed or given another default shows in the docs without anyone editing them.

mkdocs calls `on_page_markdown` for every page; the marker below is replaced by the tables.
"""

from __future__ import annotations

import json
import types
import typing

import annotated_types
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

MARKER = "<!-- pipeline fields: written here from the schema by docs/hooks/pipeline_fields.py -->"
CONSTRAINTS = {annotated_types.Gt: "> {}", annotated_types.Ge: ">= {}",
               annotated_types.Lt: "< {}", annotated_types.Le: "<= {}",
               annotated_types.MinLen: "at least {} long", annotated_types.MaxLen: "at most {} long"}
CONSTRAINT_VALUE = {annotated_types.Gt: "gt", annotated_types.Ge: "ge", annotated_types.Lt: "lt",
                    annotated_types.Le: "le", annotated_types.MinLen: "min_length",
                    annotated_types.MaxLen: "max_length"}


def on_page_markdown(markdown: str, **_) -> str:
    if MARKER not in markdown:
        return markdown
    from raydp_train.config.pipeline import Pipeline

    return markdown.replace(MARKER, field_tables(Pipeline))


def field_tables(model: type[BaseModel]) -> str:
    """One table per section of `model`: every field with its type, default and bounds."""
    seen, tables = set(), []
    for path, section in sections(model):
        if (path, section) not in seen:  # data.validation: one table, not one per source
            seen.add((path, section))
            tables.append(_table(path, section))
    return "\n".join(tables)


def sections(model: type[BaseModel], path: str = "") -> list[tuple[str, type[BaseModel]]]:
    """(path, section class) for `model` and every section nested in it, depth first; a
    union of sections (data sources, model kinds) gives one entry per member."""
    found = [(path, model)]
    for name, field in model.model_fields.items():
        for section in _sections_in(field.annotation):
            found += sections(section, f"{path}.{name}" if path else name)
    return found


def _sections_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is dict:  # keyed by the user (search spaces): its values are not fields
        return []
    if origin in (typing.Union, types.UnionType, typing.Annotated, list, tuple):
        return [s for arg in typing.get_args(annotation) for s in _sections_in(arg)]
    return []


def _table(path: str, section: type[BaseModel]) -> str:
    title = f"`{path}`" if path else "the top level"
    chosen = [f"`{name}`: " + ", ".join(f"`{value}`" for value in typing.get_args(field.annotation))
              for name, field in section.model_fields.items()
              if name in ("source", "kind") and typing.get_origin(field.annotation)
              is typing.Literal]
    heading = f"### {title}" + (f" with {chosen[0]}" if chosen else "")
    doc = " ".join((section.__doc__ or "").strip().split("\n\n")[0].split())
    lines = [heading, "", doc, ""] if doc and section.__doc__ != BaseModel.__doc__ else [
        heading, ""]
    lines += ["| field | type | default | bounds |", "| --- | --- | --- | --- |"]
    for name, field in section.model_fields.items():
        lines.append(f"| `{name}` | {type_text(field.annotation)} | {_default(field)} | "
                     f"{_bounds(field.metadata)} |")
    return "\n".join(lines) + "\n"


def type_text(annotation) -> str:
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{json.dumps(a) if not isinstance(a, str) else a}`" for a in args)
    if origin is typing.Annotated:
        bounds = _bounds(args[1:])
        return type_text(args[0]) + (f" ({bounds})" if bounds else "")
    if origin in (typing.Union, types.UnionType):
        kinds = []
        for arg in args:
            text = type_text(arg)
            if text not in kinds:
                kinds.append(text)
        return " or ".join(kinds)
    if origin in (list, tuple):
        return "list of " + (type_text(args[0]) if args else "values")
    if origin is dict:
        return "mapping"
    return getattr(annotation, "__name__", str(annotation)).replace("|", "\\|")


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "its defaults"
    return f"`{json.dumps(value, default=str)}`"


def _bounds(metadata) -> str:
    found = []
    for item in metadata:
        for kind, text in CONSTRAINTS.items():
            if isinstance(item, kind):
                found.append(text.format(getattr(item, CONSTRAINT_VALUE[kind])))
    return ", ".join(found)
