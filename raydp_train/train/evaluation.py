"""Scoring held-out rows on a worker for a label kind (train/tasks.py asks): its per-example
loss and sums, with the frozen prefix cached or not, its baselines, and the validation accuracy
as released with noise (ARCHITECTURE.md §2.5, §2.12). Every sum is this rank's; the worker
all-reduces them."""

from __future__ import annotations

import torch
from torch import nn

from raydp_train.data.sources import Dataset
from raydp_train.data.targets import LABEL_KINDS, LabelKind
from raydp_train.models.custom import training_loss
from raydp_train.models.hf_prefix import FrozenPrefix, cached_prefix_loss
from raydp_train.privacy.noise import fill_gaussian_noise_
from raydp_train.privacy.user_sampling import user_rows


def test_baselines(local: Dataset, kind: LabelKind, context) -> dict[str, float]:
    """What a test metric must beat (chance, the test split's majority class, ...), from
    every rank's sums of its test labels. Only the held-out test labels are read, which every
    epoch scores without noise anyway: no training row is looked at, no privacy spent."""
    sums = kind.baseline_sums(local.test_labels, local.num_classes).to(context.device)
    context.all_reduce_sum(sums)
    return kind.baselines(sums.tolist())


def frozen_prefix_cache(training, model_config, model: nn.Module, local: Dataset,
                         kind: LabelKind):
    """(per-example loss, outputs of the frozen prefix for this rank's training rows or None,
    score(model, split) -> the kind's sums on this rank's rows of the split): with
    training.cache_frozen_prefix the frozen bottom layers run once per example (hf_prefix),
    the test and validation rows' too, so each epoch's scoring runs only the trained top."""
    splits = {"test": (local.test_features, local.test_labels),
              "validation": (local.validation_features, local.validation_labels)}
    users = {"validation": local.validation_users}  # private per user: shares, not counts
    if not training.cache_frozen_prefix:
        return (training_loss(model_config, kind), None,
                lambda model, split: held_out_scores(model, *splits[split], kind,
                                                     users.get(split)))
    prefix = FrozenPrefix(model)
    hidden = {split: prefix.outputs(model, features)
              for split, (features, _) in splits.items() if features is not None}

    def score(model: nn.Module, split: str) -> list[float]:
        features, labels = splits[split]
        return held_out_scores(model, (features, hidden[split]), labels, kind,
                               users.get(split), prefix)

    return cached_prefix_loss(prefix), prefix.outputs(model, local.train_features), score


def held_out_scores(model: nn.Module, features, labels: torch.Tensor, kind: LabelKind,
                    users: torch.Tensor | None, prefix: FrozenPrefix | None = None) -> list:
    """`kind`'s sums over the rows; with `users` (a private validation file under
    privacy.unit user, ARCHITECTURE.md §2.14) the released count per user instead:
    [sum over users of the share of its rows counted right, users, 0, ...]. Each share lies
    in [0, 1], so adding or removing a whole user moves the sum by at most 1: the release's
    sensitivity 1 and its accounting stay those of a count per example, now per user."""
    if users is None:
        return held_out_sums(model, features, labels, kind, prefix)
    outputs = torch.cat([out for out, _ in held_out_outputs(model, features, len(labels),
                                                             prefix)])
    index = user_rows(users)
    shares = 0.0
    for user in range(index.num_users):  # one forward pass above, each user's score here
        rows = index.rows[index.offsets[user]:index.offsets[user + 1]]
        count, seen = kind.released_count(kind.score(outputs[rows], labels[rows]))
        shares += count / seen
    return [shares, float(index.num_users)] + [0.0] * (kind.sums - 2)


def released_accuracy(correct: int, rows: int, release_noise_multiplier: float,
                      noise_generator) -> float:
    """Validation accuracy as released: (correct + N(0, sigma_r^2)) / rows when the rows are
    private and a release noise sigma_r is set (a count changes by at most 1 per example)."""
    released = float(correct)
    if release_noise_multiplier > 0:
        noise = torch.empty(1, device=noise_generator.device)
        fill_gaussian_noise_(noise, release_noise_multiplier, noise_generator)
        released += noise.item()
    return released / max(rows, 1)


def accuracy(model: nn.Module, features, labels: torch.Tensor) -> float:
    """Share of the class ids `labels` predicted."""
    correct, rows = held_out_sums(model, features, labels, LABEL_KINDS["class"])
    return correct / max(rows, 1)


def held_out_sums(model: nn.Module, features, labels: torch.Tensor, kind: LabelKind,
                  prefix: FrozenPrefix | None = None) -> list[float]:
    """`kind`'s sums (for class ids: labels predicted, rows) over the rows; `features` are
    (tokens, cached prefix outputs) with a `prefix`, whose frozen layers then do not run
    again."""
    sums = [0.0] * kind.sums
    for logits, rows in held_out_outputs(model, features, len(labels), prefix):
        batch = kind.score(logits, labels[rows])
        sums = [total + value for total, value in zip(sums, batch, strict=True)]
    return sums


@torch.no_grad()
def held_out_outputs(model: nn.Module, features, count: int, prefix: FrozenPrefix | None):
    """(the model's outputs on the CPU, their rows) for the `count` rows, 1024 at a time."""
    model.eval()
    device = next(model.parameters()).device
    for start in range(0, count, 1024):
        rows = slice(start, start + 1024)
        if prefix is None:
            logits = model(features[rows].to(device))
        else:
            tokens, hidden = features
            with prefix.skipped(hidden[rows].to(device)):
                logits = model(tokens[rows].to(device))
        yield logits.cpu(), rows
