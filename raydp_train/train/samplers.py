"""How a worker gets each step's Poisson sample, cut into micro-batches (`data.sampler`):
`MemorySampler` holds the rank's shard and draws a mask per step (ARCHITECTURE.md §2.2), or
with users (privacy.unit user) draws this rank's users, up to `rows_per_user` rows each, every
user whole in one micro-batch (§2.14);
`StreamingSampler` reads the rows each step drew from a training file no worker holds whole
(§2.13). Both give every step of the run, an empty one as no micro-batch: the rank still takes
part in the step's all-reduce. With `training.trim_padding` each micro-batch of texts holds
texts of similar length, cut to its longest (train/length_batches.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from raydp_train.privacy.sampling import micro_batches, poisson_sample
from raydp_train.privacy.user_sampling import (
    sample_user_rows,
    user_rows,
    whole_user_micro_batches,
)
from raydp_train.train.length_batches import ordered_by_length, token_counts, trimmed


class MemorySampler:
    """This rank's training rows in memory; each step includes each row (or, with users,
    each of this rank's users) with probability q, from the rank's own generator."""

    name = "memory"

    def __init__(self, local, prefix_outputs, generator: torch.Generator, sampling_rate: float,
                 max_physical_batch: int, device, rows_per_user: int | None = None,
                 trim_padding: bool = False):
        self.local, self.prefix_outputs, self.generator = local, prefix_outputs, generator
        self.sampling_rate, self.size, self.device = sampling_rate, max_physical_batch, device
        users = getattr(local, "train_users", None)
        self.users = None if users is None else user_rows(users)
        self.rows_per_user = rows_per_user
        self.widths = token_counts(local.train_features) if trim_padding else None

    @property
    def num_rows(self) -> int:
        return self.local.num_train

    def start_epoch(self, epoch: int, first_step: int, end: int) -> None:
        """Nothing to prepare: each step draws its own mask."""

    def step_batches(self) -> Iterator[tuple]:
        """(features, labels) of each micro-batch of the next step's sample, or with users
        (features, labels, user ids); features are (tokens, cached prefix outputs) when the
        frozen prefix is cached."""
        if self.users is None:
            sample = poisson_sample(self.num_rows, self.sampling_rate, self.generator)
            if self.widths is not None:
                sample = ordered_by_length(sample, self.widths)
            chunks = [(rows, None) for rows in micro_batches(sample, self.size)]
        else:  # every user whole in one micro-batch: trimmed, not reordered
            rows, users = sample_user_rows(self.users, self.sampling_rate, self.rows_per_user,
                                           self.generator)
            chunks = whole_user_micro_batches(rows, users, self.size)
        for rows, users in chunks:
            features = self.local.train_features[rows]
            if self.prefix_outputs is not None:
                features = (features, self.prefix_outputs[rows])
            if self.widths is not None:
                features = trimmed(features, int(self.widths[rows].max()))
            features = _to(features, self.device)
            batch = (features, self.local.train_labels[rows].to(self.device))
            yield batch if users is None else (*batch, users.to(self.device))


class StreamingSampler:
    """This rank's run of the training file's rows, never held whole: each epoch draws every
    row's steps (seeded by `seed` and the epoch: a resumed run draws the same again) and Ray
    Data hands the rows over step by step (data/streaming.py)."""

    name = "streaming"

    def __init__(self, pipeline, sampling_rate: float, num_examples: int, context, seed: int,
                 labels_as: tuple):
        from raydp_train.data.streaming import read_columns, worker_rows
        from raydp_train.models.hf_files import tokenizer_source

        self.data, self.path = pipeline.data, Path(pipeline.data.path)
        self.columns, self.tokenizer = read_columns(self.data), tokenizer_source(pipeline.model)
        self.rows = worker_rows(num_examples, context.world_size, context.rank)
        self.sampling_rate, self.seed, self.labels_as = sampling_rate, seed, labels_as
        self.size, self.device = pipeline.training.max_physical_batch, context.device
        self.trim_padding = pipeline.training.trim_padding
        self.steps: Iterator | None = None

    @property
    def num_rows(self) -> int:
        return self.rows[1] - self.rows[0]

    def start_epoch(self, epoch: int, first_step: int, end: int) -> None:
        """Draw the epoch's steps first_step .. end-1 (the epoch's whole: checkpoints fall
        between epochs) and start reading them in order."""
        from raydp_train.data.streaming import EpochDraws, epoch_steps

        draws = EpochDraws(self.seed, epoch, end - first_step, self.sampling_rate)
        self.steps = epoch_steps(self.path, self.columns, self.rows, draws)

    def step_batches(self) -> Iterator[tuple]:
        """(features, labels) of each micro-batch of the next step's rows."""
        from raydp_train.data.shards import shard_rows

        table = next(self.steps)
        if table.num_rows == 0:
            return
        features, labels = shard_rows(table, self.data, self.path, self.tokenizer)
        features = torch.as_tensor(np.ascontiguousarray(features))
        labels = torch.as_tensor(np.asarray(labels).astype(self.labels_as[0]))
        rows = torch.arange(table.num_rows)
        widths = token_counts(features) if self.trim_padding else None
        if widths is not None:
            rows = ordered_by_length(rows, widths)
        for chunk in micro_batches(rows, self.size):
            chunk_features = features[chunk]
            if widths is not None:
                chunk_features = trimmed(chunk_features, int(widths[chunk].max()))
            yield chunk_features.to(self.device), labels[chunk].to(self.device)


def _to(features, device):
    """`features` (a tensor, or a tuple of them) on `device`."""
    if isinstance(features, tuple):
        return tuple(part.to(device) for part in features)
    return features.to(device)


def make_sampler(kind: str, run, shared_seed: int):
    """The sampler `kind` ("memory" or "streaming", data/streaming.choose_sampler) of a
    `WorkerRun` whose rows and prefix cache are set."""
    plan, training = run.plan, run.pipeline.training
    if kind == "streaming":
        from raydp_train.data.targets import label_kind

        labels_as = label_kind(run.pipeline.data).label_array(run.local.num_classes)
        return StreamingSampler(run.pipeline, plan.sampling_rate, plan.num_examples,
                                run.context, shared_seed, labels_as)
    return MemorySampler(run.local, run.prefix_outputs, run.sampling_generator,
                         plan.sampling_rate, training.max_physical_batch, run.context.device,
                         plan.rows_per_user, training.trim_padding)
