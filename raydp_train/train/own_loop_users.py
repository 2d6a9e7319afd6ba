"""The user as the unit in a user's own loop (ARCHITECTURE.md §2.11, §2.14): `PrivateStep(...,
unit="user", rows_per_user=K)` with each row's user id given beside the rows.

    rows = private.load_rows(shard)                      # this worker's rows
    batch, users = private.sample(rows, users=user_ids)  # user_ids: [rows] ints, aligned
    private.step(*batch, users=users)                    # or step(batch, users=...) for a dict

`sample` draws this rank's users, each with probability q = expected_batch_size / num_examples
(both counting USERS), and up to K rows of each sampled user, drawn at random each time: the
pipeline's sampler (privacy/user_sampling.py). `step` keeps each user's rows in one
micro-batch, so the engine clips each user's summed (or mean) gradient once
(privacy/user_clipping.py). A user's rows must all live on one worker: the first step gathers
every rank's user ids and refuses a user on two workers, or a count of users other than
`num_examples`, before anything is reserved.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from raydp_train.privacy.user_clipping import CONTRIBUTIONS, UNITS
from raydp_train.privacy.user_sampling import (
    sample_user_rows,
    user_rows,
    whole_user_micro_batches,
)
from raydp_train.train import own_loop_rows as rows_
from raydp_train.train.own_loop_arguments import PrivateStepError


def check_unit(unit: str, rows_per_user, max_physical_batch: int,
               user_contribution: str = "sum", budget=None) -> dict:
    """The unit's arguments, refused on one line for the first that is wrong (the budget's
    unit too), as the privacy section's fields."""
    _check_unit(unit, rows_per_user, max_physical_batch, user_contribution)
    check_budget_unit(budget, unit)
    return {"unit": unit, "rows_per_user": rows_per_user,
            "user_contribution": user_contribution}


def _check_unit(unit: str, rows_per_user, max_physical_batch: int,
                user_contribution: str) -> None:
    if unit not in UNITS:
        raise PrivateStepError(f"unit: must be one of {', '.join(map(repr, UNITS))}, got "
                               f"{unit!r}")
    if user_contribution not in CONTRIBUTIONS:
        raise PrivateStepError(f"user_contribution: must be one of "
                               f"{', '.join(map(repr, CONTRIBUTIONS))}, got {user_contribution!r}")
    if unit == "example":
        if rows_per_user is not None or user_contribution != "sum":
            name = "rows_per_user" if rows_per_user is not None else "user_contribution"
            raise PrivateStepError(f"{name}: only with unit='user' (set it, or remove {name})")
        return
    if not (isinstance(rows_per_user, int) and 1 <= rows_per_user <= max_physical_batch):
        raise PrivateStepError(
            f"rows_per_user: unit='user' needs the cap on the rows a user brings to a step, "
            f"an int in [1, max_physical_batch = {max_physical_batch}] (a user's rows are "
            f"clipped in one micro-batch), got {rows_per_user!r}")


def check_budget_unit(budget, unit: str) -> None:
    """A budget keeps one unit: a per-user loop does not spend a per-example budget."""
    held = getattr(budget, "unit", "example")
    if budget is not None and held != unit:
        raise PrivateStepError(
            f"budget: '{budget.budget}' counts epsilon per {held}; this loop spends per "
            f"{unit}, and the two guarantees do not compose: open it with "
            f"rt.open_budget(..., unit={unit!r}), or use another budget name")


def user_ids(users, count: int, where: str) -> Tensor:
    """`users` as [count] int64 ids on the CPU, or refused on one line."""
    if users is None:
        raise PrivateStepError(f"{where}: unit='user' needs each row's user id: pass "
                               f"users=, a tensor of {count} integer ids aligned with the rows")
    if not isinstance(users, Tensor) or users.dim() != 1 or users.shape[0] != count or (
            users.is_floating_point() or users.is_complex() or users.dtype == torch.bool):
        shape = tuple(users.shape) if isinstance(users, Tensor) else type(users).__name__
        raise PrivateStepError(f"{where}: users= must be a 1-D integer tensor of the {count} "
                               f"rows' user ids, got {shape}"
                               + (f" {users.dtype}" if isinstance(users, Tensor) else ""))
    return users.detach().to("cpu", torch.int64)


