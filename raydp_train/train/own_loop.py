"""A pipeline's private step inside the user's own training loop (ARCHITECTURE.md §2.11): one
`PrivateStep` per worker of the user's `train_loop_per_worker`, with DP-SGD, LSG or DP-LoRA.

    private = rt.PrivateStep(model, optimizer, clip_norm=1.0, noise_multiplier=1.1,
                             expected_batch_size=256, num_examples=60_000, delta=1e-5,
                             budget=config["budget"], owner="my-loop")
    rows = private.load_rows(ray.train.get_dataset_shard("train"))  # or a DataLoader
    for _ in range(steps):
        private.step(*private.sample(rows))   # Poisson, clip, noise (rank 0), all-reduce, step
    private.finish()                          # unused reserved steps go back

Each worker samples its own disjoint shard with the global q = B / N; every rank must call
`step` the same number of times (the all-reduce is collective), even on an empty sample.
Steps are reserved from the named global budget, one chunk at a time, by rank 0 before any of
them is released; a refusal raises `BudgetExhausted` on every rank. Inside Ray Train, rank 0
marks each step in a release log under the run's storage before releasing it, so after a
restart `epsilon()` counts every step any attempt released (`state_dict` carries the rest).
Rank 0's parameters are broadcast at construction, so do not wrap the model in DDP
(`prepare_model`): the engine all-reduces the clipped, noised sum itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Self

import torch
from torch import Tensor, nn

from raydp_train.privacy.adaptive_clipping import count_noise_problem
from raydp_train.privacy.noise import make_generator, make_noise_generator
from raydp_train.privacy.sampling import poisson_sample, sampling_rate
from raydp_train.train import own_loop_rows as rows_
from raydp_train.train.charges import Charged, ChargeRefused, RunAccount
from raydp_train.train.engine_checks import EngineChecks
from raydp_train.train.own_loop_arguments import (
    PrivateStepError,
    calibrated_on_rank_0,
    check_noise,
    check_numbers,
    check_objects,
    privacy_settings,
)
from raydp_train.train.own_loop_state import (
    check_saved,
    count_restored,
    new_parameters_to_optimizer,
    plan_terms,
    release_record,
)
from raydp_train.train.own_loop_users import (
    LoopUsers,
    check_unit,
    sample_users,
    step_micro_batches,
)
from raydp_train.train.own_loop_world import LoopWorld
from raydp_train.train.plan import PrivacyPlan
from raydp_train.train.step import private_step

__all__ = ["BudgetExhausted", "PrivateStep", "PrivateStepError"]


class BudgetExhausted(ChargeRefused):
    """The global budget, or the target epsilon, refused the next steps: none of them ran."""


class PrivateStep:
    """The private step of one worker (the module docstring). Per user (`unit="user"`, the
    privacy unit a person with all of their rows, ARCHITECTURE.md §2.14): `num_examples` and
    `expected_batch_size` count USERS (q = B / N users, what `epsilon()` and the budget
    count; the budget opened with `rt.open_budget(..., unit="user")`), `sample(rows,
    users=ids)` takes each row's integer user id and returns (rows, ids) of the sampled users
    with at most `rows_per_user` rows each, and `step(*batch, users=ids)` clips each user's
    summed gradient (`user_contribution="mean"`: their mean) once. Each user's rows must live on one worker (checked on the first
    step, with the count of users, before anything is reserved)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 clip_norm: float, expected_batch_size: int, num_examples: int, delta: float,
                 noise_multiplier: float | None = None, target_epsilon: float | None = None,
                 steps: int | None = None, mechanism: str = "dpsgd", lsg: dict | None = None,
                 lora: dict | None = None, noise: str = "fast", budget=None,
                 owner: str = "own-loop", steps_per_charge: int | None = None,
                 accountant: str = "rdp", loss: Callable[..., Tensor] = rows_.inputs_then_labels,
                 max_physical_batch: int = 256, seed: int | None = None,
                 self_check: dict | None = None, other_layers: str = "per_example",
                 record_dir: str | None = None, clipping: str = "flat",
                 adaptive: dict | None = None, unit: str = "example",
                 rows_per_user: int | None = None, user_contribution: str = "sum"):
        """`num_examples`: N of the WHOLE training set (every worker's shard); sigma is
        `noise_multiplier`, or calibrated so that `steps` steps spend `target_epsilon` (the
        loop may not pass it); `mechanism`: a private mechanism's name (dpsgd, lsg, lora), with `lsg`/`lora` the
        settings of privacy.lsg / privacy.lora (DP-LoRA's adapters join `optimizer` as a
        new parameter group); `noise`: run.noise ("secure": AES-CTR, Holohan-Braghin);
        `budget`: a `rt.open_budget(...)` handle made on the driver (None: nothing reserved);
        `steps_per_charge`: steps reserved at a time (default N // B); `loss(model, *batch)`:
        per-example losses [B] (default: cross-entropy of model(*inputs) against the last
        tensor); `seed`: reproducible noise and sampling, for tests only; `self_check`:
        privacy.self_check's fields; `other_layers`: privacy.other_layers; `record_dir`: where
        rank 0 marks each release before it happens (default: the Ray Train run's storage,
        when local; outside Ray Train, nothing: a single process has no restart); `clipping`,
        `adaptive`: privacy.clipping and privacy.adaptive's fields (adaptive clipping);
        `unit`, `rows_per_user`, `user_contribution`: privacy's (the class docstring)."""
        by_user = check_unit(unit, rows_per_user, max_physical_batch, user_contribution, budget)
        check_numbers(clip_norm, noise_multiplier, target_epsilon, steps, expected_batch_size,
                      num_examples, delta, max_physical_batch)
        check_objects(model, optimizer, loss, steps_per_charge)
        check_noise(noise, seed)
        privacy, chosen = privacy_settings(
            mechanism, clip_norm=clip_norm, noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon, delta=delta, accountant=accountant, lsg=lsg,
            lora=lora, self_check=self_check, other_layers=other_layers, clipping=clipping,
            adaptive=adaptive, **by_user)
        self.world = LoopWorld()
        self.rank = self.world.rank
        rate = sampling_rate(expected_batch_size, num_examples)
        sigma = noise_multiplier or calibrated_on_rank_0(self.world, target_epsilon, delta,
                                                         rate, steps, accountant)
        if privacy.clipping == "adaptive" and (problem := count_noise_problem(
                sigma, privacy.adaptive.count_noise, expected_batch_size)):
            raise PrivateStepError(f"adaptive: {problem}")  # before anything is reserved
        self.plan = PrivacyPlan(num_examples, expected_batch_size, rate, steps or 0, sigma,
                                noise_multiplier is None, clip_norm, delta, accountant,
                                mechanism=chosen, **by_user)
        self.model, self.optimizer, self.loss, self.seed = model, optimizer, loss, seed
        self.max_physical_batch = max_physical_batch
        self.users = LoopUsers(rows_per_user, max_physical_batch) if unit == "user" else None
        self.steps_per_charge = steps_per_charge or max(1, num_examples // expected_batch_size)
        self.account = RunAccount(release_record(self.rank, record_dir), budget, owner,
                                  self.plan, epsilon_cap=target_epsilon)
        self.steps_done, self._finished = 0, False
        self._taken = 0  # steps this process released
        self._released_before = 0  # steps released before this process (earlier attempts)
        self._granted, self._last_chunk = 0, 0  # steps reserved so far; of the newest chunk
        self._started = False  # this process has reserved (and learnt what came before)
        self._attach(privacy, chosen, model, optimizer, seed, noise)

    def _attach(self, privacy, chosen, model, optimizer, seed, noise) -> None:
        """Rank 0's parameters everywhere, the mechanism's engine (its randomness shared by
        every rank), the noise (rank 0 alone draws it) and this rank's sampler."""
        self.world.broadcast_parameters(self.model)
        shared_seed = self.world.from_rank_0(int.from_bytes(os.urandom(8), "little")
                                        if seed is None else seed)
        self.mechanism = chosen(privacy, torch.Generator().manual_seed(shared_seed))
        self.clipper = self.mechanism.attach(model, self.plan.clip_norm)
        new_parameters_to_optimizer(model, optimizer)  # DP-LoRA's adapters
        device = self.clipper.flat_grad.device
        self._noise, self.noise_mode = make_noise_generator(noise, seed, device)
        self._noise_std = (self.mechanism.noise_std(self.plan.noise_multiplier,
                                                    self.plan.clip_norm)
                           if self.rank == 0 else 0.0)
        self._sampling, _ = make_generator(None)
        self._checks = EngineChecks(privacy.self_check, shared_seed + 1, self.world.gather)

    @property
    def noise_multiplier(self) -> float:
        """sigma: as given, or calibrated to `target_epsilon`."""
        return self.plan.noise_multiplier

    @property
    def steps_released(self) -> int:
        """Every noisy step released so far, by this process and the attempts before it
        (repeated steps after a restart count again: they were released again)."""
        return self._released_before + self._taken

    @staticmethod
    def load_rows(source) -> object:
        """This worker's rows in memory, from a Ray Data shard or a DataLoader-like iterable
        of batches (tensors, tuples or dicts of tensors), to `sample` from every step."""
        return rows_.load_rows(source)

    def sample(self, rows, users: Tensor | None = None):
        """This worker's part of the next logical batch: each of its rows joins independently
        with probability q = B / N (may be none). `rows`: a count (the indices come back) or
        the rows themselves (a tensor, tuple or dict; the sampled rows come back, laid out
        alike). With unit="user", `users` holds each row's user id and (rows, their users)
        come back: each of this worker's users joins with probability q, with up to
        rows_per_user of its rows drawn at random."""
        count = rows if isinstance(rows, int) else rows_.row_count(rows, "sample")
        if self.users is not None or users is not None:
            return sample_users(self.users, rows, count, users, self.plan.sampling_rate,
                                self._sampler())
        indices = poisson_sample(count, self.plan.sampling_rate, self._sampler())
        return indices if isinstance(rows, int) else rows_.take(rows, indices)

    def step(self, *batch, users: Tensor | None = None) -> float:
        """One private step on this worker's sampled rows (empty is fine): per-example
        clipping, the one noise draw (rank 0), the all-reduce, / B, optimizer.step().
        `batch` is what `loss(model, *batch)` takes: (features, labels), (inputs..., labels),
        or one dict; with unit="user", `users`: the rows' user ids as `sample` gave them.
        Reserves the next steps first when those granted are used up. Returns the rows'
        summed loss (local, not released)."""
        if self._finished:
            raise PrivateStepError("step after finish(): its reserved steps were settled and "
                                   "its engine detached; make a new PrivateStep")
        rows_.row_count(batch[0] if len(batch) == 1 else batch, "step")
        if self.loss is rows_.inputs_then_labels:
            rows_.check_default_loss(batch)
        layout, micro_batches = step_micro_batches(self.users, batch, users,
                                                   self.max_physical_batch, self.world,
                                                   self.plan.num_examples)
        if self.steps_done == self._granted:
            self._reserve()
        self.mechanism.refresh(self.steps_done, self._epoch())
        self.account.releasing_step(self.steps_done)  # on record before it can leave
        stats = private_step(self.model, self.clipper, self.optimizer, micro_batches,
                             rows_.on_layout(self.loss, layout), self._noise_std,
                             self.plan.expected_batch_size, self._noise, self.world.all_reduce_sum,
                             self.mechanism, engine_checks=self._checks)
        self.steps_done += 1
        self._taken += 1
        return stats.loss_sum

    def epsilon(self, accountant: str | None = None) -> float:
        """Epsilon of every step released so far (`steps_released`), at `delta`
        (`accountant`: "rdp" or "pld")."""
        return self.plan.epsilon(self.steps_released, accountant, releases=0)

    def state_dict(self) -> dict:
        """What a restarted worker continues from: the model (DP-LoRA's adapters included)
        and optimizer, the steps taken and released, and the plan they were accounted by."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "steps_done": self.steps_done, "steps_released": self.steps_released,
                "plan": plan_terms(self.plan)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (this loop's `state_dict()`, e.g. from a Ray Train
        checkpoint), before the first step: the step count goes on, the released steps stay
        counted, LSG's carriers follow the restored weights. The sampler draws afresh: the
        repeated steps' samples must be new for the accountant's composition to hold."""
        if self._taken:
            raise PrivateStepError("load_state_dict after step(): load the saved state right "
                                   "after building the PrivateStep, before its first step")
        check_saved(state, plan_terms(self.plan))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_done = self._granted = state["steps_done"]
        self._released_before = state["steps_released"]
        count_restored(self.account, Charged(state["steps_released"]))
        self.mechanism.refresh(self.steps_done, self._epoch(), force=True)

    def finish(self) -> None:
        """Give the reserved steps that were not taken back to the budget; detach the engine."""
        used_of_last = self.steps_done - (self._granted - self._last_chunk)
        self.account.settle(Charged(used_of_last))
        self.account.record.close()
        self.clipper.close()
        self._finished = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_) -> None:
        self.finish()

    def _epoch(self) -> int:
        """The epoch the next step is in (LSG's sparsity_start_epoch), from 1."""
        return 1 + self.steps_done * self.plan.expected_batch_size // self.plan.num_examples

    def _sampler(self) -> torch.Generator:
        """This rank's sampler: a seeded run's is a function of (seed, rank, step), so a
        restart draws what an uninterrupted run would; otherwise fresh from os.urandom."""
        if self.seed is None:
            return self._sampling
        return self._sampling.manual_seed(
            self.seed + 1 + self.rank + self.world.size * self.steps_done)

    def _reserve(self) -> None:
        """Rank 0 settles the used chunk and reserves the next; every rank obeys its answer
        and learns the steps earlier attempts released."""
        answer = self._charge_next() if self.rank == 0 else None
        refusal, stop, chunk, before = self.world.from_rank_0(answer)
        self._released_before, self._started = before, True
        if refusal is not None:
            raise BudgetExhausted(stop, f"{refusal} (after {self.steps_released} steps)")
        self._granted, self._last_chunk = self._granted + chunk, chunk

    def _charge_next(self) -> tuple:
        """(refusal, its stop reason, the chunk granted, the steps released before this
        process), decided on rank 0."""
        if not self._started:  # this process's first charge: what did earlier ones release?
            self.account.record.resumed_at(self.steps_done)
            self._released_before = max(self._released_before, self.account.total().steps)
        self.account.settle(Charged(self._last_chunk))
        planned = self.plan.steps - self.account.total().steps
        chunk = min(self.steps_per_charge, planned) if planned > 0 else self.steps_per_charge
        try:
            self.account.charge(Charged(chunk), first_step=self.steps_done)
        except ChargeRefused as error:
            return error.details, error.stop, 0, self._released_before
        return None, None, chunk, self._released_before
