"""When a run checks its clipping engine against one backward pass per example
(`privacy.self_check`, privacy/self_check.py): the first step a worker process takes, then a
random `step_fraction` of steps, chosen alike on every rank from a shared seed. Every rank
checks its own first micro-batch (or nothing, on an empty sample), at examples drawn at random
from it, and all ranks learn each other's verdict before the step's all-reduce: on any
mismatch every rank stops with the failing rank's message, so no noisy gradient of that step
leaves any worker. The check's full pass over the micro-batch is that micro-batch's share of
the step (no second pass)."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from torch import Tensor

from raydp_train.privacy.clipping import MicroBatchStats, PerExampleClipper
from raydp_train.privacy.layer_reduction import whole_sums
from raydp_train.privacy.self_check import SelfCheckError, compare_with_per_example
from raydp_train.privacy.user_clipping import rows_as_examples


class EngineChecks:
    def __init__(self, settings, shared_seed: int, gather: Callable[[object], list],
                 forward_dtype: torch.dtype | None = None):
        """`settings`: privacy.self_check; `gather`: every rank's value, on every rank."""
        self.settings, self.gather, self.forward_dtype = settings, gather, forward_dtype
        self._steps = random.Random(shared_seed)
        # Which rows are checked: a stream of its own, so the steps drawn stay alike on
        # every rank whatever each rank's batch holds.
        self._rows = random.Random(shared_seed ^ 0x5E1FC4EC)
        self._first = True
        # Checks run by this rank, and the time they added (the full pass is the release).
        self.count, self.seconds = 0, 0.0

    def due(self, clipper) -> bool:
        """Whether this step is checked; called once per step, alike on every rank."""
        if not self.settings.enabled or not isinstance(clipper, PerExampleClipper):
            return False
        draw = self._steps.random()  # drawn every step, so the ranks stay in step
        due, self._first = self._first or draw < self.settings.step_fraction, False
        return due

    def run(self, clipper: PerExampleClipper, compute_losses: Callable[..., Tensor],
            args: tuple | None, users: Tensor | None = None) -> MicroBatchStats | None:
        """Check the micro-batch `args` (None: this rank sampled nothing), then agree with
        the other ranks; raise SelfCheckError on any rank's mismatch. The micro-batch's
        clipped sum is then in the engine's buffer, as `accumulate` leaves it; its stats are
        returned. With `users` (privacy.unit user) the check is the rows' (the engine's
        per-row norms and the model's rows kept apart), and the users' clipped sum a pass
        of its own once every rank passed."""
        failure, stats = None, None
        if args is not None:
            with rows_as_examples(clipper), whole_sums(clipper):  # sharded: reduced after
                report = compare_with_per_example(clipper, compute_losses, args,
                                                  self.settings.examples, self.forward_dtype,
                                                  chooser=self._rows, keep_pass=users is None)
            added = report.seconds - report.release_seconds
            self.count, self.seconds = self.count + 1, self.seconds + added
            failure, stats = (None if report.passed else report.message()), report.stats
        failures = [message for message in self.gather(failure) if message]
        if failures:
            raise SelfCheckError(failures[0])
        if users is not None and args is not None:
            stats = clipper.accumulate(compute_losses, *args, users=users)
        return stats

