"""The same `run` command after an interruption finds the unfinished run (runs/reruns.py): which
run directories count as unfinished, and when continuing one is refused. No Ray: run
directories are made the way `run` makes them. (Ctrl-C and the rerun on a real Ray:
tests/test_faults.py.)"""

import json
import os
import subprocess
import sys

import pytest

from raydp_train.commands.cli import main
from raydp_train.config.pipeline import PipelineError, load_pipeline
from raydp_train.reports.run import new_run_dir
from raydp_train.runs.reruns import (
    DRIVER,
    RECORD,
    command_choices,
    driving,
    live_driver,
    resumed_run_dir,
    run_to_continue,
    unfinished_runs,
)
from raydp_train.sweeps.resume import SWEEP_RECORD, TRIALS, sweep_to_continue

QUICKSTART = "pipelines/quickstart.yaml"
COMMAND = "raydp-train run pipelines/quickstart.yaml"
CHOICES = command_choices(COMMAND)


@pytest.fixture
def pipeline(tmp_path):
    return load_pipeline(QUICKSTART, [f"run.output_dir={tmp_path}/runs"])


def test_only_unfinished_runs_of_this_very_pipeline_count(pipeline, tmp_path):
    finished = new_run_dir(pipeline)
    (finished / RECORD).write_text("{}")
    other = new_run_dir(load_pipeline(QUICKSTART, [f"run.output_dir={tmp_path}/runs",
                                                   "training.epochs=3"]))
    assert unfinished_runs(pipeline) == [] and run_to_continue(pipeline, QUICKSTART, CHOICES) is None
    older, newer = new_run_dir(pipeline), new_run_dir(pipeline)
    os.utime(older / "pipeline.yaml", (1, 1))
    assert unfinished_runs(pipeline) == [older, newer]
    assert run_to_continue(pipeline, QUICKSTART, CHOICES) == newer
    assert other not in unfinished_runs(pipeline)


def test_refuse_names_both_choices(tmp_path):
    pipeline = load_pipeline(QUICKSTART, [f"run.output_dir={tmp_path}/runs",
                                          "run.on_interrupted=refuse"])
    run_dir = new_run_dir(pipeline)
    with pytest.raises(PipelineError) as refused:
        run_to_continue(pipeline, QUICKSTART, CHOICES)
    message = str(refused.value)
    assert f"{COMMAND} --resume {run_dir}" in message and f"{COMMAND} --new" in message
    assert len(message.splitlines()) == 1


DRIVES = ("import sys, time, pathlib\nfrom raydp_train.runs.reruns import driving\n"
          "with driving(pathlib.Path(sys.argv[1])):\n    print('driving', flush=True)\n"
          "    time.sleep(60)\n")


def _driver_of(run_dir) -> subprocess.Popen:
    """Another process driving `run_dir`, as `raydp-train run` does, until killed."""
    driver = subprocess.Popen([sys.executable, "-c", DRIVES, str(run_dir)],
                              stdout=subprocess.PIPE, text=True)
    assert driver.stdout.readline() == "driving\n"
    return driver


@pytest.mark.slow
def test_a_run_whose_driver_still_runs_is_never_taken_over(pipeline):
    run_dir = new_run_dir(pipeline)
    driver = _driver_of(run_dir)
    try:
        with pytest.raises(PipelineError, match=f"pid {driver.pid} .* may still be running"):
            run_to_continue(pipeline, QUICKSTART, CHOICES)
    finally:
        driver.kill()
        driver.wait()
    assert run_to_continue(pipeline, QUICKSTART, CHOICES) == run_dir  # killed: continue it
    (run_dir / DRIVER).write_text(json.dumps({"host": "another-host", "pid": 1}))
    with pytest.raises(PipelineError, match="another-host"):  # cannot tell: never taken over
        run_to_continue(pipeline, QUICKSTART, CHOICES)


