"""The Gaussian noise of DP-SGD (DESIGN §2.1-2.2): one draw of ``N(0, (sigma * C)^2 I)`` per step.

The generator is seeded from ``os.urandom`` ("secure") unless an explicit seed is given
("seeded": reproducible, for tests only, never for a release); the run record says which.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

NoiseMode = Literal["secure", "seeded"]


def make_generator(
    seed: int | None, device: str | torch.device = "cpu"
) -> tuple[torch.Generator, NoiseMode]:
    """A ``torch.Generator`` on ``device`` and its mode: ``"secure"`` if ``seed`` is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.manual_seed(int.from_bytes(os.urandom(8), "little"))
        return generator, "secure"
    generator.manual_seed(seed)
    return generator, "seeded"


def noise_std(noise_multiplier: float, clip_norm: float) -> float:
    """``sigma * C``: the std of the noise added to the sum of clipped gradients."""
    return noise_multiplier * clip_norm


def fill_gaussian_noise_(tensor: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """``tensor <- N(0, std^2 I)`` in place, one draw over the whole tensor; ``std == 0``: zeros.

    A step starts its gradient sum from the noise and adds the clipped gradients onto it:
    the same sum as adding the noise afterwards, without a second buffer or pass.
    """
    if not std >= 0.0:
        raise ValueError(f"noise std must be >= 0, got {std}")
    if std == 0.0:
        tensor.zero_()
    else:
        tensor.normal_(mean=0.0, std=std, generator=generator)
