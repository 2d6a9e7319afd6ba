"""Private adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021, "Differentially
Private Learning with Adaptive Clipping"): the clip norm C follows a target quantile gamma of
the per-example gradient norms, through a noisy count released at every step.

At step t, with clip norm C_t, over the sampled examples S (every worker's):

    b_i        = 1[ ||g_i|| <= C_t ]
    count      = sum_{i in S} (b_i - 1/2) + N(0, sigma_b^2)       sensitivity 1/2
    b~         = count / (q N) + 1/2                              noisy fraction unclipped
    C_{t+1}    = C_t exp(-eta (b~ - gamma))                       geometric update
    gradient   = sum_{i in S} clip(g_i, C_t) + N(0, (z_grad C_t)^2 I)

The gradient sum (sensitivity C_t) and the count (sensitivity 1/2) are released together: one
Gaussian mechanism on their concatenation, scaled to unit noise, whose sensitivity is
sqrt(z_grad^-2 + (2 sigma_b)^-2). So the step costs exactly a Gaussian of multiplier

    z = (z_grad^-2 + (2 sigma_b)^-2)^-1/2      (Andrew et al., Theorem 1)

and is accounted as DP-SGD's step with noise multiplier z: the gradient's own multiplier is
raised to z_grad = (z^-2 - (2 sigma_b)^-2)^-1/2 to pay for the count (2 sigma_b > z needed).
C_{t+1} is computed from released values only: post-processing, free. As the gradient's, the
count's noise is drawn once per step (rank 0), and the count is all-reduced with the sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the engine, not with the plan that checks sigma_b
    from torch import Tensor

COUNT_NOISE_PER_EXAMPLE = 1 / 20  # default sigma_b: the expected batch size / 20 (the paper's)


def count_noise_std(count_noise: float | None, expected_batch_size: float) -> float:
    """sigma_b: as set, else expected_batch_size / 20."""
    return count_noise if count_noise is not None else expected_batch_size * COUNT_NOISE_PER_EXAMPLE


def gradient_noise_multiplier(noise_multiplier: float, count_noise: float) -> float:
    """z_grad = (z^-2 - (2 sigma_b)^-2)^-1/2: the gradient's share of the step's multiplier z."""
    rest = noise_multiplier ** -2 - (2 * count_noise) ** -2
    if not rest > 0:
        raise ValueError(count_noise_problem(noise_multiplier, count_noise, 0))
    return rest ** -0.5


def effective_noise_multiplier(gradient_multiplier: float, count_noise: float) -> float:
    """z = (z_grad^-2 + (2 sigma_b)^-2)^-1/2: what the gradient and the count cost together."""
    return (gradient_multiplier ** -2 + (2 * count_noise) ** -2) ** -0.5


def count_noise_problem(noise_multiplier: float, count_noise: float | None,
                        expected_batch_size: float) -> str:
    """Why sigma_b (as set, else the default) cannot pay for the count at multiplier z; ""
    if it can."""
    sigma_b = count_noise_std(count_noise, expected_batch_size)
    if 2 * sigma_b > noise_multiplier:
        return ""
    return (f"count_noise: the count's noise std ({sigma_b:g}) must exceed half the noise "
            f"multiplier ({noise_multiplier:g} / 2): the count alone would cost more than the "
            f"whole step; raise it above {noise_multiplier / 2:g} (default: the expected batch "
            "size / 20) or raise the noise multiplier")


class QuantileClipping:
    """The step's noisy count of examples with norm <= C_t, and C_{t+1} from it (module doc).
    C_t itself is the engine's `clip_norm`, saved with a run's checkpoints."""

    def __init__(self, clip_norm: float, target_quantile: float = 0.5,
                 learning_rate: float = 0.2, count_noise: float | None = None):
        self.initial_clip_norm = float(clip_norm)  # C_0: sigma's unit, as for fixed clipping
        self.target_quantile, self.learning_rate = target_quantile, learning_rate
        self.count_noise = count_noise  # sigma_b; None: expected batch size / 20
        self.count: Tensor | None = None  # this step's: noise (rank 0) + local sum of b_i - 1/2
        self.count_std = 0.0  # this step's sigma_b (rank 0; 0 elsewhere)

    def start_step(self, noise_std: float, expected_batch_size: float, like: Tensor,
                   clip_norm: float) -> float:
        """Begin a step at C_t = `clip_norm`. `noise_std` is z C_0 on rank 0 and 0 elsewhere,
        as for fixed clipping;
        returns the gradient's noise std, z_grad C_t (rank 0), and sets `count_std`, the
        count's (sigma_b on rank 0), for the caller to draw from the same generator."""
        self.count = like.new_zeros(1)
        if noise_std == 0:
            self.count_std = 0.0
            return 0.0
        self.count_std = count_noise_std(self.count_noise, expected_batch_size)
        noise_multiplier = noise_std / self.initial_clip_norm
        return gradient_noise_multiplier(noise_multiplier, self.count_std) * clip_norm

    def add_count(self, norms: Tensor, clip_norm: float) -> None:
        """Add sum_i (1[||g_i|| <= C_t] - 1/2) of a micro-batch's per-example norms."""
        under = (norms.double() <= clip_norm).double() - 0.5
        self.count += under.sum().to(self.count.dtype)

    def reduce_with(self, all_reduce_sum: Callable[[Tensor], None]) -> Callable[[Tensor], None]:
        """`all_reduce_sum` that sums this step's count in the same collective as the tensor
        it is given (once per step): one collective, the count's one noise draw summed in."""
        import torch

        def joined(tensor: Tensor) -> None:
            both = torch.cat([tensor.reshape(-1), self.count.to(tensor.dtype)])
            all_reduce_sum(both)
            tensor.copy_(both[:-1].view_as(tensor))
            self.count.copy_(both[-1:])
        return joined

    def next_clip_norm(self, clip_norm: float, expected_batch_size: float) -> float:
        """C_{t+1} = C_t exp(-eta (b~ - gamma)), b~ = count / (q N) + 1/2."""
        unclipped = float(self.count) / expected_batch_size + 0.5
        return clip_norm * math.exp(-self.learning_rate * (unclipped - self.target_quantile))
