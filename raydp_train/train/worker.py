"""The training loop of one worker, read top to bottom as ARCHITECTURE.md §2.2: charge, sample,
micro-batch, clip, noise (rank 0), all-reduce, step, report. The same code runs with
world size 1 in this process and as every rank of a Ray Train worker group. `train` is the
recipe: `WorkerRun.setup`, one `train_epoch` per epoch, `finish`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from raydp_train.data.sources import Dataset, load_data
from raydp_train.data.targets import label_kind
from raydp_train.models.builders import build_model
from raydp_train.models.frozen_precision import keep_frozen_in
from raydp_train.models.hf_files import tokenizer_source
from raydp_train.optim.averaging import averaged, make_average
from raydp_train.optim.optimizer import make_optimizer, make_schedule, schedule_scale
from raydp_train.privacy.noise import make_generator, make_noise_generator
from raydp_train.privacy.sharding import weights_held
from raydp_train.train import evaluation, sharded
from raydp_train.train.charges import Charged, ChargeRefused
from raydp_train.train.checkpoint_state import checkpoint_state, restore_state
from raydp_train.train.context import parameter_checksum, peak_rss_mb, resident_mb
from raydp_train.train.engine_checks import EngineChecks
from raydp_train.train.plan import PrivacyPlan
from raydp_train.train.progress_lines import tracked_privacy
from raydp_train.train.result import TrainResult
from raydp_train.train.samplers import make_sampler
from raydp_train.train.step import AUTOCAST_DTYPES, private_step
from raydp_train.train.threads import use_threads

# Seconds between progress lines within an epoch (SST-2 epochs take minutes).
PROGRESS_EVERY_S = 30.0


def _shared_seed(pipeline, context) -> int:
    """Rank 0's seed (run.seed, else os.urandom), on every rank."""
    seed = pipeline.run.seed
    return context.gather(int.from_bytes(os.urandom(8), "little") if seed is None else seed)[0]


def _attach(pipeline, plan: PrivacyPlan, shared_seed: int, model: nn.Module) -> tuple:
    """(mechanism, engine): this rank's, its randomness (LSG's carriers) as every rank's, on the
    model, which it may partly freeze; the frozen weights then in model.frozen_dtype."""
    mechanism = plan.mechanism(pipeline.privacy, torch.Generator().manual_seed(shared_seed))
    engine = mechanism.attach(model, plan.clip_norm)
    keep_frozen_in(model, getattr(pipeline.model, "frozen_dtype", "fp32"))
    return mechanism, engine


