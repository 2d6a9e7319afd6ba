"""Paths a run writes must mean the same place everywhere: refused before anything is spent.

No Ray: a Ray job's working-directory copy is imitated by its path and its job config.
"""

import json
from pathlib import Path

import pytest

from raydp_train.cli import main
from raydp_train.config.pipeline import PipelineError, load_pipeline
from raydp_train.locations import check_locations, job_working_dir_copy
from raydp_train.privacy.ledger import LedgerError

SWEEP = str(Path(__file__).parents[1] / "pipelines" / "sweep_digits.yaml")


@pytest.fixture
def job_copy(tmp_path, monkeypatch) -> Path:
    """The current directory made to look like `ray job submit --working-dir`'s copy."""
    copy = tmp_path / "session" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0a1b"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    return copy


def test_relative_output_and_ledger_inside_a_job_copy_are_refused_naming_both(job_copy):
    with pytest.raises(PipelineError) as refused:
        check_locations(load_pipeline(SWEEP), SWEEP)
    message = str(refused.value)
    for field, value in (("run.output_dir", "runs"), ("budget.ledger", "budgets")):
        assert f"{field}: '{value}' is relative" in message
        assert f"--set {field}=$PWD/{value}" in message
    assert str(job_copy) in message


def test_absolute_paths_inside_a_job_copy_are_accepted(job_copy, tmp_path):
    pipeline = load_pipeline(SWEEP, [f"run.output_dir={tmp_path}/runs",
                                     f"budget.ledger={tmp_path}/budgets"])
    check_locations(pipeline, SWEEP)


def test_relative_paths_outside_a_job_are_accepted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert job_working_dir_copy() is None
    check_locations(load_pipeline(SWEEP), SWEEP)


def test_a_job_with_a_working_dir_is_recognised_by_its_job_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = {"runtime_env": {"working_dir": "gcs://_ray_pkg_0a1b.zip"}, "metadata": {}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(config))
    assert job_working_dir_copy() == str(tmp_path)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {}}))
    assert job_working_dir_copy() is None  # a job without --working-dir runs where Ray started


def test_cli_refuses_before_ray_starts_or_anything_is_written(job_copy, capsys):
    assert main(["tune", SWEEP]) == 2
    assert main(["run", SWEEP, "--set", "tune=null"]) == 2
    err = capsys.readouterr().err
    assert "budget.ledger: 'budgets' is relative" in err
    assert not (job_copy / "budgets").exists() and not (job_copy / "runs").exists()


def test_object_store_ledger_is_refused_before_anything_is_spent(tmp_path, capsys):
    assert main(["validate", SWEEP, "--set", "budget.ledger=s3://bucket/ledgers"]) == 2
    assert "budget.ledger: s3://bucket/ledgers: a s3:// ledger cannot create" in (
        capsys.readouterr().err)
    with pytest.raises(LedgerError):
        check_locations(load_pipeline(SWEEP, ["budget.ledger=gs://b/l"]), SWEEP)
