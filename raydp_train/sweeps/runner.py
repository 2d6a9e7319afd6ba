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

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from raydp_train.budget.ledger import as_uri
from raydp_train.checks.preflight import check_pipeline
from raydp_train.checks.sweep_spending import (
    check_search_installed,
    check_search_space,
    draw_trial_count_of,
    first_refusal,
    random_stopping_spend,
)
from raydp_train.config.pipeline import Pipeline, dump_pipeline, pipeline_from_dict
from raydp_train.errors import user_error_in
from raydp_train.sweeps.best_alone import best_alone
from raydp_train.sweeps.progress import progress_printer
from raydp_train.sweeps.resume import TRIALS, close_dead_trials, restored_tuner, sweep_to_continue
from raydp_train.sweeps.search import param_space, scheduler, search_algorithm
from raydp_train.sweeps.trial import MODELS, ending_its_run, run_trial
from raydp_train.train.stops import REFUSALS, StopReason


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


def run_sweep(pipeline: Pipeline, connect, on_line=print_now, source: str = "<pipeline>",
              new: bool = False) -> SweepResult | None:
    """Check, reserve (random stopping), run every trial, and write the sweep's outputs; None
    when the budget cannot pay for one trial. The unfinished sweep of this pipeline whose
    driver died is continued (sweeps/resume.py), unless `new`."""

    from raydp_train.budget.actor import open_budget
    from raydp_train.data.ray_dataset_checks import portable
    from raydp_train.reports.run import new_run_dir
    from raydp_train.runs.reruns import DRIVER, driving

    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # our own progress lines, not Tune's
    config = pipeline.tune
    check_search_installed(config.search)  # in a moment: one line naming the extra, before Ray
    resumed = sweep_to_continue(pipeline, source, new)  # before Ray, and before any spending
    # First: text data is tokenized by Ray Data. The splits of Ray Datasets (else None) are
    # checked and counted here, once: every trial reads them as they are (sweeps/trial.py).
    splits = connect()
    dataset, plan = check_pipeline(pipeline, datasets=splits)
    check_search_space(pipeline, plan, None if splits is None else dataset)
    refusal = "" if resumed else first_refusal(pipeline, plan)
    if refusal:  # a spent budget: no trial, no sweep directory, no best.yaml
        on_line(f"STOPPED before any trial: {refusal}")
        return None
    directory = resumed or new_run_dir(pipeline, "sweep")
    on_line(f"{pipeline.name}: sweep over {', '.join(config.search_space)}; "
            f"directory {directory}\nledger: {as_uri(pipeline.budget.ledger)}")
    budget = open_budget(pipeline.budget, pipeline.privacy.unit)
    with driving(directory, source):
        if resumed:
            closed = close_dead_trials(directory, budget)
            on_line(f"continuing the unfinished sweep {directory} of this pipeline (its driver "
                    f"died; --new starts another): {closed} trial epochs cut short closed with "
                    "the steps they released; finished trials are not run again")
        rows = {} if splits is None else {"datasets": splits, "checked": portable(dataset)}
        sweep = _sweep_in(directory, pipeline, plan, dataset, budget, on_line, resumed is not None,
                          rows)
    (directory / DRIVER).unlink(missing_ok=True)  # ended (sweep.json): no driver to mark
    return sweep


def _sweep_in(directory: Path, pipeline: Pipeline, plan, dataset, budget, on_line,
              resumed: bool, rows: dict) -> SweepResult:
    """Run (or continue) the sweep's trials in `directory` and write its outputs; `rows`:
    run_trial's Ray Datasets and their checked summary, if any."""
    config = pipeline.tune
    sweep_id = directory.name
    num_samples, trial_budget = config.num_samples, budget
    privacy = {"selection": config.selection, "budget": pipeline.budget.name,
               "ledger": as_uri(pipeline.budget.ledger)}
    if config.selection == "random_stopping":
        num_samples = draw_trial_count_of(pipeline)
        spend = random_stopping_spend(pipeline, plan)
        decision = budget.reserve(sweep_id, spend)
        privacy.update(worst_case_noise_multiplier=spend.noise_multiplier,
                       released="the best trial only")
        if not decision.granted:
            on_line(f"STOPPED before any trial: {decision.reason}")
            return _finish(directory, pipeline, [], None, budget, privacy, dataset, on_line,
                           None)
        trial_budget = None  # the sweep's one reservation covers every trial
        on_line(f"random stopping: a random number of trials (mean "
                f"{config.random_stopping.mean_trials:g}), reserved epsilon "
                f"{decision.epsilon_after:.4f} for the whole sweep; only the best trial is "
                "released (ARCHITECTURE.md §2.7)")
    tuner = _tuner(pipeline, directory, trial_budget, num_samples, on_line, resumed, rows)
    grid = tuner.fit() if num_samples > 0 else None
    trials = [_trial_row(result, config) for result in grid or []]
    best = _best(trials, config)
    if trial_budget is None:  # the random-stopping sweep is over: its reservation is spent
        budget.settle(decision, spend.steps, spend.releases)
        trials, grid = best_alone(directory, trials, best, MODELS, grid, on_line), None
        best = trials[0] if trials else None
    return _finish(directory, pipeline, trials, best, budget, privacy, dataset, on_line, grid)


