"""A missing data file, or a model factory or loss that does not load, is refused in one line
before Ray starts (its start takes seconds; the other checks come after it), by `run` and by
`tune` alike: Ray's start is stopped here by the test, and never reached."""

import time
from pathlib import Path

import pytest

from raydp_train.commands.cli import main
from raydp_train.runs.resources import ResourceError
from raydp_train.train import trainer

ROOT = Path(__file__).parents[1]
CUSTOM = str(ROOT / "pipelines" / "digits_custom_model.yaml")
TUNE = ["--set", "data.validation={fraction: 0.25, private: false}", "--set",
        "tune={search_space: {training.lr: {choice: [0.1]}}}", "--set",
        "budget={name: before-ray, epsilon: 10, delta: 1e-5}"]
CASES = {
    "missing train file": (["--set", ("data={source: csv, path: {tmp}/gone.csv, "
                            "feature_columns: [a], label_names: [x, y]}"),
                            "--set", "model={kind: logistic}"],
                           "data.path: csv file not found: {tmp}/gone.csv"),
    "missing test file": (["--set", ("data={source: parquet, path: {tmp}/here.parquet, "
                           "test_path: {tmp}/gone.parquet, feature_columns: [a], "
                           "label_names: [x, y]}"), "--set", "model={kind: logistic}"],
                          "data.test_path: parquet file not found: {tmp}/gone.parquet"),
    "bad factory name": (["--set", "model.factory={models}/digits_cnn.py:big_cnn"],
                         "model.factory: {models}/digits_cnn.py has no function 'big_cnn'"),
    "bad loss file": (["--set", "model.loss={models}/gone.py:loss"],
                      "model.loss: file not found: {models}/gone.py"),
}


@pytest.fixture
def ray_start(monkeypatch):
    reached = []

    def not_started(*args, **kwargs):
        reached.append(kwargs)
        raise ResourceError("Ray's start, stopped by the test")

    monkeypatch.setattr(trainer, "ensure_ray", not_started)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return reached


@pytest.mark.parametrize("command", ["run", "tune"])
@pytest.mark.parametrize("case", list(CASES))
def test_refused_in_one_line_before_ray_starts(case, command, ray_start, tmp_path, capsys):
    (tmp_path / "here.parquet").write_bytes(b"")  # named, never read: refused before
    sets, message = CASES[case]

    def fill(text: str) -> str:
        return text.replace("{tmp}", str(tmp_path)).replace(
            "{models}", str(ROOT / "pipelines" / "models"))

    argv = [command, CUSTOM, *map(fill, sets), "--set", f"run.output_dir={tmp_path}/runs",
            *(TUNE if command == "tune" else [])]
    started = time.monotonic()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"error: {fill(message)}\n", err
    assert not ray_start and time.monotonic() - started < 30
    assert not (tmp_path / "runs").exists()


def test_a_good_pipeline_goes_on_to_start_ray(ray_start, tmp_path, capsys):
    argv = ["run", CUSTOM, "--set", f"run.output_dir={tmp_path}/runs"]
    assert main(argv) == 2
    assert capsys.readouterr().err == "error: Ray's start, stopped by the test\n"
    assert ray_start  # everything before Ray passed
