"""The Python API: what `raydp-train validate | run | tune` do, as functions that
return results; the CLI parses its arguments, calls these and prints.

    import raydp_train as rt

    pipeline = rt.Pipeline.from_yaml("pipelines/quickstart.yaml", overrides=["training.epochs=5"])
    plan = rt.validate(pipeline)     # every check, and what it will spend; starts no Ray
    result = rt.run(pipeline)        # an embedded Ray, or address="host:6379"
    print(result.epsilon, result.run_dir)

Bad input raises the typed `UserError`s that the CLI prints as one line, before any budget is
reserved. `run` prints what the CLI prints (the epoch rows, progress within long epochs)
unless given other `on_line` / `on_epoch` / `on_progress` callbacks (None: silent).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from raydp_train.config.pipeline import Pipeline, PipelineError
from raydp_train.reports.console import epoch_printer, progress_printer, run_header
from raydp_train.reports.trackers import check_loggers
from raydp_train.train.stops import StopReason

# The stop reason of a run a second Ctrl-C ended at once, inside an epoch.
ABORTED = "interrupted at once by a second Ctrl-C: the epoch that was running stays counted"


def _say(line: str) -> None:
    print(line, flush=True)


def _silent(*_) -> None:
    pass


@dataclass
class RunResult:
    run_dir: Path
    # completed; stopped (the budget, or the target epsilon, ended it early); interrupted
    # (Ctrl-C: continue with run(..., resume=run_dir)); nothing trained (no directory kept)
    status: str
    stop_reason: str
    metrics: list[dict] = field(default_factory=list)  # one row per epoch
    privacy: dict = field(default_factory=dict)  # privacy.json: epsilon by both accountants, ...
    record: Path | None = None  # record.json, once the run ended
    budget: dict | None = None  # the global budget's status after the run
    ray_result: object = None  # Ray Train's Result (its checkpoint: the last epoch's state)
    stop: StopReason | None = None  # why it stopped (stop_reason: as shown)

    @property
    def epsilon(self) -> float | None:
        return self.privacy.get("epsilon")

    @property
    def checkpoint(self):
        """Ray Train's last checkpoint of the run (model, optimizer and schedule state)."""
        return None if self.ray_result is None else self.ray_result.checkpoint

    @property
    def model(self) -> Path | None:
        """The released model's state dict (load it with raydp_train.models.predictions.load_model)."""
        path = self.run_dir / "model.pt"
        return path if self.record is not None and path.is_file() else None


@dataclass(frozen=True)
class Plan:
    """What validate found: the run's PrivacyPlan (its fields and `epsilon()` read through:
    `plan.steps`, `plan.sampling_rate`, ...), a sweep's whole epsilon, and the budget's
    epsilon left and whether it can pay all of it (None where there is no sweep, no budget)."""

    privacy: object  # plan.PrivacyPlan
    sweep_epsilon: float | None = None
    budget_epsilon_left: float | None = None
    budget_can_pay: bool | None = None

    def __getattr__(self, name: str):
        if name == "privacy":  # not set yet (a copy being made): no delegation loop
            raise AttributeError(name)
        return getattr(self.privacy, name)


def validate(pipeline: Pipeline, *, check_model: bool = False, address: str | None = None,
             source: str = "<pipeline>") -> Plan:
    """Every check `run` makes before it spends, without Ray or a model's weights; the Plan.
    `address`: warn about paths a cluster's nodes would not share."""
    from raydp_train.checks.validation import spending

    plan = checked(pipeline, check_model=check_model, address=address, source=source)[1]
    return Plan(plan, **spending(pipeline, plan))


def checked(pipeline: Pipeline, *, check_model: bool = False, address: str | None = None,
            source: str = "<pipeline>"):
    """validate's checks; (the Dataset as read, the PrivacyPlan)."""
    from raydp_train.checks.preflight import check_pipeline
    from raydp_train.data.ray_datasets import require_rows
    from raydp_train.runs.locations import check_locations, warn_if_not_shared

    require_rows(pipeline, source)  # a ray_dataset pipeline gets its rows from run() alone
    check_locations(pipeline, source)
    check_loggers(pipeline, source)
    warn_if_not_shared(pipeline, address)
    return check_pipeline(pipeline, for_training=False, build_model=check_model)


