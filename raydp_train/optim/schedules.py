"""Learning-rate schedules: a multiplier of every group's initial rate at each logical step,
rising linearly from 0 over the warmup steps, then constant, linear to 0 or a half cosine to
0 at the run's last step.

These are Hugging Face's `get_scheduler` schedules of the same names (tests/test_optim.py
holds them to it, step for step), written here so that no worker imports transformers or
torch's LRScheduler, which asks for torch's own optimizers (see updates.py).
"""

from __future__ import annotations

import math
from functools import partial


def _constant(step: int, warmup: int, total: int) -> float:
    return 1.0


def _linear(step: int, warmup: int, total: int) -> float:
    return max(0.0, float(total - step) / float(max(1, total - warmup)))


def _cosine(step: int, warmup: int, total: int) -> float:
    progress = float(step - warmup) / float(max(1, total - warmup))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


AFTER_WARMUP = {"constant": _constant, "linear": _linear, "cosine": _cosine}


def multiplier(name: str, warmup: int, total: int, step: int) -> float:
    """The schedule's factor of the initial learning rate after `step` of `total` steps."""
    if step < warmup:
        return float(step) / float(max(1, warmup))
    return AFTER_WARMUP[name](step, warmup, total)


class Schedule:
    """Sets each group's lr to its initial_lr times the multiplier of the current step: step
    0 on construction, then one step per `step()` (torch's LambdaLR protocol and state)."""

    def __init__(self, optimizer, name: str, warmup: int, total: int):
        self.optimizer = optimizer
        self.factor = partial(multiplier, name, warmup, total)
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = -1  # torch's name for the number of steps taken
        self.step()

    def step(self) -> None:
        self.last_epoch += 1
        factor = self.factor(self.last_epoch)
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"base_lrs": list(self.base_lrs), "last_epoch": self.last_epoch,
                "_step_count": self.last_epoch + 1, "_last_lr": self.get_last_lr(),
                "lr_lambdas": [None] * len(self.base_lrs)}

    def load_state_dict(self, saved: dict) -> None:
        """Restore this schedule's state or a torch LambdaLR's; the groups' current rates
        come back with the optimizer's state, as in torch."""
        self.base_lrs, self.last_epoch = list(saved["base_lrs"]), saved["last_epoch"]
