"""Config errors people can act on: each problem is one `field.path: what is wrong` line.

Pydantic's errors are turned into sentences that name the field, the allowed values and what
was given. Shared by every schema that reads user YAML.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from typing import Any

import yaml
from pydantic import BaseModel

from raydp_train.errors import UserError


class PipelineError(UserError, ValueError):
    """A config that cannot be used; str() names `source` and its problem on one line, or
    is a header naming `source`, then one line per problem."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        super().__init__(source, self.problems)

    def __str__(self) -> str:
        if len(self.problems) == 1:  # one problem, one line
            return f"cannot load pipeline config {self.source}: {self.problems[0]}"
        lines = [f"cannot load pipeline config {self.source}:"]
        return "\n".join(lines + [f"  {p}" for p in self.problems])

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses Ray process boundaries, so it must rebuild from plain args.
        return (type(self), (self.source, self.problems))


class FieldProblem(ValueError):
    """Raised by cross-field checks so the message is reported at `section.field`, not `section`."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or str(e)
    if mark is None:
        return f"YAML syntax error: {what}"
    return f"YAML syntax error at line {mark.line + 1}, column {mark.column + 1}: {what}"


# --- turning pydantic errors into sentences ---------------------------------------------------

_MESSAGES = {  # pydantic error type -> message; {got} is the input, other names from ctx
    "missing": "required field missing",
    "greater_than": "must be > {gt}, got {got}",
    "greater_than_equal": "must be >= {ge}, got {got}",
    "less_than": "must be < {lt}, got {got}",
    "less_than_equal": "must be <= {le}, got {got}",
    "finite_number": "must be a finite number, got {got}",
    "int_parsing": "must be an integer, got {got}",
    "int_type": "must be an integer, got {got}",
    "int_from_float": "must be a whole number, got {got}",
    "float_parsing": "must be a number, got {got}",
    "float_type": "must be a number, got {got}",
    "string_type": "must be a string, got {got}",
    "list_type": "must be a list, got {got}",
    "model_type": "must be a mapping of fields, got {got}",
    "model_attributes_type": "must be a mapping of fields, got {got}",
    "too_short": "must not be empty",
    "string_too_short": "must not be empty",
}


def describe(err: Any, root: type[BaseModel]) -> str:
    """One `<field.path>: <message>` line for one pydantic error."""
    kind, loc, ctx = err["type"], err["loc"], err.get("ctx") or {}
    path, ann, tag_field = _walk(loc, root)
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        path = f"{path}.{tag_field}"
        tags = ", ".join(repr(tag) for m in _models(ann) for tag in _tags(m, tag_field))
        got = f", got {ctx['tag']!r}" if "tag" in ctx else ""
        message = f"must be one of {tags}{got}" if got else f"required; one of {tags}"
    elif kind == "literal_error":
        allowed = ", ".join(repr(a) for o in _options(ann) for a in typing.get_args(o))
        message = f"must be one of {allowed or ctx['expected']}, got {show(err['input'])}"
    elif kind == "extra_forbidden" and len(owner := _models(_walk(loc[:-1], root)[1])) == 1:
        message = f"unknown field; allowed fields: {', '.join(owner[0].model_fields)}"
    elif kind == "value_error" and isinstance(ctx.get("error"), FieldProblem):
        problem = ctx["error"]
        path = ".".join(p for p in (path, problem.field) if p)
        message = str(problem)
    elif kind == "too_short" and ctx.get("min_length", 1) > 1:
        message = f"needs at least {ctx['min_length']} entries, got {ctx.get('actual_length')}"
    elif kind in _MESSAGES:
        bounds = {k: show(v) for k, v in ctx.items()}  # 0.0 -> "0", as the user wrote it
        message = _MESSAGES[kind].format(got=show(err.get("input")), **bounds)
    else:
        message = err["msg"]
    return f"{path}: {message}" if path else message


def _walk(loc: Sequence[str | int], root: type[BaseModel]) -> tuple[str, Any, str | None]:
    """Follow `loc` through the schema: the dotted path people see, the annotation found there,
    and the discriminator name if that annotation is a tagged union."""
    path, ann, tag_field = "", root, None
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
            ann, tag_field = (typing.get_args(_options(ann)[0]) or (None,))[0], None
            continue
        if typing.get_origin(_options(ann)[0]) is dict:  # a mapping's key, e.g. a searched field
            ann, tag_field = typing.get_args(_options(ann)[0])[1], None
            path = f"{path}.{item}"
            continue
        members = _models(ann)
        if tag_field and len(members) > 1:
            # pydantic puts the chosen union member's tag into loc; resolve it, do not show it.
            ann = next((m for m in members if item in _tags(m, tag_field)), None)
            tag_field = None
            continue
        field = members[0].model_fields.get(item) if len(members) == 1 else None
        ann, tag_field = (field.annotation, field.discriminator) if field else (None, None)
        path = f"{path}.{item}" if path else str(item)
    return path, ann, tag_field


def _options(ann: Any) -> tuple[Any, ...]:
    """The alternatives an annotation allows, None left out: `A | B | None` -> (A, B)."""
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(ann) if a is not type(None))
    return (ann,)


def _models(ann: Any) -> list[type[BaseModel]]:
    return [m for m in _options(ann) if isinstance(m, type) and issubclass(m, BaseModel)]


def _tags(model: type[BaseModel], tag_field: str) -> tuple[str, ...]:
    """The tag values that pick `model` (a Literal may allow several: parquet, csv, json)."""
    return typing.get_args(model.model_fields[tag_field].annotation)


def show(value: Any) -> str:
    """A value as the user wrote it in YAML: null, true, 1 (not 1.0), 1e-05, 'text'."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    if isinstance(value, str):
        try:
            float(value)
            return value
        except ValueError:
            pass
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
