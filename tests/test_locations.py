"""Paths a run writes must mean the same place everywhere: refused before anything is spent.

No Ray: a Ray job's working-directory copy is imitated by its path and its job config.
"""

import json
import os
from pathlib import Path

import pytest

from raydp_train.budget.ledger import LedgerError, as_uri
from raydp_train.budget.ledger_reading import budget_status
from raydp_train.commands.cli import main
from raydp_train.config.pipeline import PipelineError, load_pipeline
from raydp_train.runs.locations import (
    _filesystem_type,
    check_locations,
    cluster_warnings,
    job_working_dir_copy,
)

QUICKSTART = str(Path(__file__).parents[1] / "pipelines" / "quickstart.yaml")

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
        check_locations(load_pipeline(SWEEP, ["budget.ledger=budgets"]), SWEEP)
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


@pytest.mark.slow
def test_cli_refuses_before_ray_starts_or_anything_is_written(job_copy, capsys):
    relative = ["--set", "budget.ledger=budgets"]
    assert main(["tune", SWEEP, *relative]) == 2
    assert main(["run", SWEEP, "--set", "tune=null", *relative]) == 2
    err = capsys.readouterr().err
    assert "budget.ledger: 'budgets' is relative" in err
    assert not (job_copy / "budgets").exists() and not (job_copy / "runs").exists()


def test_object_store_ledger_is_refused_before_anything_is_spent(tmp_path, capsys):
    assert main(["validate", SWEEP, "--set", "budget.ledger=s3://bucket/ledgers"]) == 2
    assert "budget.ledger: s3://bucket/ledgers: a s3:// ledger cannot create" in (
        capsys.readouterr().err)
    with pytest.raises(LedgerError):
        check_locations(load_pipeline(SWEEP, ["budget.ledger=gs://b/l"]), SWEEP)


def test_the_default_ledger_is_one_absolute_folder_per_machine(tmp_path, monkeypatch):
    """Wherever the command runs from: $RAYDP_TRAIN_HOME/budgets, else ~/.raydp_train/budgets."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        monkeypatch.chdir(tmp_path / folder)
        ledger = load_pipeline(SWEEP).budget.ledger
        assert ledger == os.path.join(os.environ["RAYDP_TRAIN_HOME"], "budgets")
    monkeypatch.delenv("RAYDP_TRAIN_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert load_pipeline(SWEEP).budget.ledger == f"{tmp_path}/home/.raydp_train/budgets"


# make test: test_the_default_ledger_is_one_absolute_folder_per_machine, and a run and a sweep
# on one ledger in test_budget_ray.py
@pytest.mark.long
@pytest.mark.slow
def test_two_runs_from_two_folders_spend_from_one_ledger(ray_session, tmp_path, monkeypatch,
                                                         capsys):
    """The same pipeline (no budget.ledger) run from two folders: one budget, and the second
    run starts from what the first spent."""
    overrides = ["budget.name=two-folders", "budget.epsilon=40", "budget.delta=1e-5",
                 "training.epochs=1", "training.workers=1", f"run.output_dir={tmp_path}/runs"]
    options = [part for override in overrides for part in ("--set", override)]
    ledger = os.path.join(os.environ["RAYDP_TRAIN_HOME"], "budgets")
    counted = []
    for folder in ("first", "second"):
        (tmp_path / folder).mkdir()
        monkeypatch.chdir(tmp_path / folder)
        assert main(["run", QUICKSTART, *options]) == 0
        assert f"ledger: {as_uri(ledger)}" in capsys.readouterr().out  # printed by what spends
        counted.append(budget_status("two-folders", ledger)["epsilon_counted"])
        assert not (tmp_path / folder / "budgets").exists()
    status = budget_status("two-folders", ledger)
    assert len(status["owners"]) == 2 and status["steps_reserved"] == 0
    assert counted[1] > counted[0] > 0  # the second composed on top of the first
    assert main(["budget", "status", "two-folders"]) == 0  # the default ledger, no --ledger
    assert "two-folders" in capsys.readouterr().out


def test_joining_a_cluster_warns_about_paths_the_other_nodes_would_not_see(tmp_path,
                                                                           monkeypatch):
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    pipeline = load_pipeline(SWEEP, ["budget.ledger=budgets", f"run.output_dir={tmp_path}/o"])
    assert cluster_warnings(pipeline, None) == []  # an embedded Ray: one machine, no warning
    assert cluster_warnings(pipeline, "local") == []
    warnings = cluster_warnings(pipeline, "10.0.0.1:6379")
    assert len(warnings) == 2
    assert warnings[0].startswith("run.output_dir: ") and "own disk" in warnings[0]
    assert warnings[1].startswith("budget.ledger: 'budgets' is relative")
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {}}))
    assert len(cluster_warnings(pipeline, None)) == 2  # a submitted job is on a cluster
    shared = load_pipeline(SWEEP, ["budget.ledger=s3://bucket/l", "run.output_dir=s3://b/o"])
    assert cluster_warnings(shared, "10.0.0.1:6379") == []


def test_a_network_file_system_counts_as_shared(tmp_path):
    mounts = tmp_path / "mounts"
    shared = tmp_path / "my share"
    shared.mkdir()  # the mount point; the ledger below it is made later
    mounts.write_text("/dev/vda / ext4 rw 0 0\n"
                      f"server:/export {str(shared).replace(' ', chr(92) + '040')} nfs4 rw 0 0\n")
    assert _filesystem_type(str(shared / "budgets" / "not-yet"), str(mounts)) == "nfs4"
    assert _filesystem_type(str(tmp_path / "elsewhere"), str(mounts)) == "ext4"
    assert _filesystem_type(str(tmp_path), str(tmp_path / "no-such-table")) is None


def test_validate_with_an_address_prints_the_warning_and_still_passes(tmp_path, capsys):
    code = main(["validate", SWEEP, "--address", "10.0.0.1:6379",
                 "--set", f"budget.ledger={tmp_path}/budgets"])
    err = capsys.readouterr().err
    assert code == 0
    assert f"warning: budget.ledger: {tmp_path}/budgets is on this machine's own disk" in err
    assert "would each grant the whole budget" in err