def test_the_driver_marker_goes_however_the_run_ends(pipeline):
    run_dir = new_run_dir(pipeline)
    with pytest.raises(KeyboardInterrupt), driving(run_dir):
        assert json.loads((run_dir / DRIVER).read_text())["pid"] == os.getpid()
        raise KeyboardInterrupt
    assert (run_dir / DRIVER).read_text() == "" and not live_driver(run_dir)


@pytest.mark.slow
def test_a_second_driver_on_a_run_directory_is_refused_before_it_charges(pipeline):
    """The mark is taken exclusively: a driver that passed run_to_continue just before the
    first one marked the directory (or came with --resume) is refused at the mark. Two
    drivers would each settle the other's unsettled steps as a dead attempt's, short."""
    run_dir = new_run_dir(pipeline)
    first = _driver_of(run_dir)
    try:
        theirs = (run_dir / DRIVER).read_text()
        with (pytest.raises(PipelineError, match=f"pid {first.pid} .* may still be running"),
              driving(run_dir)):
            pytest.fail("a second driver ran")
        assert (run_dir / DRIVER).read_text() == theirs  # left to the live driver
    finally:
        first.kill()  # as kill -9: its mark stays, its lock goes
        first.wait()
    with driving(run_dir):  # its driver is dead: the run is taken over
        assert json.loads((run_dir / DRIVER).read_text())["pid"] == os.getpid()


def test_a_finished_run_is_not_resumed(pipeline):
    run_dir = new_run_dir(pipeline)
    (run_dir / "record.json").write_text("{}")
    with pytest.raises(PipelineError, match="--resume: this run has finished"):
        resumed_run_dir(run_dir, pipeline)


@pytest.mark.slow
def test_new_and_resume_cannot_both_be_given(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["run", QUICKSTART, "--new", "--resume", "runs/x"])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


SWEEP = "pipelines/sweep_digits.yaml"


def _unfinished_sweep(pipeline):
    """A sweep directory as a killed driver leaves it: Tune's state there, no sweep.json."""
    directory = new_run_dir(pipeline, "sweep")
    (directory / TRIALS).mkdir()
    (directory / TRIALS / "tuner.pkl").write_bytes(b"")  # what Tuner.can_restore looks for
    return directory


@pytest.mark.slow
def test_the_same_tune_continues_the_unfinished_sweep_unless_told_otherwise(tmp_path):
    sweep_pipeline = load_pipeline(SWEEP, [f"run.output_dir={tmp_path}/runs"])
    assert sweep_to_continue(sweep_pipeline, SWEEP, new=False) is None
    finished = _unfinished_sweep(sweep_pipeline)
    (finished / SWEEP_RECORD).write_text("{}")
    new_run_dir(sweep_pipeline, "sweep")  # killed before Tune wrote its state: nothing to restore
    assert sweep_to_continue(sweep_pipeline, SWEEP, new=False) is None
    directory = _unfinished_sweep(sweep_pipeline)
    assert sweep_to_continue(sweep_pipeline, SWEEP, new=False) == directory
    assert sweep_to_continue(sweep_pipeline, SWEEP, new=True) is None
    assert directory not in unfinished_runs(sweep_pipeline)  # `run` does not take a sweep
    driver = _driver_of(directory)
    try:
        with pytest.raises(PipelineError, match=f"pid {driver.pid} .* may still be running"):
            sweep_to_continue(sweep_pipeline, SWEEP, new=False)
    finally:
        driver.kill()
        driver.wait()
    stopping = ["tune.selection=random_stopping", "tune.random_stopping={mean_trials: 2}",
                "tune.search_space={training.lr: {loguniform: [0.003, 0.03]}}"]
    for settings, message in ((["run.on_interrupted=refuse"], "run.on_interrupted: refuse"),
                              (stopping, "must stay secret")):
        other = load_pipeline(SWEEP, [f"run.output_dir={tmp_path}/{len(settings)}", *settings])
        _unfinished_sweep(other)
        with pytest.raises(PipelineError, match=message) as refused:
            sweep_to_continue(other, SWEEP, new=False)
        assert "--new" in str(refused.value) and len(str(refused.value).splitlines()) == 1
