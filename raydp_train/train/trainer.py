"""Pipeline -> Ray Train: a TorchTrainer whose workers run `worker.train`, with the run's
checkpoints, restarts and progress lines. Knows nothing of the math inside a step."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import ray
from ray import cloudpickle
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from raydp_train.budget.actor import BudgetClient
from raydp_train.config.pipeline import Pipeline, pipeline_from_dict
from raydp_train.data.shards import ShardEveryRow, shard_ready, shard_splits, split_datasets
from raydp_train.data.sources import load_data
from raydp_train.models.hf_files import tokenizer_source
from raydp_train.train.charges import Charged, RunAccount, RunCharges, epsilon_cap
from raydp_train.train.context import RayTrainContext, clear_stop, request_stop, stop_requested
from raydp_train.train.plan import PrivacyPlan
from raydp_train.train.progress_lines import RowReader
from raydp_train.train.quiet import ray_logging_level
from raydp_train.train.ray_configs import RaySettings, record_storage
from raydp_train.train.result import TrainResult
from raydp_train.train.waits import watch_waits
from raydp_train.train.worker import train


class RunInterrupted(RuntimeError):
    """A second Ctrl-C aborted the run at once: the epoch that was running stays counted in
    full; earlier epochs are checkpointed in the run directory."""


# Ray Train's controller polls its workers every 2 s by default, and each per-epoch report
# waits for a poll; our epochs are often shorter than that. Ray Train passes these variables
# from the process that calls fit() to its controller and workers, on any cluster.
TRAIN_SETTINGS = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}
PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def ensure_ray(address: str | None, num_cpus: int, verbose: bool = False) -> None:
    """Join the cluster at `address` if given, else start an embedded Ray of our own. Only
    with `verbose` do Ray's own log lines and the workers' output reach this console."""
    if ray.is_initialized():
        return
    output = {"log_to_driver": verbose, "logging_level": ray_logging_level(verbose)}
    if address:
        ray.init(address=address, **output)
    else:
        # "local" always starts a new Ray: without it, ray.init joins any cluster that a
        # `ray start --head` on this machine recorded (and refuses num_cpus there).
        # Logical CPUs may exceed the machine's: workers and Ray Train's controller must
        # all be schedulable on a 2-core laptop (ARCHITECTURE.md §4).
        # A Ray of one machine is never drained for preemption: no watcher actor per run.
        os.environ.setdefault(PREEMPTION_WATCHER, "0")
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 _system_config=_startup_concurrency(), **output)


# Python worker processes Ray may start at once. Its default, the machine's cores (2 on a
# laptop), is below the ~8-20 processes a run or sweep starts (Train's controller and
# workers, Ray Data's tasks, actors): the raylet then repeats "N PYTHON worker processes have
# been started ... the maximum expected startup concurrency" next to the epochs.
STARTUP_CONCURRENCY = 16


def _startup_concurrency() -> dict:
    """Ray's system setting for an embedded Ray, unless the user set their own."""
    if os.environ.get("RAY_worker_maximum_startup_concurrency"):
        return {}
    return {"worker_maximum_startup_concurrency": STARTUP_CONCURRENCY}


