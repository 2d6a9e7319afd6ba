"""Poisson sampling of users, each with up to `privacy.rows_per_user` of its rows, and
micro-batches that never split a user (ARCHITECTURE.md §2.14).

Each user joins a logical batch independently with probability q = B / N_users (B: the
expected number of users per step, `training.batch_size`); a sampled user brings at most
`rows_per_user` of its rows, drawn at random each time it is sampled. A user's rows must be
clipped together, so they stay in one micro-batch (`rows_per_user <= max_physical_batch`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from raydp_train.privacy.sampling import poisson_sample


class UserRows(NamedTuple):
    """Rows grouped by user: user j's rows are rows[offsets[j]:offsets[j + 1]]."""

    users: Tensor  # [N_users] the distinct user ids, sorted
    offsets: Tensor  # [N_users + 1]
    rows: Tensor  # [rows] row indices, user by user

    @property
    def num_users(self) -> int:
        return self.users.numel()


def user_rows(user_of_row: Tensor) -> UserRows:
    """Group row indices by their user id ([rows] integers)."""
    order = torch.argsort(user_of_row, stable=True)
    users, counts = torch.unique_consecutive(user_of_row[order], return_counts=True)
    offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    return UserRows(users, offsets, order)


def sample_user_rows(index: UserRows, sampling_rate: float, rows_per_user: int,
                     generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """(rows, their users), user by user: each user in with probability q, with at most
    `rows_per_user` of its rows drawn at random. May be empty (the step still happens)."""
    sampled = poisson_sample(index.num_users, sampling_rate, generator)
    rows, users = [], []
    for j in sampled.tolist():
        mine = index.rows[index.offsets[j]:index.offsets[j + 1]]
        if mine.numel() > rows_per_user:
            mine = mine[torch.randperm(mine.numel(), generator=generator)[:rows_per_user]]
        rows.append(mine)
        users.append(index.users[j].expand(mine.numel()))
    if not rows:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty
    return torch.cat(rows), torch.cat(users)


def whole_user_micro_batches(rows: Tensor, users: Tensor,
                             max_physical_batch: int) -> list[tuple[Tensor, Tensor]]:
    """(rows, users) chunks of at most `max_physical_batch` rows, each user's rows (adjacent,
    as `sample_user_rows` gives them) in one chunk; [] if empty."""
    if rows.numel() == 0:
        return []
    _, counts = torch.unique_consecutive(users, return_counts=True)
    if int(counts.max()) > max_physical_batch:
        raise ValueError(f"privacy.rows_per_user: a user's {int(counts.max())} rows exceed "
                         f"training.max_physical_batch {max_physical_batch}")
    chunks, start, size = [], 0, 0
    for count in counts.tolist():
        if size + count > max_physical_batch:
            chunks.append((rows[start:start + size], users[start:start + size]))
            start, size = start + size, 0
        size += count
    chunks.append((rows[start:start + size], users[start:start + size]))
    return chunks