def run(pipeline: Pipeline, *, address: str | None = None, resume: str | Path | None = None,
        new: bool = False, verbose: bool = False, source: str = "<pipeline>",
        on_line: Callable[[str], None] | None = _say, on_epoch: Callable | None = ...,
        on_progress: Callable | None = ..., rerun_choices: Callable[[Path], str] | None = None,
        datasets: dict | None = None, scaling_config=None, run_config=None) -> RunResult:
    """Train the pipeline on Ray Train (joining `address`, else an embedded Ray) and write its
    run directory. An unfinished run of the same pipeline is continued (run.on_interrupted),
    unless `new`; `resume` names the one to continue. `datasets`: {"train": ray.data.Dataset,
    "test": ...} of a ray_dataset pipeline (data/ray_datasets.py; again to resume).
    `scaling_config` / `run_config`: Ray Train's own, onto the pipeline (train/ray_configs.py)."""
    from raydp_train.reports.run import new_run_dir, privacy_statement, write_run_record
    from raydp_train.reports.trackers import RunTrackers
    from raydp_train.runs.reruns import driving
    from raydp_train.runs.worker_errors import explain
    from raydp_train.train.ray_configs import storage_of
    from raydp_train.train.trainer import RunInterrupted, fit

    on_line, epochs = on_line or _silent, pipeline.training.epochs
    on_epoch = epoch_printer(epochs) if on_epoch is ... else on_epoch or _silent
    on_progress = progress_printer(epochs) if on_progress is ... else on_progress or _silent
    pipeline, settings, splits, dataset, plan = _prepare_run(
        pipeline, address, verbose, source, datasets, (scaling_config, run_config))
    resumed = _run_to_resume(pipeline, resume, new, source, rerun_choices, on_line)
    settings = storage_of(resumed, settings, source)  # a resumed run's checkpoints: where they are
    budget = _open_budget(pipeline, on_line)  # refused before a run directory is made
    run_dir = resumed or new_run_dir(pipeline)
    on_line(run_header(pipeline, plan, run_dir))
    trackers = RunTrackers(pipeline, run_dir, plan)
    def each_epoch(row: dict) -> None:
        trackers.log(row)
        on_epoch(row)

    try:
        with driving(run_dir, source):
            result = fit(pipeline, plan, run_dir, on_epoch=each_epoch, budget=budget,
                         owner=run_dir.name, dataset=dataset, on_progress=on_progress,
                         ray_settings=settings, ray_datasets=splits)
    except RunInterrupted:
        trackers.close("interrupted")
        return RunResult(run_dir, "interrupted", ABORTED, stop=StopReason.INTERRUPTED)
    except Exception as error:  # from the workers, under Ray's wrappers: one line (worker_errors)
        trackers.close("failed")
        explained = explain(error, run_dir)
        if explained is error:
            raise
        raise explained from error
    trackers.close(_status(result))
    if result.stop is StopReason.INTERRUPTED:
        return RunResult(run_dir, "interrupted", result.stop_reason, result.metrics,
                         ray_result=result.ray_result, stop=result.stop)
    if result.steps_charged == 0 and resumed is None:
        # Nothing trained and nothing charged: an untrained model.pt would only mislead.
        shutil.rmtree(run_dir, ignore_errors=True)
        return RunResult(run_dir, "nothing trained", result.stop_reason, stop=result.stop)
    privacy = privacy_statement(plan, result, pipeline.training.workers)
    record = write_run_record(run_dir, pipeline, result, privacy,
                              None if budget is None else budget.head())
    return RunResult(run_dir, _status(result), result.stop_reason, result.metrics, privacy, record,
                     None if budget is None else budget.status(), result.ray_result,
                     result.stop)


def _run_to_resume(pipeline: Pipeline, resume, new: bool, source: str, rerun_choices,
                   on_line) -> Path | None:
    """The run directory `resume` names, else this pipeline's unfinished run (unless `new`),
    else None: a new run."""
    from raydp_train.runs.reruns import resumed_run_dir, run_to_continue

    if resume:
        return resumed_run_dir(resume, pipeline)
    if new:
        return None
    resumed = run_to_continue(pipeline, source, rerun_choices or _python_choices)
    if resumed is not None:
        on_line(f"continuing the unfinished run {resumed} of this pipeline from its last "
                "checkpoint (run.on_interrupted: resume; --new, or new=True, starts another)")
    return resumed


