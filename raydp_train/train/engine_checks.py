"""When a run checks its clipping engine against one backward pass per example
(`privacy.self_check`, privacy/self_check.py): the first step a worker process takes, then a
random `step_fraction` of steps, chosen alike on every rank from a shared seed. Every rank
checks its own first micro-batch (or nothing, on an empty sample) and all ranks learn each
other's verdict before the step's all-reduce: on any mismatch every rank stops with the
failing rank's message, so no noisy gradient of that step leaves any worker."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from torch import Tensor

from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.self_check import SelfCheckError, compare_with_per_example


class EngineChecks:
    def __init__(self, settings, shared_seed: int, gather: Callable[[object], list],
                 forward_dtype: torch.dtype | None = None):
        """`settings`: privacy.self_check; `gather`: every rank's value, on every rank."""
        self.settings, self.gather, self.forward_dtype = settings, gather, forward_dtype
        self._steps = random.Random(shared_seed)
        self._first = True
        self.count, self.seconds = 0, 0.0  # checks run by this rank, and their time

    def due(self, clipper) -> bool:
        """Whether this step is checked; called once per step, alike on every rank."""
        if not self.settings.enabled or not isinstance(clipper, PerExampleClipper):
            return False
        draw = self._steps.random()  # drawn every step, so the ranks stay in step
        due, self._first = self._first or draw < self.settings.step_fraction, False
        return due

    def run(self, clipper: PerExampleClipper, compute_losses: Callable[..., Tensor],
            args: tuple | None) -> None:
        """Check `args`' first examples (None: this rank sampled nothing), then agree with
        the other ranks; raise SelfCheckError on any rank's mismatch."""
        failure = None
        if args is not None:
            report = compare_with_per_example(clipper, compute_losses, args,
                                              self.settings.examples, self.forward_dtype)
            self.count, self.seconds = self.count + 1, self.seconds + report.seconds
            failure = None if report.passed else report.message()
        failures = [message for message in self.gather(failure) if message]
        if failures:
            raise SelfCheckError(failures[0])
