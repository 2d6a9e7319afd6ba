"""torch's global random state (CPU and every CUDA device), taken and put back: a pass run
again from the same state draws the same dropout masks and the same sampled noise."""

from __future__ import annotations

import torch


def random_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def restore_random_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
