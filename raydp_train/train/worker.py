"""The training loop of one worker, read top to bottom as ARCHITECTURE.md §2.2: charge, sample,
micro-batch, clip, noise (rank 0), all-reduce, step, report. The same code runs with
world size 1 in this process and as every rank of a Ray Train worker group."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from raydp_train.custom_models import training_loss
from raydp_train.data import Dataset, load_data
from raydp_train.hf_causal import causal_lm_loss, token_loss_sum
from raydp_train.hf_files import tokenizer_source
from raydp_train.hf_prefix import FrozenPrefix, cached_prefix_loss
from raydp_train.models import build_model
from raydp_train.plan import PrivacyPlan
from raydp_train.privacy.mechanism import Mechanism, make_mechanism
from raydp_train.privacy.noise import fill_gaussian_noise_, make_generator, make_noise_generator
from raydp_train.privacy.sampling import micro_batches, poisson_sample
from raydp_train.stops import StopReason
from raydp_train.targets import LABEL_KINDS, LabelKind, label_kind
from raydp_train.train.charges import Charged, ChargeRefused
from raydp_train.train.context import parameter_checksum, peak_rss_mb, resident_mb
from raydp_train.train.engine_checks import EngineChecks
from raydp_train.train.optim import make_optimizer, make_schedule, schedule_scale
from raydp_train.train.step import AUTOCAST_DTYPES, private_step
from raydp_train.train.threads import use_threads

# Seconds between progress lines within an epoch (SST-2 epochs take minutes).
PROGRESS_EVERY_S = 30.0


@dataclass
class TrainResult:
    model: nn.Module
    metrics: list[dict] = field(default_factory=list)  # one row per epoch
    noise_mode: str = "fast"  # privacy.noise.NOISE_SOURCES says what each mode is
    steps_done: int = 0  # steps of the finished run
    steps_charged: int = 0  # steps charged to the privacy account, restarts included
    releases_charged: int = 0  # noisy validation-metric releases charged
    stop: StopReason = StopReason.COMPLETED  # or why the run stopped early
    stop_reason: str = "completed"  # as shown: "budget exhausted: <the accountant's reason>"
    checksums: list[str] = field(default_factory=list)  # one per rank: all equal
    # Numbers trained (= all-reduced) per step: LSG's kept carrier entries + other params.
    trained_per_step: int = 0
    model_parameters: int = 0
    # std of the last step's reduced (noise + clipped) sum over its trained entries: about
    # sigma*C when the noise dominates; sqrt(W) times that if noise were added per worker.
    final_step_sum_std: float = float("nan")
    baselines: dict = field(default_factory=dict)  # Dataset.accuracy_baselines()
    shard_sizes: list[int] = field(default_factory=list)  # training rows each rank held
    peak_rss_mb: list[float] = field(default_factory=list)  # each rank's, at the end
    data_mb: list[float] = field(default_factory=list)  # each rank's resident data, read
    threads: list[int] = field(default_factory=list)  # each rank's torch threads
    nodes: list[str] = field(default_factory=list)  # each rank's node (its IP address)
    # Each rank's (engine self-checks run, their seconds): privacy.self_check's cost.
    self_checks: list[tuple[int, float]] = field(default_factory=list)
    data_shape: tuple = ()  # (one example's feature shape, classes): what rebuilds the model
    ray_result: object = None  # Ray Train's Result of the fit (set on the driver)


def _shared_seed(pipeline, context) -> int:
    """Rank 0's seed (run.seed, else os.urandom), on every rank."""
    seed = pipeline.run.seed
    return context.gather(int.from_bytes(os.urandom(8), "little") if seed is None else seed)[0]