def tune(pipeline: Pipeline, *, address: str | None = None, verbose: bool = False,
         source: str = "<pipeline>", on_line: Callable[[str], None] | None = _say,
         datasets: dict | None = None, scaling_config=None, run_config=None, new: bool = False):
    """Run the pipeline's `tune:` sweep, every trial spending from its one budget; the
    SweepResult, or None when the budget cannot pay a trial. An unfinished sweep of the
    pipeline whose driver died is continued, unless `new`. `datasets`: as run's, checked once;
    each trial's workers and restarts from `scaling_config` / `run_config` (no storage)."""
    from raydp_train.checks.preflight import check_before_ray
    from raydp_train.data.ray_datasets import check_datasets, ray_splits
    from raydp_train.runs.locations import check_locations, warn_if_not_shared
    from raydp_train.runs.resources import connect
    from raydp_train.sweeps.runner import run_sweep
    from raydp_train.train.ray_configs import with_ray_configs

    pipeline = with_ray_configs(pipeline, scaling_config, run_config, source, sweep=True)[0]
    if pipeline.tune is None:
        raise PipelineError(source, [("tune: required by `raydp-train tune` (search_space, "
                                     "num_samples, ...); see README")])
    check_datasets(pipeline, datasets, source)  # (to resume too) refused before Ray starts
    check_locations(pipeline, source)
    check_loggers(pipeline, source)
    check_before_ray(pipeline)

    def connect_and_warn() -> dict | None:  # the splits every trial reads, or None
        connect(address, pipeline.training, _cpus(pipeline), verbose)
        warn_if_not_shared(pipeline, address)
        return ray_splits(pipeline, datasets, source)

    return run_sweep(pipeline, connect=connect_and_warn, on_line=on_line or _silent,
                     source=source, new=new)


def open_budget(name: str, epsilon: float, delta: float, *, ledger: str | None = None,
                accountant: str = "rdp", unit: str = "example"):
    """The global budget `name` (made on first use, read back from its ledger after): a
    handle to pass to `PrivateStep(budget=...)` in your own loop, counting epsilon per `unit`
    ("example", or "user": privacy.unit). Call it on the driver, after `ray.init`; the terms
    are checked as a pipeline's `budget:` section's."""
    from pydantic import ValidationError

    from raydp_train.budget.actor import open_budget as open_actor
    from raydp_train.config.budget import BudgetConfig
    from raydp_train.config.errors import describe

    terms = {"name": name, "epsilon": epsilon, "delta": delta, "accountant": accountant}
    try:
        config = BudgetConfig.model_validate(terms | ({} if ledger is None else {"ledger": ledger}))
    except ValidationError as e:
        raise PipelineError("open_budget", [f"budget.{describe(err, BudgetConfig)}"
                                            for err in e.errors()]) from None
    return open_actor(config, unit)


def _status(result) -> str:
    """A finished fit's RunResult.status (before a run that trained nothing is told apart)."""
    if result.stop is StopReason.INTERRUPTED:
        return "interrupted"
    return "completed" if result.stop is StopReason.COMPLETED else "stopped"


def _cpus(pipeline: Pipeline) -> int:
    """Room beside the workers: ARCHITECTURE.md §4."""
    training = pipeline.training
    return max(4, math.ceil(training.workers * (training.cpus_per_worker or 1)) + 2)


def _prepare_run(pipeline: Pipeline, address: str | None, verbose: bool, source: str,
                 datasets: dict | None, ray_configs: tuple):
    """Every check before anything is spent (preflight); Ray first: text is tokenized by Ray
    Data, and Ray Datasets are checked by it. (pipeline with Ray's configs, RaySettings, its
    Ray Datasets, Dataset, plan)."""
    from raydp_train.checks.preflight import check_before_ray, check_pipeline
    from raydp_train.data.ray_datasets import check_datasets, ray_splits
    from raydp_train.runs.locations import check_locations, warn_if_not_shared
    from raydp_train.runs.resources import connect
    from raydp_train.train.ray_configs import with_ray_configs

    pipeline, settings = with_ray_configs(pipeline, *ray_configs, source)
    check_datasets(pipeline, datasets, source)  # refused before Ray starts
    check_locations(pipeline, source)
    check_loggers(pipeline, source)
    check_before_ray(pipeline)
    connect(address, pipeline.training, _cpus(pipeline), verbose)
    splits = ray_splits(pipeline, datasets, source)
    warn_if_not_shared(pipeline, address)
    return pipeline, settings, splits, *check_pipeline(pipeline, for_training=True,
                                                        datasets=splits)


def _python_choices(newest: Path) -> str:
    return (f"continue it with run(pipeline, resume='{newest}'), or start another run on the "
            "same data (spending again) with run(pipeline, new=True)")


def _open_budget(pipeline: Pipeline, on_line):
    """The pipeline's global budget (created from this driver), or None; says its state."""
    from raydp_train.budget.actor import open_budget
    from raydp_train.budget.ledger import as_uri
    from raydp_train.budget.run_witnesses import check_against_runs
    from raydp_train.reports.budget import status_text

    if pipeline.budget is None:
        return None
    # Refuses a ledger older than its witness, and a budget of another privacy.unit.
    budget = open_budget(pipeline.budget, pipeline.privacy.unit)
    # ... or older than a run record of this pipeline: refused before any grant.
    check_against_runs(pipeline.budget.name, pipeline.budget.ledger, pipeline.run.output_dir)
    on_line(f"{status_text(budget.status()).splitlines()[0]}\nledger: "
            f"{as_uri(pipeline.budget.ledger)}")
    return budget
