"""One trial of a sweep, in its Tune trial process (`sweeps/runner.py` runs the Tuner): the
pipeline with the trial's values set, trained by the code `run` uses, spending from the
sweep's budget; its epochs reported to Tune, and its model saved for the sweep to keep."""

from __future__ import annotations

import math
from pathlib import Path

from raydp_train.checks.preflight import check_pipeline
from raydp_train.config.pipeline import Pipeline, dump_pipeline, pipeline_from_dict
from raydp_train.train.stops import StopReason

MODELS = "trial_models"  # each trained trial's model, until the sweep keeps the best


def run_trial(params: dict, base: dict, budget, sweep_id: str, directory: str) -> None:
    """One trial: the pipeline with `params` set, trained by the code `run` uses."""
    from ray import tune

    from raydp_train.train.charges import (
        MemoryCharges,
        RunAccount,
        epsilon_cap,
        planned_charges,
    )
    from raydp_train.train.context import LocalContext
    from raydp_train.train.trainer import fit
    from raydp_train.train.worker import train

    overrides = [f"{key}={value}" for key, value in params.items()]
    pipeline = pipeline_from_dict(base, overrides, source=f"trial {params}")
    dataset, plan = check_pipeline(pipeline)
    trial_id = tune.get_context().get_trial_id()
    owner = f"{sweep_id}/{trial_id}"

    # Under random stopping (no budget of its own) the sweep's one reservation pays for this
    # trial's planned steps, and no more.
    ceiling = planned_charges(plan) if budget is None else None

    def report(row: dict) -> None:
        if row["epoch"] != plan.epochs:  # the last one: in the final report
            tune.report({**row, "stop": StopReason.RUNNING.value})

    if pipeline.training.workers == 1:
        account = RunAccount(MemoryCharges(), budget, owner, plan, epsilon_cap(pipeline, plan),
                             ceiling)
        context = LocalContext(on_epoch=report, account=account,
                               sharing=pipeline.tune.max_concurrent_trials)
        result = train(pipeline, plan, context, dataset=dataset)
    else:
        run_dir = Path(directory) / "train" / trial_id
        to_tune = EpochsToTune(plan.epochs, run_dir)
        result = fit(pipeline, plan, run_dir, on_epoch=to_tune.report, budget=budget,
                     owner=owner, dataset=dataset, ceiling=ceiling,
                     concurrent_runs=pipeline.tune.max_concurrent_trials)
        if to_tune.stopped:  # by Tune (ASHA): nothing reads this trial's reports any more
            return
    # The last epoch reaches Tune only here, after the model is saved: ASHA stops a trial on
    # its report at max_t, which ended the trial before the save (no best model, and every
    # trial that trained to the end shown "stopped by scheduler").
    if result.steps_done:
        _save_trial_model(Path(directory), trial_id, pipeline, plan, result)
    last = result.metrics[-1] if result.metrics else {"epoch": 0, "validation_accuracy": math.nan}
    tune.report({**last, "stop": result.stop.value, "stop_reason": result.stop_reason,
                 "final": True,
                 "epsilon": plan.epsilon(result.steps_charged, releases=result.releases_charged),
                 "steps_charged": result.steps_charged})


class EpochsToTune:
    """Rank 0's epoch rows of a trial's Ray Train run, as the trial's own thread reads them
    (train/trainer.py), reported to Tune: all but the last (see run_trial).

    Tune stops a trial (ASHA) by a flag its reporting thread sees when its report returns: the
    report raises SystemExit there. The workers are then asked to stop before their next
    epoch, so the run ends and frees its workers, and nothing is reported again (no one would
    read it). Before, the Ray Train run reported through Tune's one-slot queue, which no one
    read once the trial was stopped: the run blocked on it for ever, holding its workers."""

    def __init__(self, last_epoch: int, run_dir: Path):
        self.last_epoch, self.run_dir, self.stopped = last_epoch, run_dir, False

    def report(self, row: dict) -> None:
        from ray import tune

        from raydp_train.train.context import request_stop

        if self.stopped or row["epoch"] == self.last_epoch:
            return
        try:
            tune.report({**row, "stop": StopReason.RUNNING.value})
        except SystemExit:
            self.stopped = True
            request_stop(self.run_dir)


def _save_trial_model(directory: Path, trial_id: str, pipeline: Pipeline, plan, result) -> None:
    """Every trial that trained writes its model and run record; the sweep keeps the best
    one's (`_keep_best_model`), so the sweep ends with a model without spending on a retrain."""
    from raydp_train.reports.run import privacy_statement, write_run_record

    folder = directory / MODELS / trial_id
    folder.mkdir(parents=True)
    (folder / "pipeline.yaml").write_text(dump_pipeline(pipeline))
    write_run_record(folder, pipeline, result,
                     privacy_statement(plan, result, pipeline.training.workers))
