"""The same `run` command after an interruption finds the unfinished run (runs/reruns.py): which
run directories count as unfinished, and when continuing one is refused. No Ray: run
directories are made the way `run` makes them. (Ctrl-C and the rerun on a real Ray:
tests/test_faults.py.)"""

import json
import os
import socket
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
    run_to_continue,
    unfinished_runs,
)

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


def test_a_run_whose_driver_still_runs_is_never_taken_over(pipeline):
    run_dir = new_run_dir(pipeline)
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run_dir / DRIVER).write_text(json.dumps({"host": socket.gethostname(),
                                                  "pid": driver.pid}))
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
    assert not (run_dir / DRIVER).exists()


def test_new_and_resume_cannot_both_be_given(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["run", QUICKSTART, "--new", "--resume", "runs/x"])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
