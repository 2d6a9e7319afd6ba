"""The non-private reference (`privacy.mechanism: none`): plain summed gradients.

Same interface as PerExampleClipper (a flat gradient buffer bound as every `.grad`), so the
same step, Poisson sampling, micro-batching, all-reduce and normalization by q*N apply and
the only difference from DP-SGD is what privacy takes away: clipping and noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from raydp_train.privacy.clipping import MicroBatchStats


class SummedGradients:
    def __init__(self, model: nn.Module):
        self.parameters = [p for p in model.parameters() if p.requires_grad]
        if not self.parameters:
            raise ValueError("the model has no trainable parameters")
        first = self.parameters[0]
        self.flat_grad = torch.zeros(sum(p.numel() for p in self.parameters),
                                     dtype=first.dtype, device=first.device)
        self._views, offset = [], 0
        for p in self.parameters:
            self._views.append(self.flat_grad[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def accumulate(self, compute_losses: Callable[..., Tensor], *args) -> MicroBatchStats:
        self.bind_grads()
        losses = compute_losses(*args)
        losses.sum().backward()
        return MicroBatchStats(losses.detach(), torch.full_like(losses.detach(), math.nan))

    def bind_grads(self) -> Tensor:
        for p, view in zip(self.parameters, self._views, strict=True):
            if p.grad is not view:
                p.grad = view
        return self.flat_grad

    @property
    def num_parameters(self) -> int:
        return self.flat_grad.numel()

    def close(self) -> None:
        pass
