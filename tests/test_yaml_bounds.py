"""Hostile YAML: refused by `validate` with one line naming the bound, never a
traceback or a hang (each took well under a second here)."""

import time
from pathlib import Path

import pytest

from raydp_train.commands.cli import main
from raydp_train.config.yaml_text import MAX_DEPTH, load_bounded

QUICKSTART = (Path(__file__).parents[1] / "pipelines" / "quickstart.yaml").read_text()

BILLION_LAUGHS = "\n".join(
    ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    + ["name: *a9"])


def _refused(tmp_path, capsys, text: str, reason: str, *options: str) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    started = time.monotonic()
    assert main(["validate", str(path), *options]) == 2
    assert time.monotonic() - started < 10.0  # a guard against a hang, not a timing
    output = capsys.readouterr()
    lines = (output.out + output.err).strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert reason in lines[0], lines[0]


def test_nesting_thousands_deep_is_refused(tmp_path, capsys):
    _refused(tmp_path, capsys, "name: " + "[" * 5000 + "]" * 5000,
             f"nests deeper than {MAX_DEPTH} levels")
    _refused(tmp_path, capsys, "name: " + "[" * 40 + "]" * 40,
             f"nests deeper than {MAX_DEPTH} levels")


def test_an_alias_bomb_is_refused(tmp_path, capsys):
    _refused(tmp_path, capsys, BILLION_LAUGHS, "expands to more than 100,000 values")


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path, capsys):
    _refused(tmp_path, capsys, "name: &x [1, *x]", "refers to itself")


def test_a_key_given_twice_is_refused_with_its_line(tmp_path, capsys):
    _refused(tmp_path, capsys, QUICKSTART + "\nname: other\n",
             "key 'name' is given twice in one mapping")


def test_a_huge_file_is_refused(tmp_path, capsys):
    _refused(tmp_path, capsys, QUICKSTART + "#" * 1_100_000 + "\n", "larger than 1,000,000 bytes")


def test_an_override_is_bounded_too(tmp_path, capsys):
    (tmp_path / "p.yaml").write_text(QUICKSTART)
    assert main(["validate", str(tmp_path / "p.yaml"), "--set",
                 "training.lr=" + "[" * 3000 + "]" * 3000]) == 2
    assert "nests deeper than" in capsys.readouterr().err


def test_shared_values_within_bounds_load_as_written():
    text = "base: &b {lr: 0.1, momentum: 0.9}\nfirst: *b\nsecond: {<<: *b, lr: 0.2}\n"
    assert load_bounded(text) == {"base": {"lr": 0.1, "momentum": 0.9},
                                  "first": {"lr": 0.1, "momentum": 0.9},
                                  "second": {"lr": 0.2, "momentum": 0.9}}
    with pytest.raises(ValueError, match="nests deeper"):
        load_bounded("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
    assert load_bounded("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