def _tuner(pipeline: Pipeline, directory: Path, trial_budget, num_samples: int, on_line,
           resumed: bool = False, rows: dict | None = None):
    """Ray Tune's Tuner of the sweep: each trial `run_trial`, spending from `trial_budget`
    (None: the sweep's one reservation covers every trial); `resumed`: restored from the
    sweep's folder, as its dead driver left it. `rows`: the Ray Datasets every trial reads
    (with their summary), handed to each trial through the object store, never written."""
    from ray import tune

    from raydp_train.reports.trackers import tune_callbacks

    config = pipeline.tune
    trainable = ending_its_run(tune.with_parameters(
        run_trial, base=pipeline.model_dump(mode="json"), budget=trial_budget,
        sweep_id=directory.name, directory=str(directory), resumed=resumed, **(rows or {})))
    # A trial that drives a Ray Train run needs little: its workers get their own placement group.
    cpus = 1 if pipeline.training.workers == 1 else 0.25
    trainable = tune.with_resources(trainable, {"cpu": cpus})
    # Under random stopping no trial's progress is shown: it would release every trial.
    callbacks = [] if trial_budget is None else [
        progress_printer(on_line, pipeline, trial_budget), *tune_callbacks(pipeline)]  # loggers
    if resumed:
        return restored_tuner(directory, trainable, param_space(config), callbacks)
    return tune.Tuner(
        trainable,
        param_space=param_space(config),
        tune_config=tune.TuneConfig(
            num_samples=num_samples, search_alg=search_algorithm(pipeline),
            scheduler=scheduler(pipeline), time_budget_s=config.time_budget_s,
            # The next trial runs in a finished one's process: no new process, no imports
            # (digits trials: ~5 s each before). Each trial builds all it uses anew. Not a
            # trial of several workers: one Tune stopped is still ending its Ray Train run
            # when Tune would reuse its process, and Tune then fails the next trial.
            reuse_actors=pipeline.training.workers == 1),
        run_config=tune.RunConfig(storage_path=str(directory.resolve()), name=TRIALS, verbose=0,
                                  callbacks=callbacks),
    )


def _keep_best_model(directory: Path, best: dict) -> Path | None:
    """Move the best trial's model to `best_model/` and drop the others' (never released)."""
    saved, kept = directory / MODELS / best["trial"], None
    if best["trial"] and saved.is_dir():
        kept = saved.rename(directory / "best_model")
        record = json.loads((kept / "record.json").read_text())
        record["written_to"]["run_dir"] = str(kept.resolve())  # where it is now
        (kept / "record.json").write_text(json.dumps(record, indent=2))
    shutil.rmtree(directory / MODELS, ignore_errors=True)
    return kept


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
    """Among the trials that trained as planned (their models are kept), else among those
    ASHA stopped part-way: one the budget cut short is no candidate for the model a sweep
    ends with."""
    pick = max if config.mode == "max" else min
    for stop in (StopReason.COMPLETED, StopReason.STOPPED_BY_SCHEDULER):
        scored = [t for t in trials if t["stop_reason"] == stop.value
                  and not math.isnan(t[config.metric])]
        if scored:
            return pick(scored, key=lambda t: t[config.metric])
    return None


def _finish(directory, pipeline, trials, best, budget, privacy, dataset, on_line, grid):
    from raydp_train.reports.sweep import best_yaml_header, write_sweep_outputs

    status = budget.status()
    privacy.update(
        epsilon=budget.epsilon_of(directory.name), delta=status["delta"],
        accountant=status["accountant"], budget_epsilon=status["epsilon"],
        budget_epsilon_counted=status["epsilon_counted"])
    if pipeline.tune.selection == "composition":  # random stopping keeps its count secret
        privacy["trials"] = len(trials)
    if best is not None:
        overrides = [f"{k}={best[k]}" for k in pipeline.tune.search_space]
        best_pipeline = pipeline_from_dict(pipeline.model_dump(mode="json"), overrides)
        kept = _keep_best_model(directory, best)
        best = {**best, "model": kept and str(kept)}
        (directory / "best.yaml").write_text(
            best_yaml_header(directory, best, pipeline) + dump_pipeline(best_pipeline))
    shutil.rmtree(directory / MODELS, ignore_errors=True)
    sweep = SweepResult(directory, trials, best, privacy, dataset.num_classes, grid)
    write_sweep_outputs(sweep, pipeline, on_line)
    return sweep