def fit(
    pipeline: Pipeline,
    plan: PrivacyPlan,
    run_dir: Path,
    on_epoch: Callable[[dict], None] = print,
    budget: BudgetClient | None = None,
    owner: str = "",
    callbacks: list | None = None,
    dataset=None,
    ceiling: Charged | None = None,
    concurrent_runs: int = 1,
    on_progress: Callable[[dict], None] | None = None,
    after_step: Callable[[object, int], None] | None = None,
    ray_settings=None, ray_datasets: dict | None = None,
) -> TrainResult:
    """Train on Ray Train with `training.workers` workers; resumes if `run_dir` has a checkpoint.
    With `budget`, rank 0 reserves each epoch from that global budget as `owner`; with
    `ceiling` (a random-stopping trial), the run never charges more than it. Parquet
    splits that are files of their own reach the workers as Ray Data shards (data/shards.py;
    `dataset`, the driver's checked summary, then gives only their shape); any other
    `dataset` (loaded, e.g. split in memory, by the driver) through the object store.
    `after_step(context, step)` runs on every rank after each step (tests/faults.py).
    `concurrent_runs`: how many runs (a sweep's trials) may share the machines with this one.
    `on_progress` gets rank 0's place within an epoch every PROGRESS_EVERY_S seconds.
    `ray_settings`: a RunConfig's storage, callbacks, runtime env (train/ray_configs.py);
    `ray_datasets`: a ray_dataset pipeline's splits, each worker reading its shard."""
    run_dir = Path(run_dir).resolve()
    for name, value in TRAIN_SETTINGS.items():  # a user's own value wins
        os.environ.setdefault(name, value)
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = RowReader(run_dir)  # before any worker starts: every row of this fit, once
    shards = _shards(pipeline, ray_datasets, dataset)  # splits for the workers' shards, or None
    config = {
        "pipeline": pipeline.model_dump(mode="json"),
        "plan": plan,
        "run_dir": str(run_dir),
        "after_step": after_step,
        "budget": budget,
        "owner": owner or run_dir.name,
        "ceiling": ceiling,
        "concurrent_runs": concurrent_runs,
        **_data_for_workers(pipeline, dataset, shards),
    }
    record_storage(run_dir, ray_settings := ray_settings or RaySettings())  # for a resume
    trainer = _torch_trainer(pipeline, run_dir, config, shards, ray_settings, callbacks)
    clear_stop(run_dir)
    stop = threading.Event()
    reporters = _reporters(rows, on_epoch, on_progress, stop)
    try:
        result = _fit_until_stopped(trainer, run_dir)
    finally:
        stop.set()
        for reporter in reporters:
            reporter.join()
        rows.remove()
    trained: TrainResult = cloudpickle.loads(result.return_value)
    if len(set(trained.checksums)) != 1:
        raise RuntimeError(f"workers ended with different parameters: {trained.checksums}")
    trained.ray_result = result
    return trained


def _shards(pipeline: Pipeline, ray_datasets: dict | None, dataset) -> dict | None:
    """The Ray Datasets whose shards the workers read: the Parquet split files', or those
    handed to run() (`dataset`: their checked summary); None: the rows come another way."""
    if ray_datasets is not None:
        return shard_ready(ray_datasets, pipeline, dataset.num_train)
    return split_datasets(pipeline) if shard_splits(pipeline) is not None else None


def _reporters(rows: RowReader, on_epoch, on_progress, stop: threading.Event) -> list:
    """The driver's threads while the workers run: their rows shown, a wait for resources
    said (train/waits.py), until `stop`."""
    printer = threading.Thread(target=_print_progress, daemon=True,
                               args=(rows, on_epoch, on_progress, stop))
    printer.start()
    return [printer, watch_waits(stop, lambda line: print(line, flush=True))]


def _torch_trainer(pipeline: Pipeline, run_dir: Path, config: dict, shards: dict | None,
                   settings: RaySettings, callbacks: list | None) -> TorchTrainer:
    """Ray Train's trainer of the run: its workers, their shards, restarts and checkpoints
    (under the RunConfig's storage_path when one was given, else the run directory)."""
    given = settings.failure_config or FailureConfig()
    limit = given.controller_failure_limit
    failures = dataclasses.replace(given, max_failures=pipeline.run.max_failures,
                                   controller_failure_limit=3 if limit == -1 else limit)
    return TorchTrainer(
        _train_loop_per_worker,
        train_loop_config=config,
        datasets=shards,
        dataset_config=ShardEveryRow() if shards is not None else None,
        scaling_config=ScalingConfig(
            num_workers=pipeline.training.workers, use_gpu=pipeline.training.use_gpu,
            resources_per_worker=pipeline.training.worker_bundle(),  # runs/resources.py checks it
            placement_strategy=pipeline.training.placement.upper(),
        ),
        run_config=RunConfig(
            name=run_dir.name,
            storage_path=settings.storage_path or str(run_dir.parent),
            storage_filesystem=settings.storage_filesystem,
            failure_config=failures,
            checkpoint_config=CheckpointConfig(num_to_keep=pipeline.run.keep_checkpoints),
            callbacks=[*(callbacks or []), *settings.callbacks],
            worker_runtime_env=settings.worker_runtime_env,
        ),
    )