def _mechanism(pipeline, shared_seed: int) -> Mechanism:
    """The pipeline's mechanism; its own randomness (LSG's carriers) is the same on every
    rank, from rank 0's seed."""
    return make_mechanism(pipeline.privacy, torch.Generator().manual_seed(shared_seed))


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
    rank = context.rank
    seed, training = pipeline.run.seed, pipeline.training
    threads = use_threads(training.threads_per_worker, context.sharing)
    before = resident_mb()
    local = _local_rows(pipeline, context, dataset, data_shape)
    data_mb = resident_mb() - before  # what holding this rank's rows costs
    if seed is not None:
        torch.manual_seed(seed)  # model initialization, reproducible only on request
    model = build_model(pipeline.model, local.feature_shape, local.num_classes)
    model = model.to(context.device)
    context.broadcast_parameters(model)
    shared_seed = _shared_seed(pipeline, context)
    mechanism = _mechanism(pipeline, shared_seed)
    clipper = mechanism.attach(model, plan.clip_norm)  # may freeze what the mechanism does not train
    optimizer = make_optimizer(model, training)
    schedule = make_schedule(optimizer, training, plan.steps)  # counts logical steps
    noise_generator, noise_mode = make_noise_generator(pipeline.run.noise, seed, context.device)
    # Rank 0 alone draws the noise: ONE draw of std sigma*C per step for the whole world.
    std = mechanism.noise_std(plan.noise_multiplier, plan.clip_norm) if rank == 0 else 0.0
    sampling_generator, _ = make_generator(None if seed is None else seed + 1 + rank)
    engine_checks = EngineChecks(pipeline.privacy.self_check, shared_seed + 1, context.gather,
                                 AUTOCAST_DTYPES[training.precision])

    kind = None if is_causal_lm(pipeline.model) else label_kind(pipeline.data)
    result = TrainResult(model=model, noise_mode=noise_mode,
                         data_shape=(list(local.feature_shape), local.num_classes),
                         baselines={} if kind is None else _baselines(local, kind, context),
                         shard_sizes=context.gather(local.num_train),
                         data_mb=context.gather(round(data_mb, 1)),
                         threads=context.gather(threads), nodes=context.gather(context.node))
    step, first_epoch = 0, 1
    state = context.restore()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, first_epoch, result.metrics = state["step"], state["epoch"] + 1, state["metrics"]
        mechanism.refresh(step, first_epoch, force=True)  # state of the restored weights
    # After the restore: the cache holds what this rank's model computes, frozen from now on.
    per_example_loss, prefix_outputs, score = _loss_and_score(pipeline, model, local, kind)

    def evaluate(split: str) -> list[float]:
        """The label kind's sums (e.g. correct, rows), or (token loss sum, tokens) of a
        causal LM, of `split` over every rank's rows."""
        sums = torch.tensor(score(model, split), dtype=torch.float64, device=context.device)
        context.all_reduce_sum(sums)
        return sums.tolist()

    ends = epoch_ends(training.epochs, plan.expected_batch_size, plan.num_examples)
    started = time.monotonic()
    for epoch in range(first_epoch, len(ends) + 1):
        # Write-ahead: the epoch's steps are granted and on record before any noisy gradient
        # exists. A refusal from the global budget stops the run at the last checkpoint.
        epoch_charge = Charged(ends[epoch - 1] - step, plan.releases_per_epoch)
        try:
            charged = context.charge(epoch_charge, epoch, step)
        except ChargeRefused as refusal:
            result.stop, result.stop_reason = refusal.stop, str(refusal)
            break
        model.train()
        loss_sum, seen = 0.0, 0
        epoch_start = shown = time.monotonic()
        first_step = step
        while step < ends[epoch - 1]:
            mechanism.refresh(step, epoch)
            sample = poisson_sample(local.num_train, plan.sampling_rate, sampling_generator)
            batches = _micro_batches(local, sample, prefix_outputs,
                                     training.max_physical_batch, context.device)
            context.releasing_step(step)  # on record before its noisy gradient can leave
            stats = private_step(
                model, clipper, optimizer, batches, per_example_loss, std,
                plan.expected_batch_size, noise_generator, context.all_reduce_sum, mechanism,
                training.precision, engine_checks,
            )
            schedule.step()  # once per logical step, whatever its number of micro-batches
            loss_sum, seen, step = loss_sum + stats.loss_sum, seen + stats.num_examples, step + 1
            if after_step is not None:
                after_step(context, step)
            if time.monotonic() - shown >= PROGRESS_EVERY_S:  # a long epoch: where it is
                shown = time.monotonic()
                context.show_progress({"epoch": epoch, "step": step, "first_step": first_step,
                                       "last_step": ends[epoch - 1],
                                       "epoch_elapsed_s": shown - epoch_start})
        totals = torch.tensor([loss_sum, seen], dtype=torch.float64, device=context.device)
        context.all_reduce_sum(totals)
        row = {
            "epoch": epoch,
            "steps": step,
            "steps_charged": charged.steps,
            "examples_seen": int(totals[1]),
            "train_loss": (totals[0] / totals[1].clamp(min=1)).item(),
            **held_out_metrics(kind, evaluate("test")),
            "epsilon": plan.epsilon(charged.steps, releases=charged.releases),
            "elapsed_s": time.monotonic() - started,
            "lr": training.lr * schedule_scale(optimizer),  # training.lr as scheduled
        }
        if pipeline.run.loggers and rank == 0:
            row.update(tracked_privacy(plan, charged, context.account.budget))
        if local.validation_labels is not None:
            context.releasing_metric(epoch)
            row["validation_accuracy"] = context.gather(
                released_accuracy(*kind.released_count(evaluate("validation")), plan,
                                  noise_generator))[0]
        context.settle(epoch_charge)
        result.metrics.append(row)
        context.report(row, _checkpoint_state(model, optimizer, schedule, epoch, step,
                                              result.metrics))
    trained = mechanism.trained(clipper)
    result.final_step_sum_std = trained.std().item() * plan.expected_batch_size
    clipper.close()
    charged = context.charged()
    result.steps_done, result.steps_charged, result.releases_charged = step, *charged
    result.trained_per_step = trained.numel()
    result.self_checks = context.gather((engine_checks.count, round(engine_checks.seconds, 3)))
    result.model_parameters = sum(p.numel() for p in model.parameters())
    result.checksums = context.gather(parameter_checksum(model))
    result.peak_rss_mb = context.gather(peak_rss_mb())
    return result


