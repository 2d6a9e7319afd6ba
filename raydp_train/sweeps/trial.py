"""One trial of a sweep, in its Tune trial process (`sweeps/runner.py` runs the Tuner): the
pipeline with the trial's values set, trained by the code `run` uses, spending from the
sweep's budget; its epochs reported to Tune, and its model saved for the sweep to keep."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

from raydp_train.checks.preflight import check_pipeline
from raydp_train.config.pipeline import Pipeline, dump_pipeline, pipeline_from_dict
from raydp_train.sweeps.resume import save_final, saved_final
from raydp_train.train.stops import StopReason

MODELS = "trial_models"  # each trained trial's model, until the sweep keeps the best
RUNS_IN_THIS_PROCESS: list[Path] = []  # the Ray Train runs this trial process drives
STOP_WAIT_S = 600  # Tune's own limit on a trial's cleanup (TUNE_FORCE_TRIAL_CLEANUP_S)


def ending_its_run(trainable):
    """`trainable` (run_trial with its parameters) as Tune's function trainable whose stop
    waits for its Ray Train run to end: the workers are asked to stop before their next epoch,
    and the trial process is not killed under them. Killed, the run's workers were never
    removed: their placement group kept its CPUs for as long as Ray ran, and a sweep whose
    trials ASHA stopped ran out of them and waited for ever."""
    from ray.train._internal.session import get_session
    from ray.tune.trainable.function_trainable import wrap_function

    from raydp_train.train.context import request_stop

    class EndsItsRun(wrap_function(trainable)):
        def cleanup(self):
            for run_dir in RUNS_IN_THIS_PROCESS:
                request_stop(run_dir)
            get_session().finish(timeout=STOP_WAIT_S)  # its thread: its run ended, it returned
            RUNS_IN_THIS_PROCESS.clear()
            super().cleanup()

    return EndsItsRun


def run_trial(params: dict, base: dict, budget, sweep_id: str, directory: str,
              resumed: bool = False, datasets: dict | None = None, checked=None) -> None:
    """One trial: the pipeline with `params` set, trained by the code `run` uses. `resumed`:
    the sweep's driver died and this one continues it (sweeps/resume.py). `datasets`: the
    sweep's splits as Ray Datasets, the same rows for every trial, read by its workers as
    run's read them; `checked`: their summary, checked by the sweep's driver."""
    from ray import tune

    from raydp_train.train.charges import planned_charges
    from raydp_train.train.trainer import fit

    overrides = [f"{key}={value}" for key, value in params.items()]
    pipeline = pipeline_from_dict(base, overrides, source=f"trial {params}")
    if checked is not None:  # Ray Datasets' summary, checked by the sweep's driver
        from raydp_train.data.ray_dataset_checks import widened

        checked = widened(checked)
    dataset, plan = check_pipeline(pipeline, checked=checked)
    trial_id = tune.get_context().get_trial_id()
    owner = f"{sweep_id}/{trial_id}"
    continued = continued_state(pipeline.training, resumed)  # PBT: from a trial ahead's
    final = saved_final(Path(directory) / MODELS / trial_id) if resumed else None
    if final is not None and continued is None:  # it ended before the driver died: no rerun
        tune.report(final)
        return
    # Under random stopping (no budget of its own) the sweep's one reservation pays for this
    # trial's planned steps, and no more.
    ceiling = planned_charges(plan) if budget is None else None
    to_tune = EpochsToTune(plan.epochs, pipeline.tune.scheduler == "pbt", continued)
    run_dir = _run_dir(Path(directory) / "train", trial_id, continued)
    if pipeline.training.workers == 1:
        result = _train_here(pipeline, plan, dataset, run_dir, to_tune, budget, owner, ceiling,
                             datasets)
    else:
        to_tune.run_dir = run_dir
        RUNS_IN_THIS_PROCESS.append(to_tune.run_dir)
        result = fit(pipeline, plan, to_tune.run_dir, on_epoch=to_tune.report, budget=budget,
                     owner=owner, dataset=dataset, ceiling=ceiling, ray_datasets=datasets,
                     concurrent_runs=pipeline.tune.max_concurrent_trials)
        if to_tune.stopped:  # by Tune (ASHA): nothing reads this trial's reports any more
            return
    # The last epoch reaches Tune only here, after the model is saved: ASHA stops a trial on
    # its report at max_t, which ended the trial before the save (no best model, and every
    # trial that trained to the end shown "stopped by scheduler").
    last = result.metrics[-1] if result.metrics else {"epoch": 0, "validation_accuracy": math.nan}
    report = {**last, "stop": result.stop.value, "stop_reason": result.stop_reason,
              "final": True, "continued_from_epoch": to_tune.continued_from_epoch,
              "epsilon": plan.epsilon(result.steps_charged, releases=result.releases_charged),
              "steps_charged": result.steps_charged}
    if result.steps_done:
        folder = _save_trial_model(Path(directory), trial_id, pipeline, plan, result)
        save_final(folder, report)
    tune.report(report)


def _train_here(pipeline: Pipeline, plan, dataset, run_dir: Path, to_tune, budget, owner: str,
                ceiling, datasets: dict | None = None):
    """A one-worker trial, in this process: its charges and checkpoints in `run_dir`, as a Ray
    Train run keeps them, so that it continues from there after its sweep's driver died.
    `datasets`: read whole, as one Ray Train worker reads its shard (`dataset`: their shape)."""
    from raydp_train.train.charges import RunAccount, RunCharges, epsilon_cap
    from raydp_train.train.context import LocalContext
    from raydp_train.train.worker import train

    run_dir.mkdir(parents=True, exist_ok=True)
    to_tune.own_checkpoints = run_dir
    account = RunAccount(RunCharges(str(run_dir)), budget, owner, plan,
                         epsilon_cap(pipeline, plan), ceiling)
    shards, shape = None, None
    if datasets is not None:
        from raydp_train.data.shards import one_worker_shards

        shards = one_worker_shards(datasets, pipeline, dataset.num_train)
        shape = (dataset.feature_shape, dataset.num_classes)
    context = LocalContext(on_epoch=to_tune.report, account=account,
                           sharing=pipeline.tune.max_concurrent_trials,
                           restored=_newest_state(run_dir), on_checkpoint=to_tune.report,
                           shards=shards)
    try:
        return train(pipeline, plan, context, dataset=dataset, data_shape=shape)
    finally:
        account.record.close()


class EpochsToTune:
    """A trial's epochs reported to Tune: all but the last (see run_trial), each with the
    state to continue from under PBT. One worker: called by the loop, with the epoch's state.
    Several: called by the trial's own thread that reads rank 0's rows (train/trainer.py),
    with the run's newest checkpoint.

    Tune stops a trial (ASHA) by a flag its reporting thread sees when its report returns: the
    report raises SystemExit there. One worker: that ends the trial's thread, as Tune means.
    Several: the workers are asked to stop before their next epoch, so the run ends and frees
    its workers, and nothing is reported again (no one would read it). Before, the Ray Train
    run reported through Tune's one-slot queue, which no one read once the trial was stopped:
    the run blocked on it for ever, holding its workers."""

    def __init__(self, last_epoch: int, checkpoints: bool, continued: dict | None):
        self.last_epoch, self.checkpoints, self.stopped = last_epoch, checkpoints, False
        self.run_dir: Path | None = None  # a Ray Train run's folder (several workers)
        self.own_checkpoints: Path | None = None  # one worker: where its epochs' states go
        self.continued_from_epoch = continued["epoch"] if continued else 0

    def report(self, row: dict, state: dict | None = None) -> None:
        from ray import tune

        from raydp_train.train.context import request_stop

        if self.stopped or row["epoch"] == self.last_epoch:
            return
        if self.own_checkpoints is not None and state is not None:
            _keep_newest(self.own_checkpoints, state)
        with tempfile.TemporaryDirectory() as folder:
            checkpoint = self._checkpoint(state, Path(folder)) if self.checkpoints else None
            try:
                tune.report({**row, "stop": StopReason.RUNNING.value,
                             "continued_from_epoch": self.continued_from_epoch},
                            checkpoint=checkpoint)
            except SystemExit:
                if self.run_dir is None:
                    raise
                self.stopped = True
                request_stop(self.run_dir)

    def _checkpoint(self, state: dict | None, folder: Path):
        from ray import tune

        from raydp_train.train.context import newest_checkpoint, write_checkpoint

        if state is not None:  # one worker: this epoch's, as a Ray Train checkpoint holds it
            write_checkpoint(folder, state)
            return tune.Checkpoint.from_directory(str(folder))
        newest = newest_checkpoint(self.run_dir)  # this epoch's, or the one before
        return None if newest is None else tune.Checkpoint.from_directory(str(newest))


def continued_state(training, resumed: bool = False) -> dict | None:
    """The checkpoint Tune hands this trial to continue from (PBT: a trial ahead's), with this
    trial's own learning rates and weight decays; None for a trial that starts afresh, or
    (`resumed`) that continues its own run folder, which holds a state as new as Tune's."""
    import torch
    from ray import tune

    from raydp_train.optim.optimizer import with_settings
    from raydp_train.train.context import STATE_FILE

    checkpoint = tune.get_checkpoint()
    if checkpoint is None:
        return None
    trial_dir = Path(tune.get_context().get_trial_dir())
    if resumed and Path(checkpoint.path).parent.name == trial_dir.name:
        return None
    with checkpoint.as_directory() as folder:
        state = torch.load(Path(folder) / STATE_FILE)
    return with_settings(state, training)


def _newest_state(run_dir: Path) -> dict | None:
    """The state of the newest whole checkpoint in `run_dir`, or None."""
    import torch

    from raydp_train.train.context import STATE_FILE, newest_checkpoint

    newest = newest_checkpoint(run_dir)
    return None if newest is None else torch.load(newest / STATE_FILE)


def _keep_newest(run_dir: Path, state: dict) -> None:
    """Write this epoch's checkpoint in `run_dir`, then drop the older ones."""
    from raydp_train.train.context import write_checkpoint

    folder = run_dir / f"checkpoint_{state['epoch']:06d}"
    folder.mkdir(exist_ok=True)
    write_checkpoint(folder, state)
    for older in run_dir.glob("checkpoint_*"):
        if older != folder:
            shutil.rmtree(older, ignore_errors=True)


def _run_dir(train_dir: Path, trial_id: str, continued: dict | None) -> Path:
    """The trial's run folder: its newest (where it continues after its sweep's driver died),
    or the first. Each time PBT continues the trial from another's checkpoint, a new one,
    holding that checkpoint to resume from: its own charges start empty, as the copied steps
    were charged to the trial that ran them."""
    from raydp_train.train.context import write_checkpoint

    copies = sorted(train_dir.glob(f"{trial_id}-*"), key=lambda p: int(p.name.split("-")[-1]))
    if continued is None:
        return copies[-1] if copies else train_dir / trial_id
    run_dir = train_dir / f"{trial_id}-{len(copies) + 1}"
    (run_dir / "checkpoint_continued").mkdir(parents=True)
    write_checkpoint(run_dir / "checkpoint_continued", continued)
    return run_dir


def _save_trial_model(directory: Path, trial_id: str, pipeline: Pipeline, plan, result) -> Path:
    """Every trial that trained writes its model and run record; the sweep keeps the best
    one's (`_keep_best_model`), so the sweep ends with a model without spending on a retrain."""
    from raydp_train.reports.run import privacy_statement, write_run_record

    folder = directory / MODELS / trial_id
    folder.mkdir(parents=True, exist_ok=True)  # PBT may end a trial twice
    (folder / "pipeline.yaml").write_text(dump_pipeline(pipeline))
    write_run_record(folder, pipeline, result,
                     privacy_statement(plan, result, pipeline.training.workers))
    return folder
