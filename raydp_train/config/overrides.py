"""`--set a.b[0].c=value` overrides of a parsed pipeline, before it is validated: each value
parsed as YAML (with the YAML limits of the file), each key checked against the config's own
shape, every bad override named."""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence

import yaml

from raydp_train.config.errors import PipelineError, show, yaml_problem
from raydp_train.config.yaml_text import YamlLimitError, load_bounded


def apply_overrides(raw: dict, overrides: Sequence[str], *, source: str = "<overrides>") -> dict:
    """Return a deep copy of `raw` with each `a.b.c=value` set; values are parsed as YAML."""
    result = copy.deepcopy(raw)
    problems = []
    for text in overrides:
        try:
            _apply_one(result, text)
        except ValueError as e:
            problems.append(f"--set {text}: {e}")
    if problems:
        raise PipelineError(source, problems)
    return result


def _apply_one(raw: dict, text: str) -> None:
    key, eq, value_text = text.partition("=")
    steps = _key_path(key) if eq else None
    if not steps:
        raise ValueError("expected KEY=VALUE with a dotted KEY, e.g. training.lr=0.01 or "
                         "training.param_groups[0].lr=0.01")
    try:
        value = load_bounded(value_text)
    except yaml.YAMLError as e:
        raise ValueError(f"value is not valid YAML ({yaml_problem(e)})") from None
    except YamlLimitError as e:
        raise ValueError(f"value refused: {e}") from None
    # PyYAML (YAML 1.1) reads `1e-5` as a string; on the command line it is always a number.
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value):
        value = float(value)
    node = raw
    for depth, step in enumerate(steps[:-1]):
        wants_list = isinstance(steps[depth + 1], int)
        if isinstance(step, str) and node.get(step) is None and not wants_list:
            node[step] = {}
        node = _child(node, step, _key_text(steps[: depth + 1]))
        kind = list if wants_list else dict
        if not isinstance(node, kind):
            what = "a list" if wants_list else "a section with fields"
            where = _key_text(steps[: depth + 1])
            raise ValueError(f"{where} is {show(node)}, not {what}")  # noqa: TRY004 (user input)
    if isinstance(steps[-1], int):
        _child(node, steps[-1], _key_text(steps))  # an existing entry: lists do not grow here
    node[steps[-1]] = value


def _key_path(key: str) -> list[str | int] | None:
    """`a.b[1].c` -> ["a", "b", 1, "c"]; None if malformed."""
    steps: list[str | int] = []
    for part in key.strip().split("."):
        match = re.fullmatch(r"([^\[\]]+)((?:\[\d+\])*)", part)
        if match is None:
            return None
        steps += [match[1], *(int(i) for i in re.findall(r"\d+", match[2]))]
    return steps


def _key_text(steps: list[str | int]) -> str:
    return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in steps).lstrip(".")


def _child(node, step: str | int, where: str):
    if isinstance(step, int) and step >= len(node):
        raise ValueError(f"{where}: no such entry (the list has {len(node)})")
    return node.get(step) if isinstance(step, str) else node[step]