def epoch_ends(epochs: int, expected_batch_size: int, num_examples: int) -> list[int]:
    """Step count at the end of each epoch: floor(e / q) for e = 1..epochs."""
    return [e * num_examples // expected_batch_size for e in range(1, epochs + 1)]


def train(
    pipeline, plan: PrivacyPlan, context, dataset=None,
    data_shape: tuple[tuple[int, ...], int] | None = None,
    after_step: Callable[[object, int], None] | None = None,
) -> TrainResult:
    """Train on this rank's rows; every rank returns the same model, rank 0's metrics count.

    The rows: this rank's Ray Data shards when the context has them (`data_shape`: the
    driver's (feature shape, classes)), else its share of `dataset` (already loaded, e.g.
    split in memory by the driver) or of the data it loads itself (ARCHITECTURE.md §2.10).
    `after_step(context, step)` runs on every rank after each step (tests inject faults).
    """
    run = WorkerRun.setup(pipeline, plan, context, dataset, data_shape)
    ends = epoch_ends(pipeline.training.epochs, plan.expected_batch_size, plan.num_examples)
    for epoch in range(run.first_epoch, len(ends) + 1):
        if not run.train_epoch(epoch, ends[epoch - 1], after_step):
            break
    return run.finish()


class WorkerRun:
    """One rank's run: its rows, model, mechanism, optimizer, noise and sampling, and where
    it stands (step, result). Every rank makes the same collective calls in the same order."""

    # Set by `setup`, after the pieces `__init__` makes:
    result: TrainResult
    loss: Callable  # the per-example training loss
    prefix_outputs: torch.Tensor | None  # the frozen prefix's cached outputs, if cached
    sampler: object  # each step's sample as micro-batches (train/samplers.py)
    score: Callable  # (model, split) -> this rank's sums of the split
    started: float  # when the first epoch began (time.monotonic)

    def __init__(self, pipeline, plan: PrivacyPlan, context, local: Dataset, model: nn.Module):
        seed, training = pipeline.run.seed, pipeline.training
        self.pipeline, self.plan, self.context, self.local, self.model = (
            pipeline, plan, context, local, model)
        self.shared_seed = shared_seed = _shared_seed(pipeline, context)
        self.mechanism, self.clipper = _attach(pipeline, plan, shared_seed, model)
        # Rank 0 alone draws the noise: ONE draw of std sigma*C per step for the whole world.
        self.std = (self.mechanism.noise_std(plan.noise_multiplier, plan.clip_norm)
                    if context.rank == 0 else 0.0)
        if training.sharding == "fsdp":  # sharded: each rank draws its own shard's noise
            self.mechanism, self.clipper, self.std = sharded.shard_worker(
                self.mechanism, self.clipper, model, plan, pipeline.run, context)
        self.optimizer = make_optimizer(model, training)
        self.schedule = make_schedule(self.optimizer, training, plan.steps)  # logical steps
        self.average = make_average(self.optimizer, training.ema_decay)
        self.noise_generator, self.noise_mode = make_noise_generator(pipeline.run.noise, seed,
                                                                     context.device)
        self.sampling_generator, _ = make_generator(
            None if seed is None else seed + 1 + context.rank)
        self.engine_checks = EngineChecks(pipeline.privacy.self_check, shared_seed + 1,
                                          context.gather, AUTOCAST_DTYPES[training.precision])
        self.task = plan.task
        self.step, self.first_epoch = 0, 1

    @classmethod
    def setup(cls, pipeline, plan: PrivacyPlan, context, dataset, data_shape) -> WorkerRun:
        """This rank's rows and model (rank 0's initialization), the run's pieces, and the
        state of the last checkpoint when Ray Train restarted it."""
        from raydp_train.data.streaming import choose_sampler

        threads = use_threads(pipeline.training.threads_per_worker, context.sharing)
        sampler = choose_sampler(pipeline)  # the same on every rank: the file's footer
        before = resident_mb()
        local = _local_rows(pipeline, context, dataset, data_shape, sampler == "streaming")
        data_mb = resident_mb() - before  # what holding this rank's rows costs
        if pipeline.run.seed is not None:
            torch.manual_seed(pipeline.run.seed)  # initialization, reproducible on request
        model = build_model(pipeline.model, local.feature_shape, local.num_classes).to(
            context.device)
        context.broadcast_parameters(model)
        run = cls(pipeline, plan, context, local, model)
        run.result = TrainResult(
            model=model, noise_mode=run.noise_mode,
            data_shape=(list(local.feature_shape), local.num_classes),
            baselines=run.task.baselines(local, context), sampler=sampler,
            data_mb=context.gather(round(data_mb, 1)),
            threads=context.gather(threads), nodes=context.gather(context.node))
        run.result.nodes_ever = sorted(set(run.result.nodes))
        run.restore()
        # After the restore: the cache holds what this rank's model computes, frozen now.
        run.loss, run.prefix_outputs, run.score = run.task.loss_and_score(pipeline, model, local)
        run.sampler = make_sampler(sampler, run, run.shared_seed)
        run.result.shard_sizes = context.gather(run.sampler.num_rows)
        run.started = time.monotonic()
        return run

    def restore(self) -> None:
        """Continue from the context's checkpoint, if it has one."""
        state = self.context.restore()
        if state is None:
            return
        restore_state(self, state)

    def train_epoch(self, epoch: int, end: int, after_step=None) -> bool:
        """Charge the epoch, run its steps up to `end`, score, report a checkpoint; False
        when the budget refused the epoch (the run stops at the last checkpoint)."""
        # Write-ahead: the steps are granted and on record before any noisy gradient exists.
        epoch_charge = Charged(end - self.step, self.plan.releases_per_epoch)
        try:
            charged = self.context.charge(epoch_charge, epoch, self.step)
        except ChargeRefused as refusal:
            self.result.stop, self.result.stop_reason = refusal.stop, str(refusal)
            return False
        loss_sum, seen = self._steps(epoch, end, after_step)
        row = self._epoch_row(epoch, charged, loss_sum, seen)
        self.context.settle(epoch_charge)
        self.result.metrics.append(row)
        self.context.report(row, checkpoint_state(self, epoch))
        return True

    def _spare_row(self) -> tuple:
        device = self.context.device
        return self.local.train_features[:1].to(device), self.local.train_labels[:1].to(device)

    def _steps(self, epoch: int, end: int, after_step) -> tuple[float, int]:
        """The DP steps up to `end`; (loss sum, examples) of this rank's samples."""
        plan, context, training = self.plan, self.context, self.pipeline.training
        self.model.train()
        loss_sum, seen = 0.0, 0
        epoch_start = shown = time.monotonic()
        first_step = self.step
        self.sampler.start_epoch(epoch, first_step, end)
        while self.step < end:
            self.mechanism.refresh(self.step, epoch)
            batches = self.sampler.step_batches()
            if training.sharding == "fsdp":  # every rank as many passes (each gathers weights)
                batches = sharded.equal_passes(list(batches), self._spare_row, context)
            context.releasing_step(self.step)  # on record before its noisy gradient can leave
            stats = private_step(
                self.model, self.clipper, self.optimizer, batches, self.loss, self.std,
                plan.expected_batch_size, self.noise_generator, context.all_reduce_sum,
                self.mechanism, training.precision, self.engine_checks,
            )
            self.schedule.step()  # once per logical step, whatever its micro-batches
            loss_sum, seen = loss_sum + stats.loss_sum, seen + stats.num_examples
            self.step += 1
            if self.average is not None:
                self.average.update(self.step)
            if after_step is not None:
                after_step(context, self.step)
            if time.monotonic() - shown >= PROGRESS_EVERY_S:  # a long epoch: where it is
                shown = time.monotonic()
                context.show_progress({"epoch": epoch, "step": self.step,
                                       "first_step": first_step, "last_step": end,
                                       "epoch_elapsed_s": shown - epoch_start})
        return loss_sum, seen

    def _epoch_row(self, epoch: int, charged: Charged, loss_sum: float, seen: int) -> dict:
        """The epoch's metrics, over every rank: training loss, test metrics, epsilon, and the
        validation accuracy as released (charged before it is computed)."""
        plan, context = self.plan, self.context
        totals = torch.tensor([loss_sum, seen], dtype=torch.float64, device=context.device)
        context.all_reduce_sum(totals)
        row = {
            "epoch": epoch,
            "steps": self.step,
            "steps_charged": charged.steps,
            "examples_seen": int(totals[1]),
            "train_loss": (totals[0] / totals[1].clamp(min=1)).item(),
            **self.task.test_metrics(self._evaluate("test")),
            # Ray Train publishes rank 0's row: the other ranks skip the accountant, and
            # importing dp-accounting (scipy): 1.7 CPU s a worker process, measured.
            "epsilon": (plan.epsilon(charged.steps, releases=charged.releases)
                        if context.rank == 0 else None),
            "elapsed_s": time.monotonic() - self.started,
            # training.lr as scheduled
            "lr": self.pipeline.training.lr * schedule_scale(self.optimizer),
        }
        if self.pipeline.run.loggers and context.rank == 0:
            row.update(tracked_privacy(plan, charged, context.account.budget))
        if self.local.validation_labels is not None:
            context.releasing_metric(epoch)
            counts = self.task.released_count(self._evaluate("validation"))
            row["validation_accuracy"] = context.gather(
                evaluation.released_accuracy(*counts, plan.release_noise_multiplier,
                                             self.noise_generator))[0]
        return row

    def _evaluate(self, split: str) -> list[float]:
        """The task's sums of `split` over every rank's rows (e.g. correct, rows; a causal LM's
        token loss sum, tokens)."""
        with weights_held(self.model, gather_now=True), averaged(self.average):
            # (sharded: the weights gathered now, as the ranks' row counts differ)
            sums = torch.tensor(self.score(self.model, split), dtype=torch.float64,
                                device=self.context.device)
        self.context.all_reduce_sum(sums)
        return sums.tolist()

    def finish(self) -> TrainResult:
        """The result: what the last step trained, the steps and releases charged, and each
        rank's checks, checksum and memory."""
        result, context = self.result, self.context
        trained = self.mechanism.trained(self.clipper)
        result.final_step_sum_std = trained.std().item() * self.plan.expected_batch_size
        self.clipper.close()
        if self.average is not None:
            self.average.copy_into_parameters()
        result.model = sharded.whole_model(self.model, self._unsharded)
        charged = context.charged()
        result.steps_done, result.steps_charged, result.releases_charged = self.step, *charged
        result.trained_per_step = trained.numel()
        result.self_checks = context.gather((self.engine_checks.count,
                                             round(self.engine_checks.seconds, 3)))
        result.model_parameters = sum(p.numel() for p in self.model.parameters())
        result.per_example_path = getattr(self.clipper, "per_example_path", [])
        result.checksums = context.gather(parameter_checksum(result.model))
        result.peak_rss_mb = context.gather(peak_rss_mb())
        return result

    def _unsharded(self) -> nn.Module:
        """A fresh model shaped as this run's (adapters included), not sharded."""
        model = build_model(self.pipeline.model, self.local.feature_shape, self.local.num_classes)
        _attach(self.pipeline, self.plan, self.shared_seed, model)[1].close()
        return model


def _local_rows(pipeline, context, dataset, data_shape, streaming: bool):
    """This rank's rows of every split, as torch tensors (ARCHITECTURE.md §2.10); with
    `streaming`, no training rows: the sampler reads them step by step (§2.13)."""
    shards = context.dataset_shards()
    if shards is not None:
        from raydp_train.data.shards import materialize

        (feature_shape, num_classes), tokenizer = data_shape, tokenizer_source(pipeline.model)
        labels = label_kind(pipeline.data).label_array(num_classes)
        splits = {name: materialize(shard, pipeline, name, feature_shape, labels, tokenizer)
                  for name, shard in shards.items()}
        if streaming:
            splits["train"] = (np.empty((0, *feature_shape), np.float32),
                               np.empty((0, *labels[1]), labels[0]))
        return Dataset(*splits["train"], *splits["test"], num_classes,
                       *splits.get("validation", (None, None))).to_torch()
    if streaming:  # config/data.py refuses it where no Ray Train shards come
        raise RuntimeError("data.sampler streaming needs the run's Ray Train workers")
    if dataset is None or not dataset.features_read:  # the driver checked, did not tokenize
        dataset = load_data(pipeline.data, pipeline.model.num_classes,
                            tokenizer_source(pipeline.model))
    return dataset.rows(context.rank, context.world_size).to_torch()
