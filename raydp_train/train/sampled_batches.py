"""A step's logical batch of this rank, as the micro-batches the step clips: Poisson-sampled
rows (ARCHITECTURE.md §2.1), or Poisson-sampled users with up to `rows_per_user` rows each,
every user whole in one micro-batch (§2.14)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from raydp_train.privacy.sampling import micro_batches, poisson_sample
from raydp_train.privacy.user_sampling import (
    sample_user_rows,
    user_rows,
    whole_user_micro_batches,
)


class StepSampler:
    """Draws each step's sample of this rank's rows (`local`, a torch Dataset) with the
    plan's q; with users, q is over this rank's users (each user's rows on one rank)."""

    def __init__(self, local, plan, max_physical_batch: int, generator: torch.Generator):
        self.local, self.plan, self.generator = local, plan, generator
        self.size = max_physical_batch
        users = getattr(local, "train_users", None)
        self.users = None if users is None else user_rows(users)

    def micro_batches(self, prefix_outputs, device) -> Iterator[tuple]:
        """The step's sample, drawn now, as micro-batches (features, labels) or, with users,
        (features, labels, user ids); the features are (tokens, cached prefix outputs) when
        the frozen prefix is cached."""
        if self.users is None:
            sample = poisson_sample(self.local.num_train, self.plan.sampling_rate, self.generator)
            chunks = [(rows, None) for rows in micro_batches(sample, self.size)]
        else:
            rows, users = sample_user_rows(self.users, self.plan.sampling_rate,
                                           self.plan.rows_per_user, self.generator)
            chunks = whole_user_micro_batches(rows, users, self.size)
        return self._batches(chunks, prefix_outputs, device)

    def _batches(self, chunks: list, prefix_outputs, device) -> Iterator[tuple]:
        local = self.local
        for rows, users in chunks:
            features = local.train_features[rows].to(device)
            if prefix_outputs is not None:
                features = (features, prefix_outputs[rows].to(device))
            batch = (features, local.train_labels[rows].to(device))
            yield batch if users is None else (*batch, users.to(device))
