"""Bounds on the rounding error of squared norms computed in Gram form (ARCHITECTURE.md §2.3).

A Gram-form squared norm is a sum of products of inner products,

    ||G^T a||^2 = sum_{t,s} (a_t . a_s)(g_t . g_s),

whose terms may be far larger than the result: tokens whose gradients cancel leave a true norm
of 34 C that float32 computes as 0, and the example would be added unclipped. The clip factor
must therefore come from a value never below the true squared norm. Each inner product of
length k computed in floating point (any summation order, FMA or not) is off by at most
gamma_k sum_p |x_p y_p| <= gamma_k ||x|| ||y||, gamma_k = k u / (1 - k u), u the unit
roundoff (Higham, "Accuracy and Stability of Numerical Algorithms", §3.1). With
A^ = fl(a_t . b_s) and G^ = fl(g_t . h_s) (m and n long), the products summed in float64:

    |fl(sum A^ G^) - sum A G| <= gamma_m sum |G^_ts| ||a_t|| ||b_s||
                               + gamma_n sum |A^_ts| ||g_t|| ||h_s||
                               + gamma_m gamma_n (sum ||a_t|| ||g_t||)(sum ||b_s|| ||h_s||)
                               + gamma_{TS} (float64) sum |A^ G^|

computed from the Gram matrices the norm already formed (O(B T S), no extra matmul), and
inflated by 1% for the rounding of the token norms themselves. Float32 matmuls run at full
precision while the engine computes them (`full_precision_matmuls`: no TF32 or bf16 passes).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

# Covers the rounding of the token norms and of the bound's own arithmetic (relative ~1e-3).
_SLACK = 1.01


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: half the spacing of the dtype's numbers at 1 (float32 2^-24, float64 2^-53)."""
    return torch.finfo(dtype).eps / 2


def gamma(length: int, dtype: torch.dtype) -> float:
    """gamma_k = k u / (1 - k u): the relative error bound of a length-k inner product."""
    ku = length * unit_roundoff(dtype)
    return ku / (1 - ku) if ku < 1 else float("inf")


def gram_product(inputs: Tensor, grads: Tensor, input_norms: tuple[Tensor, Tensor],
                 grad_norms: tuple[Tensor, Tensor], input_features: int,
                 grad_features: int) -> tuple[Tensor, Tensor]:
    """sum_{t,s} inputs[t,s] grads[t,s] per example, in float64, and its rounding bound.

    `inputs` [B, T, S] = fl(a_t . b_s) (features `input_features` long), `grads` [B, T, S] =
    fl(g_t . h_s); `input_norms` (||a_t|| [B, T], ||b_s|| [B, S]), `grad_norms` likewise. Both
    results are float64 [B]."""
    dtype = inputs.dtype
    gram_a, gram_g = inputs.double(), grads.double()
    products = gram_a * gram_g
    value = products.sum((1, 2))
    na, nb = (n.double() for n in input_norms)
    ng, nh = (n.double() for n in grad_norms)
    gamma_m, gamma_n = gamma(input_features, dtype), gamma(grad_features, dtype)
    bound = (
        gamma_m * _quadratic(na, gram_g.abs(), nb)
        + gamma_n * _quadratic(ng, gram_a.abs(), nh)
        + gamma_m * gamma_n * (na * ng).sum(1) * (nb * nh).sum(1)
        + gamma(products[0].numel(), torch.float64) * products.abs().sum((1, 2))
    )
    return value, _SLACK * bound


def gathered_product(picked: Tensor, inputs: Tensor, input_norms: tuple[Tensor, Tensor], features: int) -> tuple[Tensor, Tensor]:
    """sum_{t,s} picked[t,s] inputs[t,s] per example, in float64, and its rounding bound:
    `picked` [B, T, S] exact (entries gathered from a recorded tensor, or a 0/1 mask),
    `inputs` [B, T, S] = fl(a_t . b_s) (`features` long, token norms `input_norms`)."""
    dtype = inputs.dtype
    picked, gram = picked.double(), inputs.double()
    products = picked * gram
    na, nb = (n.double() for n in input_norms)
    bound = (
        gamma(features, dtype) * _quadratic(na, picked.abs(), nb)
        + gamma(products[0].numel(), torch.float64) * products.abs().sum((1, 2))
    )
    return products.sum((1, 2)), _SLACK * bound


def inner_product(first: Tensor, second: Tensor) -> tuple[Tensor, Tensor]:
    """<first_i, second_i> per example ([B, ...] each), in float64, and its rounding bound."""
    first = first.reshape(first.shape[0], -1).double()
    second = second.reshape(second.shape[0], -1).double()
    products = first * second
    bound = gamma(first.shape[1], torch.float64) * products.abs().sum(1)
    return products.sum(1), _SLACK * bound


def _quadratic(left: Tensor, matrix: Tensor, right: Tensor) -> Tensor:
    """left_i^T matrix_i right_i per example: [B, T], [B, T, S], [B, S] -> [B]."""
    return torch.bmm(left.unsqueeze(1), torch.bmm(matrix, right.unsqueeze(2))).reshape(-1)


@contextmanager
def full_precision_matmuls() -> Iterator[None]:
    """Float32 matmuls in full float32 (no TF32 or bf16 passes) inside the block: the bounds
    above assume float32's unit roundoff."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