def _data_for_workers(pipeline: Pipeline, dataset, splits: dict | None) -> dict:
    """What the workers need besides their Ray Data shards (`splits`: see fit)."""
    if splits is None:
        return {"dataset": None if dataset is None else ray.put(dataset), "data_shape": None,
                "splits": ()}
    if dataset is None:  # its shape, from the files' schema and labels alone
        dataset = load_data(pipeline.data, pipeline.model.num_classes,
                            tokenizer_source(pipeline.model), tokenize=False)
    return {"dataset": None, "data_shape": (dataset.feature_shape, dataset.num_classes),
            "splits": tuple(splits)}


def _fit_until_stopped(trainer: TorchTrainer, run_dir: Path):
    """`trainer.fit()`, where the first Ctrl-C lets the running epoch finish and checkpoint and
    stops the workers before they charge the next one; a second Ctrl-C aborts at once.

    fit() runs in a helper thread so that Ray Train does not install its own SIGINT handler,
    which aborts the workers mid-epoch (the epoch charged but its work lost)."""
    outcome: dict = {}

    def fit_in_thread() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as error:  # noqa: BLE001 -- re-raised in the caller's thread
            outcome["error"] = error

    def on_sigint(signum, frame) -> None:
        if stop_requested(run_dir):
            raise RunInterrupted(f"interrupted; the last checkpoint is in {run_dir}")
        request_stop(run_dir)
        print("\nCtrl-C: stopping after the epoch that is running (Ctrl-C again: at once)",
              flush=True)

    worker = threading.Thread(target=fit_in_thread, daemon=True)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_sigint) if in_main else None
    try:
        worker.start()
        while worker.is_alive():
            worker.join(0.2)
    finally:
        if in_main:
            signal.signal(signal.SIGINT, previous)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _print_progress(rows: RowReader, on_epoch, on_progress, stop: threading.Event) -> None:
    """Show rank 0's per-epoch rows on the driver as they arrive (Ray's logs stay quiet), and
    its rows from within a long epoch through `on_progress`, if given; once the run has
    ended, the rows it wrote last."""
    while True:
        ended = stop.is_set()
        for row in rows.new_rows():
            if not row.get("within_epoch"):
                on_epoch(row)
            elif on_progress is not None:
                on_progress(row)
        if ended:
            return
        stop.wait(0.2)


def _train_loop_per_worker(config: dict) -> bytes | None:
    pipeline = pipeline_from_dict(config["pipeline"])
    plan = config["plan"]
    account = RunAccount(RunCharges(config["run_dir"]), config["budget"], config["owner"], plan,
                         epsilon_cap(pipeline, plan), config["ceiling"])
    context = RayTrainContext(account, config["run_dir"], config["splits"],
                              config["concurrent_runs"])
    dataset = None if config["dataset"] is None else ray.get(config["dataset"])
    try:
        result = train(pipeline, plan, context, dataset, config["data_shape"],
                       config["after_step"])
    finally:
        account.record.close()
    result.model = result.model.cpu()
    # Ray Train's controller unpickles every rank's return value: a model made it import
    # transformers and hold a copy per rank (on two nodes of two cores, a MiniLM run's end
    # took 17-23 s, now 6 s). Rank 0's result, pickled here, passes through it as bytes;
    # the other ranks' models are bit-identical to it (`checksums`).
    return cloudpickle.dumps(result) if context.rank == 0 else None
