"""The same `tune` command again after its driver died continues that sweep, never a second one.

A sweep directory whose `pipeline.yaml` is this very pipeline, that has no `sweep.json` (written
when a sweep ends) and whose Tune experiment `Tuner.can_restore` was left by a driver that died
(kill -9, a lost node). As `run` does (runs/reruns.py), the same command continues it, unless
`run.on_interrupted: refuse` or `--new`; a sweep whose driver still runs is never taken over.
It continues through Ray Tune's own `Tuner.restore`: the trials Tune recorded as finished are
not run again, and the others continue from their own checkpoints (each trial's run folder
under `train/`, as `run --resume` continues a run).

No step is charged twice: before any trial continues, each trial's charges are closed with
what its dead attempt released (its release log: train/charges.py), and a trial that had
already saved its final report (after its model) reports it again instead of training again
(Tune's record of the sweep may be a few seconds older than the trials' own).

A random-stopping sweep is not continued: its number of trials K was drawn by the driver that
died and must stay secret, and its one reservation stays counted.
"""

from __future__ import annotations

import json
from pathlib import Path

from raydp_train.config.pipeline import Pipeline, PipelineError

SWEEP_RECORD = "sweep.json"  # written once a sweep has ended
TRIALS = "trials"  # Tune's experiment folder in a sweep directory
FINAL = "final.json"  # a trial's final report, saved beside its model


def sweep_to_continue(pipeline: Pipeline, source: str, new: bool) -> Path | None:
    """The newest unfinished sweep of this pipeline that Tune can restore, if the pipeline
    says to continue it; None for a new sweep. Refuses (PipelineError) where it may not."""
    from ray.tune import Tuner

    from raydp_train.runs.reruns import live_driver, unfinished_dirs

    if new:
        return None
    unfinished = [d for d in unfinished_dirs(pipeline, "sweep", SWEEP_RECORD)
                  if Tuner.can_restore(d / TRIALS)]
    if not unfinished:
        return None
    newest = unfinished[-1]
    another = "or start another sweep (spending again) with --new"
    driver = live_driver(newest)
    if driver:
        raise PipelineError(source, [(
            f"tune: {newest} is a sweep of this pipeline that has not finished and whose "
            f"driver ({driver}) may still be running: wait for it, {another}")])
    if pipeline.run.on_interrupted == "refuse":
        raise PipelineError(source, [(
            f"run.on_interrupted: refuse, and {newest} is an unfinished sweep of this pipeline: "
            f"set run.on_interrupted=resume to continue it, {another}")])
    if pipeline.tune.selection == "random_stopping":
        raise PipelineError(source, [(
            f"tune.selection: random_stopping: {newest} is an unfinished sweep of this pipeline "
            "and cannot be continued (its number of trials, drawn by the driver that died, must "
            f"stay secret; its reservation stays counted): {another}")])
    return newest


def restored_tuner(directory: Path, trainable, param_space: dict, callbacks: list):
    """Tune's Tuner of the sweep in `directory`, restored: its finished trials stay finished,
    the unfinished ones run again (from their own checkpoints, see run_trial)."""
    from ray import tune

    tuner = tune.Tuner.restore(str(directory / TRIALS), trainable=trainable,
                               resume_unfinished=True, param_space=param_space)
    # The callbacks were pickled by the driver that died: this driver's own print here. Tune
    # offers no argument for them on restore.
    tuner._local_tuner.get_run_config().callbacks = callbacks
    return tuner


def close_dead_trials(directory: Path, budget) -> int:
    """Close what each trial of the dead driver reserved with what it released (its charge
    files and release log, under train/<trial>); returns how many reservations closed. Every
    attempt is dead here: this driver has started no trial yet."""
    from raydp_train.train.charges import RunCharges

    closed = 0
    for run_dir in sorted(p for p in (directory / "train").glob("*") if p.is_dir()):
        closings = RunCharges(str(run_dir)).dead_closings()
        if closings and budget is not None:
            closed += budget.close_requests(closings)
    return closed


def save_final(folder: Path, report: dict) -> None:
    (folder / FINAL).write_text(json.dumps(report))


def saved_final(folder: Path) -> dict | None:
    """The final report a trial saved before its driver died (its model saved too), or None."""
    try:
        return json.loads((folder / FINAL).read_text())
    except (OSError, ValueError):
        return None
