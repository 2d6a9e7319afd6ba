"""The ranks of a user's own loop (ARCHITECTURE.md §2.11): the process group Ray Train set up
(torch.distributed), or one process alone, and the collectives a `PrivateStep` makes in it.
Every rank makes the same calls in the same order."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class LoopWorld:
    """This process's rank and the world size; collectives are no-ops for a world of one."""

    def __init__(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.rank, self.size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        else:
            self.rank, self.size = 0, 1

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank."""
        if self.size > 1:
            for tensor in [*model.parameters(), *model.buffers()]:
                torch.distributed.broadcast(tensor.data, src=0)

    def all_reduce_sum(self, tensor: Tensor) -> None:
        if self.size > 1:
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)

    def gather(self, value) -> list:
        """Every rank's `value`, in rank order."""
        if self.size == 1:
            return [value]
        values = [None] * self.size
        torch.distributed.all_gather_object(values, value)
        return values

    def from_rank_0(self, value):
        """Rank 0's `value` on every rank."""
        if self.size == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
