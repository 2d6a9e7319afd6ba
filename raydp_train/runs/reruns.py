"""The same `run` command again after an interruption continues that run, never a second one.

A run directory whose `pipeline.yaml` is this very pipeline (resolved) and that has no
`record.json` was interrupted (Ctrl-C) or crashed. Pressing the up arrow and Enter must not
train on the same data again from scratch and spend a second time: with
`run.on_interrupted: resume` (the default) the next identical command continues the newest
such run from its last checkpoint, as `--resume` would, and its steps are charged to the same
owner; with `refuse` it stops and names both choices (`--resume DIR`, `--new`). `--new` always
starts another run. A run whose driver is still running (its `driver.json` names a live
process on this host, or another host) is never taken over.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from raydp_train.config.pipeline import Pipeline, PipelineError, dump_pipeline

RECORD = "record.json"  # written once a run has ended (completed or stopped): finished
DRIVER = "driver.json"  # the driver working on a run directory now


def run_to_continue(pipeline: Pipeline, source: str,
                    choices: Callable[[Path], str]) -> Path | None:
    """The newest unfinished run of this pipeline, if the pipeline says to continue it;
    None if there is none. Refuses (PipelineError) where continuing is not allowed, saying
    `choices(that run)`: how to continue it or start another (command_choices)."""
    unfinished = unfinished_runs(pipeline)
    if not unfinished:
        return None
    newest = unfinished[-1]
    choice = choices(newest)
    driver = _live_driver(newest)
    if driver:
        problem = (f"run: {newest} is a run of this pipeline that has not finished and whose "
                   f"driver ({driver}) may still be running: wait for it; if it is gone, "
                   f"{choice}")
        raise PipelineError(source, [problem])
    if pipeline.run.on_interrupted == "refuse":
        problem = (f"run.on_interrupted: refuse, and {newest} is an unfinished run of this "
                   f"pipeline: {choice}")
        raise PipelineError(source, [problem])
    return newest


def command_choices(same_command: str) -> Callable[[Path], str]:
    """The two choices, for a user who typed `same_command`."""
    return lambda newest: (f"continue it with: {same_command} --resume {newest}, or start "
                           f"another run on the same data (spending again) with: "
                           f"{same_command} --new")


def unfinished_runs(pipeline: Pipeline) -> list[Path]:
    """Run directories of this very pipeline without a record, oldest first."""
    output = pipeline.run.output_dir
    if "://" in output or not Path(output).is_dir():
        return []
    resolved = dump_pipeline(pipeline)
    runs = []
    for saved in Path(output).resolve().glob(f"{pipeline.name}-*/pipeline.yaml"):
        run_dir = saved.parent
        try:
            if not (run_dir / RECORD).exists() and saved.read_text() == resolved:
                runs.append(run_dir)
        except OSError:  # unreadable: not a run this command can continue
            continue
    return sorted(runs, key=lambda run_dir: (run_dir / "pipeline.yaml").stat().st_mtime)


@contextmanager
def driving(run_dir: Path):
    """Mark `run_dir` as worked on by this driver until the block ends (however it ends)."""
    marker = run_dir / DRIVER
    marker.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    try:
        yield
    finally:
        marker.unlink(missing_ok=True)


def _live_driver(run_dir: Path) -> str:
    """'pid N on HOST' if the run's driver may still be running, else ''."""
    try:
        driver = json.loads((run_dir / DRIVER).read_text())
        host, pid = str(driver["host"]), int(driver["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""  # no marker (ended, or killed before writing one) or a damaged one
    if host == socket.gethostname() and not _alive(pid):
        return ""  # killed (kill -9, a crash): its marker stayed behind
    return f"pid {pid} on {host}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid != os.getpid()
