"""`raydp-train tune`: a Ray Tune sweep whose every trial spends from ONE global budget.

The driver checks every value the search space can produce, opens the budget's accountant
(from the driver, so it outlives the trials), and runs the Tuner. Each trial runs the same
training code as `raydp-train run`: in the trial process for one worker, or as a Ray Train run
for several. The sweep's privacy (ARCHITECTURE.md §2.7):

- `selection: composition` (default, valid for any adaptive search): every trial reserves its
  epochs from the budget; the sweep costs the composition of all of its trials' events.
- `selection: random_stopping` (random search only): the number of trials K is drawn at random
  (Papernot & Steinke 2022) and the whole sweep is ONE RepeatAndSelect reservation, made
  before any trial starts, for the worst trial the search space allows.

The selection metric is validation accuracy, on rows declared public or released with noise
(the pipeline schema refuses a sweep that would select on private rows otherwise).
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from raydp_train.budget.ledger import as_uri
from raydp_train.checks.preflight import check_pipeline
from raydp_train.config.pipeline import Pipeline, dump_pipeline, pipeline_from_dict
from raydp_train.config.sweep import WHOLE_NUMBERS
from raydp_train.runs.worker_errors import user_error_in
from raydp_train.sweeps.spending import (
    check_search_space,
    draw_trial_count_of,
    first_refusal,
    most_epochs,
    random_stopping_spend,
)
from raydp_train.train.stops import REFUSALS, StopReason

MODELS = "trial_models"  # each trained trial's model, until the sweep keeps the best


def print_now(line: str) -> None:
    print(line, flush=True)


@dataclass
class SweepResult:
    directory: Path
    trials: list[dict]  # one row per trial: parameters, epsilon, metrics, stop reason
    best: dict | None
    privacy: dict
    num_classes: int  # for the chance line of the plot
    result_grid: object = None  # Ray Tune's ResultGrid of the trials (None: none ran)

    @property
    def finished_trials(self) -> int:
        return sum(t["stop_reason"] == StopReason.COMPLETED.value for t in self.trials)


def run_sweep(pipeline: Pipeline, connect, on_line=print_now) -> SweepResult | None:
    """Check, reserve (random stopping), run every trial, and write the sweep's outputs; None
    when the budget cannot pay for one trial."""

    from raydp_train.budget.actor import open_budget
    from raydp_train.reports.run import new_run_dir

    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # our own progress lines, not Tune's
    config = pipeline.tune
    connect()  # first: text data is tokenized by Ray Data
    dataset, plan = check_pipeline(pipeline)
    check_search_space(pipeline, plan)
    refusal = first_refusal(pipeline, plan)
    if refusal:  # a spent budget: no trial, no sweep directory, no best.yaml
        on_line(f"STOPPED before any trial: {refusal}")
        return None
    directory = new_run_dir(pipeline, "sweep")
    on_line(f"{pipeline.name}: sweep over {', '.join(config.search_space)}; "
            f"directory {directory}\nledger: {as_uri(pipeline.budget.ledger)}")
    budget = open_budget(pipeline.budget)
    sweep_id = directory.name
    num_samples, trial_budget = config.num_samples, budget
    privacy = {"selection": config.selection, "budget": pipeline.budget.name,
               "ledger": as_uri(pipeline.budget.ledger)}
    if config.selection == "random_stopping":
        num_samples = draw_trial_count_of(pipeline)
        spend = random_stopping_spend(pipeline, plan)
        decision = budget.reserve(sweep_id, spend)
        privacy.update(trials_drawn=num_samples,
                       worst_case_noise_multiplier=spend.noise_multiplier)
        if not decision.granted:
            on_line(f"STOPPED before any trial: {decision.reason}")
            return _finish(directory, pipeline, [], None, budget, privacy, dataset, on_line,
                           None)
        trial_budget = None  # the sweep's one reservation covers every trial
        on_line(f"random stopping: {num_samples} trial(s) drawn (mean "
                f"{config.random_stopping.mean_trials:g}), reserved epsilon "
                f"{decision.epsilon_after:.4f} for the whole sweep")
    tuner = _tuner(pipeline, directory, trial_budget, num_samples, on_line)
    grid = tuner.fit() if num_samples > 0 else None
    if trial_budget is None:  # the random-stopping sweep is over: its reservation is spent
        budget.settle(decision, spend.steps, spend.releases)
    trials = [_trial_row(result, config) for result in grid or []]
    best = _best(trials, config)
    return _finish(directory, pipeline, trials, best, budget, privacy, dataset, on_line, grid)


def _tuner(pipeline: Pipeline, directory: Path, trial_budget, num_samples: int, on_line):
    """Ray Tune's Tuner of the sweep: each trial `run_trial`, spending from `trial_budget`
    (None: the sweep's one reservation covers every trial)."""
    from ray import tune

    from raydp_train.reports.trackers import tune_callbacks

    config = pipeline.tune
    trainable = tune.with_parameters(
        run_trial, base=pipeline.model_dump(mode="json"), budget=trial_budget,
        sweep_id=directory.name, directory=str(directory))
    # A trial that drives a Ray Train run needs little: its workers get their own placement group.
    cpus = 1 if pipeline.training.workers == 1 else 0.25
    return tune.Tuner(
        tune.with_resources(trainable, {"cpu": cpus}),
        param_space=_param_space(config),
        tune_config=tune.TuneConfig(
            num_samples=num_samples, max_concurrent_trials=config.max_concurrent_trials,
            scheduler=_scheduler(pipeline), time_budget_s=config.time_budget_s),
        run_config=tune.RunConfig(storage_path=str(directory.resolve()), name="trials", verbose=0,
                                  callbacks=[_progress_printer(on_line, pipeline),
                                             *tune_callbacks(pipeline)]),  # run.loggers
    )


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
        tune.report({**row, "stop": StopReason.RUNNING.value})

    if pipeline.training.workers == 1:
        account = RunAccount(MemoryCharges(), budget, owner, plan, epsilon_cap(pipeline, plan),
                             ceiling)
        context = LocalContext(on_epoch=report, account=account,
                               sharing=pipeline.tune.max_concurrent_trials)
        result = train(pipeline, plan, context, dataset=dataset)
    else:
        from ray.tune.integration.ray_train import TuneReportCallback

        result = fit(pipeline, plan, Path(directory) / "train" / trial_id, on_epoch=lambda r: None,
                     budget=budget, owner=owner, callbacks=[TuneReportCallback()],
                     dataset=dataset, ceiling=ceiling,
                     concurrent_runs=pipeline.tune.max_concurrent_trials)
    if result.steps_done:
        _save_trial_model(Path(directory), trial_id, pipeline, plan, result)
    last = result.metrics[-1] if result.metrics else {"epoch": 0, "validation_accuracy": math.nan}
    tune.report({**last, "stop": result.stop.value, "stop_reason": result.stop_reason,
                 "final": True,
                 "epsilon": plan.epsilon(result.steps_charged, releases=result.releases_charged),
                 "steps_charged": result.steps_charged})


def _save_trial_model(directory: Path, trial_id: str, pipeline: Pipeline, plan, result) -> None:
    """Every trial that trained writes its model and run record; the sweep keeps the best
    one's (`_keep_best_model`), so the sweep ends with a model without spending on a retrain."""
    from raydp_train.reports.run import privacy_statement, write_run_record

    folder = directory / MODELS / trial_id
    folder.mkdir(parents=True)
    (folder / "pipeline.yaml").write_text(dump_pipeline(pipeline))
    write_run_record(folder, pipeline, result,
                     privacy_statement(plan, result, pipeline.training.workers))


def _keep_best_model(directory: Path, best: dict) -> Path | None:
    """Move the best trial's model to `best_model/` and drop the others' (never released)."""
    saved, kept = directory / MODELS / best["trial"], None
    if best["trial"] and saved.is_dir():
        kept = saved.rename(directory / "best_model")
    shutil.rmtree(directory / MODELS, ignore_errors=True)
    return kept


def _progress_printer(on_line, pipeline: Pipeline):
    """One line per trial epoch and per finished trial, on the driver."""
    from ray.tune import Callback

    metric = pipeline.tune.metric
    # "epoch 3/20", unless the trials differ in epochs
    of = "" if "training.epochs" in pipeline.tune.search_space else f"/{pipeline.training.epochs}"

    class ProgressPrinter(Callback):
        def on_trial_result(self, iteration, trials, trial, result, **info):
            if result.get("final"):
                on_line(f"  {trial.trial_id}  {result['stop']}  "
                        f"(trial epsilon {result['epsilon']:.3f})")
            elif "epoch" in result and "epsilon" in result:
                on_line(f"  {trial.trial_id}  epoch {result['epoch']}{of}  {metric} "
                        f"{result.get(metric, math.nan):.4f}  epsilon {result['epsilon']:.3f}")

    return ProgressPrinter()


def _param_space(config) -> dict:
    from ray import tune

    make = {"choice": tune.choice, "grid": tune.grid_search,
            "uniform": lambda b: tune.uniform(*b), "loguniform": lambda b: tune.loguniform(*b)}
    return {key: make[d.kind]([int(v) for v in d.values()] if key in WHOLE_NUMBERS
                              else getattr(d, d.kind))
            for key, d in config.search_space.items()}


def _scheduler(pipeline: Pipeline):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    config = pipeline.tune
    if config.scheduler == "fifo":
        return FIFOScheduler()
    return ASHAScheduler(
        time_attr="epoch", metric=config.metric, mode=config.mode,
        max_t=most_epochs(pipeline), grace_period=config.asha.grace_period,
        reduction_factor=config.asha.reduction_factor)


def _trial_row(result, config) -> dict:
    metrics = result.metrics or {}
    # A trial the time budget ended before it started has no config and no metrics.
    row = {"trial": metrics.get("trial_id", ""), **dict.fromkeys(config.search_space),
           **(result.config or {})}
    default_stop = StopReason.FAILED if result.error else (
        StopReason.STOPPED_BY_SCHEDULER if metrics else StopReason.NOT_STARTED)
    stop = StopReason(metrics.get("stop", default_stop))
    if stop is StopReason.RUNNING:  # ASHA ended it after an epoch report
        stop = StopReason.STOPPED_BY_SCHEDULER
    # Refusals are shown without their long reasons; a final report's other stops in full.
    shown = metrics["stop_reason"] if metrics.get("final") and stop not in REFUSALS else stop.value
    row.update(
        epochs=metrics.get("epoch", 0), steps_charged=metrics.get("steps_charged"),
        epsilon=metrics.get("epsilon", math.nan),
        validation_accuracy=metrics.get("validation_accuracy", math.nan),
        test_accuracy=metrics.get("test_accuracy", math.nan),
        stop_reason=shown)
    if result.error:  # the user's own error under Ray's wrappers, else Ray's first line
        found = user_error_in(result.error)
        row["error"] = str(found) if found else str(result.error).splitlines()[0]
    return row


def _best(trials: list[dict], config) -> dict | None:
    """Among the trials that trained as planned (or until ASHA compared them): one the budget
    cut short is no candidate for the model a sweep ends with."""
    scored = [t for t in trials if t["stop_reason"] in (StopReason.COMPLETED.value,
                                                        StopReason.STOPPED_BY_SCHEDULER.value)
              and not math.isnan(t[config.metric])]
    if not scored:
        return None
    pick = max if config.mode == "max" else min
    return pick(scored, key=lambda t: t[config.metric])


def _finish(directory, pipeline, trials, best, budget, privacy, dataset, on_line, grid):
    from raydp_train.reports.sweep import best_yaml_header, write_sweep_outputs

    status = budget.status()
    privacy.update(
        epsilon=budget.epsilon_of(directory.name), delta=status["delta"],
        accountant=status["accountant"], budget_epsilon=status["epsilon"],
        budget_epsilon_counted=status["epsilon_counted"], trials=len(trials))
    if best is not None:
        overrides = [f"{k}={best[k]}" for k in pipeline.tune.search_space]
        best_pipeline = pipeline_from_dict(pipeline.model_dump(mode="json"), overrides)
        best = {**best, "model": str(_keep_best_model(directory, best))}
        (directory / "best.yaml").write_text(
            best_yaml_header(directory, best, pipeline) + dump_pipeline(best_pipeline))
    shutil.rmtree(directory / MODELS, ignore_errors=True)
    sweep = SweepResult(directory, trials, best, privacy, dataset.num_classes, grid)
    write_sweep_outputs(sweep, pipeline, on_line)
    return sweep