class LoopUsers:
    """This rank's users: their rows indexed once, each step's users drawn, micro-batches cut
    whole, and the world checked once (every rank's users distinct, N of them)."""

    def __init__(self, rows_per_user: int, max_physical_batch: int):
        self.rows_per_user, self.max_physical_batch = rows_per_user, max_physical_batch
        self.index = None
        self._indexed: tuple | None = None  # which users tensor the index is of
        self.world_checked = False

    def sample(self, count: int, users, sampling_rate: float,
               generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """(row indices, their user ids), user by user: each of this rank's users with
        probability q, up to rows_per_user of its rows at random."""
        ids = user_ids(users, count, "sample")
        key = (users.data_ptr(), users._version, count)
        if self._indexed != key:
            self.index, self._indexed = user_rows(ids), key
        return sample_user_rows(self.index, sampling_rate, self.rows_per_user, generator)

    def check_world(self, world, num_users: int) -> None:
        """Once, before the first reservation, on every rank alike (a collective): each user on
        one worker, and `num_users` users in all."""
        mine = None if self.index is None else self.index.users.tolist()
        every = world.gather(mine)
        if any(ids is None for ids in every):
            raise PrivateStepError(
                "step: unit='user' draws each step's users: call sample(rows, users=...) on "
                f"every worker before its first step (rank {every.index(None)} did not)")
        owner: dict[int, int] = {}
        for rank, ids in enumerate(every):
            for user in ids:
                if owner.setdefault(user, rank) != rank:
                    raise PrivateStepError(
                        f"users: user {user} has rows on workers {owner[user]} and {rank}; "
                        "each user's rows must live on one worker (shard by user, e.g. "
                        "user id mod world size), or a user could change two workers' sums")
        if len(owner) != num_users:
            raise PrivateStepError(
                f"num_examples: with unit='user' it counts users (q = expected_batch_size / "
                f"num_examples), and the workers' rows have {len(owner)} users, not "
                f"{num_users}; pass num_examples={len(owner)}")
        self.world_checked = True

    def micro_batches(self, leaves: list[Tensor], users) -> list[tuple]:
        """The step's rows as micro-batches of whole users, each a flat tuple of the batch's
        tensors and, last, the rows' user ids (what the engine reads them by)."""
        ids = user_ids(users, leaves[0].shape[0], "step")
        order = torch.argsort(ids, stable=True)
        ids = ids[order]
        if ids.numel():
            most = int(torch.unique_consecutive(ids, return_counts=True)[1].max())
            if most > self.rows_per_user:
                raise PrivateStepError(
                    f"step: a user has {most} rows in this step, more than rows_per_user = "
                    f"{self.rows_per_user}; pass the rows and users that sample() returned")
        chunks = whole_user_micro_batches(order, ids, self.max_physical_batch)
        return [(*(leaf[rows.to(leaf.device)] for leaf in leaves),
                 chunk_users.to(leaves[0].device)) for rows, chunk_users in chunks]


def sample_users(loop_users: LoopUsers | None, rows, count: int, users, sampling_rate: float,
                 generator: torch.Generator) -> tuple:
    """`PrivateStep.sample` with unit user: (the sampled rows, or their indices when `rows`
    is a count; their user ids)."""
    if loop_users is None:
        raise PrivateStepError("sample: users= only with unit='user' (each row's user id)")
    indices, ids = loop_users.sample(count, users, sampling_rate, generator)
    return (indices if isinstance(rows, int) else rows_.take(rows, indices)), ids


def step_micro_batches(loop_users: LoopUsers | None, batch: tuple, users,
                       max_physical_batch: int, world, num_users: int) -> tuple:
    """(the batch's layout, its micro-batches as flat tuples); with users, whole users each
    (their ids last), after every rank's users are checked on the first step."""
    if loop_users is None:
        if users is not None:
            raise PrivateStepError("step: users= only with unit='user' (each row's user id)")
        return rows_.flat_micro_batches(batch, max_physical_batch)
    leaves, layout = tree_flatten(batch)
    micro_batches = loop_users.micro_batches(leaves, users)
    if not loop_users.world_checked:  # every rank's first step: before any reservation
        loop_users.check_world(world, num_users)
    return layout, micro_batches
