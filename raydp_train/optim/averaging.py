"""An exponential moving average of the trained weights (`training.ema_decay`): each epoch's
evaluation and the returned model use it, the steps train the weights as without it.

It only post-processes the weights the released noisy steps produced, so it costs no privacy.
Under DP each step leaves its own noise in the weights; the average keeps the direction the
steps share and averages part of that noise away (De et al. 2022 average this way).

The average is bias-corrected as Adam's moments are: after t steps it is
sum_i (1 - d) d^(t - i) w_i / (1 - d^t) over the weights w_1..w_t after each step, so the
starting weights never count and the first epochs are read from trained weights alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch


class WeightAverage:
    """The average of `params` (the optimizer's), updated once per logical step."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float):
        self.params, self.decay = params, decay
        self.average = [p.detach().clone() for p in params]

    def update(self, steps_taken: int) -> None:
        """Fold in the weights after step number `steps_taken` (1 for the first step)."""
        weight = (1.0 - self.decay) / (1.0 - self.decay ** steps_taken)
        with torch.no_grad():
            for average, param in zip(self.average, self.params, strict=True):
                average.lerp_(param.detach(), weight)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The parameters hold the average inside the block, their own weights again after."""
        own = [p.detach().clone() for p in self.params]
        self.copy_into_parameters()
        try:
            yield
        finally:
            _copy(own, self.params)

    def copy_into_parameters(self) -> None:
        """The parameters take the average for good (the run's returned model)."""
        _copy(self.average, self.params)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "average": [a.clone() for a in self.average]}

    def load_state_dict(self, state: dict) -> None:
        shapes = [tuple(a.shape) for a in state["average"]]
        if shapes != [tuple(p.shape) for p in self.params]:
            raise ValueError("the checkpoint's weight average is of other parameters than this "
                             "run trains")
        self.average = [a.to(p.device, p.dtype).clone()
                        for a, p in zip(state["average"], self.params, strict=True)]


def _copy(tensors: list[torch.Tensor], params: list[torch.nn.Parameter]) -> None:
    with torch.no_grad():
        for param, tensor in zip(params, tensors, strict=True):
            param.copy_(tensor)


def make_average(optimizer, decay: float | None) -> WeightAverage | None:
    """The average of every parameter `optimizer` trains, or None without a decay."""
    if decay is None:
        return None
    return WeightAverage([p for group in optimizer.param_groups for p in group["params"]], decay)


def averaged(average: WeightAverage | None):
    """The block runs on the averaged weights, or on the weights as they are without one."""
    return nullcontext() if average is None else average.applied()
