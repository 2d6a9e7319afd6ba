"""Names and paths a file system cannot hold, and data paths that are no file, are refused by
`validate` (and so by `run` and `tune`) in one line, exit 2: never a traceback
from deep inside the run (`File name too long`), never a FIFO read forever."""

import os

import pytest

from raydp_train.commands.cli import main

LONG = "n" * 300


def one_line(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    output = capsys.readouterr()
    lines = [line for line in (output.out + output.err).splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def validate(tmp_path, *overrides: str) -> list[str]:
    sets = [f"run.output_dir={tmp_path}/runs", f"budget.ledger={tmp_path}/ledger",
            "budget.name=bt", "budget.epsilon=5", "budget.delta=1e-5", *overrides]
    return ["validate", "pipelines/quickstart.yaml"] + [x for o in sets for x in ("--set", o)]


@pytest.mark.parametrize("override, says", [
    (f"name={LONG}", "name: is 300 characters long, at most 200"),
    (f"budget.name={LONG}", "budget.name: is 300 characters long, at most 200"),
    ("run.output_dir={tmp}/" + LONG, "run.output_dir: has a component of 300 bytes"),
    ("budget.ledger={tmp}/" + "é" * 128, "budget.ledger: has a component of 256 bytes"),
    ("budget.ledger={tmp}/" + "n" * 250, "budget.ledger: its last folder name is 250 bytes"),
    ("data={{source: parquet, path: '{tmp}/" + LONG + "/train.parquet', feature_columns: [x], "
     "label_column: label}}", "data.path: has a component of 300 bytes"),
])
def test_a_name_or_path_over_the_file_systems_limits_is_one_line(tmp_path, capsys, override,
                                                                  says):
    line = one_line(capsys, validate(tmp_path, override.format(tmp=tmp_path)))
    assert says in line, line


@pytest.mark.parametrize("kind", ["a FIFO", "a directory", "a character device"])
def test_a_data_path_that_is_no_file_is_named_for_what_it_is(tmp_path, capsys, kind):
    path = {"a FIFO": tmp_path / "fifo.parquet", "a directory": tmp_path,
            "a character device": "/dev/zero"}[kind]
    if kind == "a FIFO":
        os.mkfifo(path)
    line = one_line(capsys, validate(tmp_path, f"data={{source: parquet, path: '{path}', "
                                               "feature_columns: [x], label_column: label}"))
    assert f"data.path: {path} is {kind}, not a parquet file" in line, line


def test_budget_commands_refuse_a_name_too_long_in_one_line(tmp_path, capsys):
    for view in ("status", "verify", "history"):
        line = one_line(capsys, ["budget", view, LONG, "--ledger", str(tmp_path)])
        assert "must be one folder name of at most 200 bytes" in line, line