def tracked_privacy(plan: PrivacyPlan, charged: Charged, budget) -> dict[str, float]:
    """What `run.loggers` adds to an epoch's row: epsilon so far by both accountants, and the
    global budget's epsilon left when the run spends from one."""
    row = {f"epsilon_{accountant}": plan.epsilon(charged.steps, accountant, charged.releases)
           for accountant in ("rdp", "pld")}
    if budget is not None:
        row["budget_epsilon_left"] = budget.status()["epsilon_remaining"]
    return row


def _local_rows(pipeline, context, dataset, data_shape):
    """This rank's rows of every split, as torch tensors (ARCHITECTURE.md §2.10)."""
    shards = context.dataset_shards()
    if shards is not None:
        from raydp_train.data_shards import materialize

        feature_shape, num_classes = data_shape
        labels = label_kind(pipeline.data).label_array(num_classes)
        splits = {name: materialize(shard, feature_shape, labels)
                  for name, shard in shards.items()}
        return Dataset(*splits["train"], *splits["test"], num_classes,
                       *splits.get("validation", (None, None))).to_torch()
    if dataset is None or not dataset.features_read:  # the driver checked, did not tokenize
        dataset = load_data(pipeline.data, pipeline.model.num_classes,
                            tokenizer_source(pipeline.model))
    return dataset.rows(context.rank, context.world_size).to_torch()


def _baselines(local: Dataset, kind: LabelKind, context) -> dict[str, float]:
    """What a test metric must beat (chance, the test split's majority class, ...), from
    every rank's sums of its test labels. Only the held-out test labels are read, which every
    epoch scores without noise anyway: no training row is looked at, no privacy spent."""
    sums = kind.baseline_sums(local.test_labels, local.num_classes).to(context.device)
    context.all_reduce_sum(sums)
    return kind.baselines(sums.tolist())


def is_causal_lm(model_config) -> bool:
    return getattr(model_config, "task", None) == "causal_lm"


def held_out_metrics(kind: LabelKind | None, totals: list[float]) -> dict[str, float]:
    """The label kind's test metrics from its sums (a classifier's accuracy from (correct,
    rows)); a causal LM's (kind None) held-out loss per token and its perplexity exp(loss)
    from (token loss sum, tokens)."""
    if kind is not None:
        return kind.metrics(totals, "test")
    loss = totals[0] / max(totals[1], 1)
    return {"test_loss": loss, "test_perplexity": math.exp(min(loss, 700.0))}


