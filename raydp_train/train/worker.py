"""The training loop, read top to bottom as DESIGN §2.1: sample, micro-batch, clip, noise,
step, account, report. World size 1 here; the distributed issue adds the all-reduce."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from raydp_train.data import Dataset
from raydp_train.models import build_model
from raydp_train.plan import PrivacyPlan
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.noise import make_generator, noise_std
from raydp_train.privacy.sampling import micro_batches, poisson_sample
from raydp_train.train.step import cross_entropy_loss, private_step

OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


@dataclass
class TrainResult:
    model: nn.Module
    metrics: list[dict] = field(default_factory=list)  # one row per epoch
    noise_mode: str = "secure"
    steps_done: int = 0


def make_optimizer(model: nn.Module, training) -> torch.optim.Optimizer:
    options = {"lr": training.lr, "weight_decay": training.weight_decay}
    if training.optimizer == "sgd":
        options["momentum"] = training.momentum
    return OPTIMIZERS[training.optimizer](model.parameters(), **options)


def epoch_ends(epochs: int, expected_batch_size: int, num_examples: int) -> list[int]:
    """Step count at the end of each epoch: floor(e / q) for e = 1..epochs."""
    return [e * num_examples // expected_batch_size for e in range(1, epochs + 1)]


def train(
    pipeline, dataset: Dataset, plan: PrivacyPlan, on_epoch: Callable[[dict], None] = print
) -> TrainResult:
    seed = pipeline.run.seed
    if seed is not None:
        torch.manual_seed(seed)  # model initialization, reproducible only on request
    model = build_model(pipeline.model, dataset.feature_shape, dataset.num_classes)
    optimizer = make_optimizer(model, pipeline.training)
    clipper = PerExampleClipper(model, plan.clip_norm)
    noise_generator, noise_mode = make_generator(seed)
    std = noise_std(plan.noise_multiplier, plan.clip_norm)
    sampling_generator, _ = make_generator(None if seed is None else seed + 1)
    result = TrainResult(model=model, noise_mode=noise_mode)
    ends = epoch_ends(pipeline.training.epochs, plan.expected_batch_size, plan.num_examples)
    step, started = 0, time.monotonic()
    for epoch, end in enumerate(ends, start=1):
        loss_sum, seen = 0.0, 0
        model.train()
        while step < end:
            sample = poisson_sample(plan.num_examples, plan.sampling_rate, sampling_generator)
            batches = (
                (dataset.train_features[idx], dataset.train_labels[idx])
                for idx in micro_batches(sample, pipeline.training.max_physical_batch)
            )
            stats = private_step(
                model, clipper, optimizer, batches, cross_entropy_loss,
                std, plan.expected_batch_size, noise_generator,
            )
            loss_sum, seen, step = loss_sum + stats.loss_sum, seen + stats.num_examples, step + 1
        row = {
            "epoch": epoch,
            "steps": step,
            "examples_seen": seen,
            "train_loss": loss_sum / max(seen, 1),
            "test_accuracy": accuracy(model, dataset.test_features, dataset.test_labels),
            "epsilon": plan.epsilon(step),
            "elapsed_s": time.monotonic() - started,
        }
        result.metrics.append(row)
        on_epoch(row)
    clipper.close()
    result.steps_done = step
    return result


@torch.no_grad()
def accuracy(model: nn.Module, features: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    correct = sum(
        (model(features[i : i + 1024]).argmax(1) == labels[i : i + 1024]).sum().item()
        for i in range(0, len(labels), 1024)
    )
    return correct / max(len(labels), 1)
