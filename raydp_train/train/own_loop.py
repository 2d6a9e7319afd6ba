"""DP-SGD inside the user's own training loop (ARCHITECTURE.md §2.11): the engine of a
pipeline run, one `PrivateStep` per worker of the user's `train_loop_per_worker`.

    private = rt.PrivateStep(model, optimizer, clip_norm=1.0, noise_multiplier=1.1,
                             expected_batch_size=256, num_examples=60_000, delta=1e-5,
                             budget=config["budget"], owner="my-loop")
    for _ in range(steps):
        rows = private.sample(len(my_shard))          # Poisson, q = B / N
        private.step(features[rows], labels[rows])    # clip, noise (rank 0), all-reduce, step
    private.finish()                                  # unused reserved steps go back

Each worker samples its own disjoint shard with the global q = B / N; every rank must call
`step` the same number of times (the all-reduce is collective), even on an empty sample.
Steps are reserved from the named global budget, one chunk at a time, by rank 0 before any of
them is released; a refusal raises `BudgetExhausted` on every rank. Rank 0's parameters are
broadcast at construction, so do not wrap the model in DDP (`prepare_model`): the engine
all-reduces the clipped, noised sum itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Self

import torch
from torch import Tensor, nn

from raydp_train.config.privacy import SelfCheckConfig
from raydp_train.errors import UserError
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.noise import make_generator, make_noise_generator
from raydp_train.privacy.sampling import poisson_sample, sampling_rate
from raydp_train.train.charges import Charged, ChargeRefused, MemoryCharges, RunAccount
from raydp_train.train.engine_checks import EngineChecks
from raydp_train.train.plan import PrivacyPlan
from raydp_train.train.step import cross_entropy_loss, private_step
from raydp_train.train.stops import StopReason


class BudgetExhausted(ChargeRefused):
    """The global budget refused the next steps: none of them ran; stop the loop."""


class PrivateStepError(UserError, ValueError):
    """A PrivateStep argument out of range; the message names it."""


class PrivateStep:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 clip_norm: float, noise_multiplier: float, expected_batch_size: int,
                 num_examples: int, delta: float, budget=None, owner: str = "own-loop",
                 steps_per_charge: int | None = None, accountant: str = "rdp",
                 loss: Callable[[nn.Module, Tensor, Tensor], Tensor] = cross_entropy_loss,
                 max_physical_batch: int = 256, seed: int | None = None,
                 self_check: dict | None = None, other_layers: str = "per_example"):
        """`num_examples`: N of the WHOLE training set (every worker's shard); `budget`: a
        `rt.open_budget(...)` handle made on the driver (None: nothing reserved, the steps
        are only counted); `steps_per_charge`: steps reserved at a time (default one epoch,
        N // B); `loss(model, features, labels)`: per-example losses [B]; `seed`: a
        reproducible run, for tests only; `self_check`: privacy.self_check's fields (the
        engine against one backward per example on the first step and a random 1% of the
        others, as in a pipeline run: a loss or model that mixes examples is refused before
        its noisy gradient is released); `other_layers`: privacy.other_layers (a module
        without a rule: "per_example" by torch.func, or "refuse")."""
        _check_arguments(clip_norm, noise_multiplier, expected_batch_size, num_examples, delta,
                         max_physical_batch)
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.max_physical_batch = max_physical_batch
        self.rank, self.world_size = _rank_and_world()
        rate = sampling_rate(expected_batch_size, num_examples)
        self.plan = PrivacyPlan(num_examples, expected_batch_size, rate, 0, noise_multiplier,
                                False, clip_norm, delta, accountant)
        self.steps_per_charge = steps_per_charge or max(1, num_examples // expected_batch_size)
        self.account = RunAccount(MemoryCharges(), budget, owner, self.plan)
        self.steps_done, self._finished = 0, False
        self._granted = 0  # steps reserved so far; steps_done never passes it
        self._last_chunk = 0  # steps of the newest reservation
        self._broadcast_parameters()
        self.clipper = PerExampleClipper(model, clip_norm, other_layers=other_layers)
        device = self.clipper.flat_grad.device
        self._noise, _ = make_noise_generator("fast", seed, device)
        self._sampling, _ = make_generator(None if seed is None else seed + 1 + self.rank)
        # Rank 0 alone draws: ONE draw of std sigma*C per step for the whole world.
        self._noise_std = noise_multiplier * clip_norm if self.rank == 0 else 0.0
        shared_seed = self._from_rank_0(int.from_bytes(os.urandom(8), "little")
                                        if seed is None else seed)
        self._checks = EngineChecks(SelfCheckConfig(**(self_check or {})), shared_seed,
                                    self._gather)

    def sample(self, local_rows: int) -> Tensor:
        """Indices of this worker's rows in the next logical batch: each of its `local_rows`
        joins independently with probability q = B / N (may be none)."""
        return poisson_sample(local_rows, self.plan.sampling_rate, self._sampling)

    def step(self, features: Tensor, labels: Tensor) -> float:
        """One DP-SGD step on this worker's sampled rows (empty is fine): per-example clipping,
        the one noise draw (rank 0), the all-reduce, / B, optimizer.step(). Reserves the next
        steps first when those granted are used up. Returns the rows' summed loss (local, not
        released)."""
        if self._finished:
            raise PrivateStepError("PrivateStep.step after finish(): its reserved steps were "
                                   "settled and its engine detached; make a new PrivateStep")
        if self.steps_done == self._granted:
            self._reserve()
        batches = zip(features.split(self.max_physical_batch),
                      labels.split(self.max_physical_batch), strict=True)
        stats = private_step(self.model, self.clipper, self.optimizer, batches, self.loss,
                             self._noise_std, self.plan.expected_batch_size, self._noise,
                             self._all_reduce_sum, engine_checks=self._checks)
        self.steps_done += 1
        return stats.loss_sum

    def epsilon(self, accountant: str | None = None) -> float:
        """Epsilon of the steps taken so far, at `delta` (`accountant`: "rdp" or "pld")."""
        return self.plan.epsilon(self.steps_done, accountant, releases=0)

    def finish(self) -> None:
        """Give the reserved steps that were not taken back to the budget; detach the engine."""
        used_of_last = self.steps_done - (self._granted - self._last_chunk)
        self.account.settle(Charged(used_of_last))
        self.clipper.close()
        self._finished = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_) -> None:
        self.finish()

    def _reserve(self) -> None:
        """Rank 0 settles the used chunk and reserves the next; every rank obeys its answer."""
        refusal = None
        if self.rank == 0:
            self.account.settle(Charged(self._last_chunk))
            try:
                self.account.charge(Charged(self.steps_per_charge))
            except ChargeRefused as error:
                refusal = error.details
        refusal = self._from_rank_0(refusal)
        if refusal is not None:
            raise BudgetExhausted(StopReason.BUDGET_EXHAUSTED,
                                  f"{refusal} (after {self.steps_done} steps)")
        self._granted += self.steps_per_charge
        self._last_chunk = self.steps_per_charge

    def _broadcast_parameters(self) -> None:
        if self.world_size > 1:
            for tensor in [*self.model.parameters(), *self.model.buffers()]:
                torch.distributed.broadcast(tensor.data, src=0)

    def _all_reduce_sum(self, tensor: Tensor) -> None:
        if self.world_size > 1:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)

    def _gather(self, value) -> list:
        if self.world_size == 1:
            return [value]
        values = [None] * self.world_size
        torch.distributed.all_gather_object(values, value)
        return values

    def _from_rank_0(self, value):
        if self.world_size == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _check_arguments(clip_norm, noise_multiplier, expected_batch_size, num_examples, delta,
                     max_physical_batch) -> None:
    problems = [
        (clip_norm > 0, f"clip_norm: must be > 0, got {clip_norm}"),
        (noise_multiplier > 0,
         f"noise_multiplier: must be > 0 (a private step adds noise), got {noise_multiplier}"),
        (0 < expected_batch_size <= num_examples,
         f"expected_batch_size: must be in [1, num_examples = {num_examples}], got "
         + str(expected_batch_size)),
        (0 < delta < 1 / max(num_examples, 1),
         f"delta: must be in (0, 1/num_examples), got {delta}"),
        (max_physical_batch >= 1, f"max_physical_batch: must be >= 1, got {max_physical_batch}"),
    ]
    for holds, message in problems:
        if not holds:
            raise PrivateStepError(f"PrivateStep {message}")