def _loss_and_score(pipeline, model: nn.Module, local: Dataset, kind: LabelKind | None):
    """(per-example loss, cached prefix outputs or None, score(model, split)): a causal LM's
    next-token loss and held-out token losses, or those of the labels' kind
    (`_frozen_prefix_cache`)."""
    if kind is not None:
        return _frozen_prefix_cache(pipeline.training, pipeline.model, model, local, kind)
    splits = {"test": local.test_features, "validation": local.validation_features}
    return (causal_lm_loss(pipeline.model.loss_reduction), None,
            lambda model, split: token_loss_sum(model, splits[split]))


def _frozen_prefix_cache(training, model_config, model: nn.Module, local: Dataset,
                         kind: LabelKind):
    """(per-example loss, outputs of the frozen prefix for this rank's training rows or None,
    score(model, split) -> the kind's sums on this rank's rows of the split): with
    training.cache_frozen_prefix the frozen bottom layers run once per example (hf_prefix),
    the test and validation rows' too, so each epoch's scoring runs only the trained top."""
    splits = {"test": (local.test_features, local.test_labels),
              "validation": (local.validation_features, local.validation_labels)}
    if not training.cache_frozen_prefix:
        return (training_loss(model_config, kind), None,
                lambda model, split: held_out_sums(model, *splits[split], kind))
    prefix = FrozenPrefix(model)
    hidden = {split: prefix.outputs(model, features)
              for split, (features, _) in splits.items() if features is not None}

    def score(model: nn.Module, split: str) -> list[float]:
        features, labels = splits[split]
        return held_out_sums(model, (features, hidden[split]), labels, kind, prefix)

    return cached_prefix_loss(prefix), prefix.outputs(model, local.train_features), score


def _micro_batches(local: Dataset, sample, prefix_outputs, size: int, device):
    """(features, labels) of each micro-batch of the sampled rows `sample` of this rank; the
    features are (tokens, cached prefix outputs) when the frozen prefix is cached."""
    for rows in micro_batches(sample, size):
        features = local.train_features[rows].to(device)
        if prefix_outputs is not None:
            features = (features, prefix_outputs[rows].to(device))
        yield features, local.train_labels[rows].to(device)


def _checkpoint_state(model, optimizer, schedule, epoch: int, step: int,
                      metrics: list[dict]) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "epoch": epoch,
        "step": step,
        "metrics": list(metrics),
    }


def released_accuracy(correct: int, rows: int, plan: PrivacyPlan, noise_generator) -> float:
    """Validation accuracy as released: (correct + N(0, sigma_r^2)) / rows when the rows are
    private and a release noise is set (a count changes by at most 1 per example)."""
    released = float(correct)
    if plan.release_noise_multiplier > 0:
        noise = torch.empty(1, device=noise_generator.device)
        fill_gaussian_noise_(noise, plan.release_noise_multiplier, noise_generator)
        released += noise.item()
    return released / max(rows, 1)


def accuracy(model: nn.Module, features, labels: torch.Tensor) -> float:
    """Share of the class ids `labels` predicted."""
    correct, rows = held_out_sums(model, features, labels, LABEL_KINDS["class"])
    return correct / max(rows, 1)


@torch.no_grad()
def held_out_sums(model: nn.Module, features, labels: torch.Tensor, kind: LabelKind,
                  prefix: FrozenPrefix | None = None) -> list[float]:
    """`kind`'s sums (for class ids: labels predicted, rows) over the rows; `features` are
    (tokens, cached prefix outputs) with a `prefix`, whose frozen layers then do not run
    again."""
    model.eval()
    device = next(model.parameters()).device
    sums = [0.0] * kind.sums
    for start in range(0, len(labels), 1024):
        rows = slice(start, start + 1024)
        if prefix is None:
            logits = model(features[rows].to(device))
        else:
            tokens, hidden = features
            with prefix.skipped(hidden[rows].to(device)):
                logits = model(tokens[rows].to(device))
        batch = kind.score(logits.cpu(), labels[rows])
        sums = [total + value for total, value in zip(sums, batch, strict=True)]
    return sums
