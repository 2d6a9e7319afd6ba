"""The same `run` command again after an interruption continues that run, never a second one.

A run directory whose `pipeline.yaml` is this very pipeline (resolved) and that has no
`record.json` was interrupted (Ctrl-C) or crashed. Pressing the up arrow and Enter must not
train on the same data again from scratch and spend a second time: with
`run.on_interrupted: resume` (the default) the next identical command continues the newest
such run from its last checkpoint, as `--resume` would, and its steps are charged to the same
owner; with `refuse` it stops and names both choices (`--resume DIR`, `--new`). `--new` always
starts another run. A run whose driver is still running (it holds the lock on `driver.json`,
which the system drops when it dies; or the file names another host, which cannot be asked)
is never taken over, by the same command or by `--resume`.
"""

from __future__ import annotations

import fcntl
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
    driver = live_driver(newest)
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


def resumed_run_dir(run_dir: str | Path, pipeline: Pipeline) -> Path:
    """The run directory to resume, after checking it belongs to this very pipeline."""
    saved = Path(run_dir) / "pipeline.yaml"
    if not saved.is_file():
        raise PipelineError(str(run_dir), ["--resume: not a run directory (no pipeline.yaml)"])
    if saved.read_text() != dump_pipeline(pipeline):
        raise PipelineError(
            str(run_dir), [f"--resume: {saved} is a different pipeline; resume with the same one"])
    if (Path(run_dir) / RECORD).exists():
        raise PipelineError(str(run_dir), [("--resume: this run has finished (record.json); "
                                           "start another with --new")])
    return Path(run_dir)


def command_choices(same_command: str) -> Callable[[Path], str]:
    """The two choices, for a user who typed `same_command`."""
    return lambda newest: (f"continue it with: {same_command} --resume {newest}, or start "
                           f"another run on the same data (spending again) with: "
                           f"{same_command} --new")


def unfinished_runs(pipeline: Pipeline) -> list[Path]:
    """Run directories of this very pipeline without a record, oldest first (not its sweeps')."""
    return [run_dir for run_dir in unfinished_dirs(pipeline, "", RECORD)
            if not run_dir.name.startswith(f"{pipeline.name}-sweep-")]


def unfinished_dirs(pipeline: Pipeline, kind: str, finished: str) -> list[Path]:
    """Directories `<name>[-<kind>]-*` (reports/run.new_run_dir) of this very pipeline without
    the file `finished` that marks them ended, oldest first."""
    output = pipeline.run.output_dir
    if "://" in output or not Path(output).is_dir():
        return []
    resolved = dump_pipeline(pipeline)
    found = []
    prefix = "-".join(filter(None, (pipeline.name, kind)))
    for saved in Path(output).resolve().glob(f"{prefix}-*/pipeline.yaml"):
        run_dir = saved.parent
        try:
            if not (run_dir / finished).exists() and saved.read_text() == resolved:
                found.append(run_dir)
        except OSError:  # unreadable: not a run this command can continue
            continue
    return sorted(found, key=lambda run_dir: (run_dir / "pipeline.yaml").stat().st_mtime)


@contextmanager
def driving(run_dir: Path, source: str = "<pipeline>"):
    """Mark `run_dir` as worked on by this driver until the block ends (however it ends).
    The mark is an exclusive lock that the system drops when the driver dies, however it dies:
    two drivers on one run directory would each settle the other's unsettled steps as a dead
    attempt's, short (charges.py)."""
    marker = os.open(run_dir / DRIVER, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        driver = _other_driver(marker)
        if driver:
            raise PipelineError(source, [(f"run: {run_dir} has a driver ({driver}) that may "
                                          "still be running: wait for it, or start another "
                                          "run (--new)")])
        _rewrite(marker, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        try:
            yield
        finally:
            _rewrite(marker, "")  # ended: nobody drives it
    finally:
        os.close(marker)  # drops the lock


def _other_driver(marker: int) -> str:
    """'pid N on HOST' of another driver that holds, or may hold, the run; else '' and the
    lock is this process's. Another host's driver cannot be asked: never taken over."""
    try:
        fcntl.flock(marker, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _named(marker) or "another process"
    driver = _named(marker)
    return driver if driver and not driver.endswith(f" on {socket.gethostname()}") else ""


def _named(marker: int) -> str:
    os.lseek(marker, 0, os.SEEK_SET)
    try:
        driver = json.loads(os.read(marker, 4096) or b"null")
        return f"pid {int(driver['pid'])} on {driver['host']}"
    except (ValueError, KeyError, TypeError):
        return ""  # empty (ended) or damaged


def _rewrite(marker: int, text: str) -> None:
    os.ftruncate(marker, 0)
    os.pwrite(marker, text.encode(), 0)


def live_driver(run_dir: Path) -> str:
    """'pid N on HOST' if the run's driver may still be running, else ''."""
    if not (run_dir / DRIVER).exists():
        return ""
    marker = os.open(run_dir / DRIVER, os.O_RDWR)
    try:
        return _other_driver(marker)
    finally:
        os.close(marker)  # drops the lock if it was free
