"""Poisson sampling of logical batches and their split into physical micro-batches
(ARCHITECTURE.md §2.1).

Each example joins a logical batch independently with probability ``q = B / N``; the batch size
is random (possibly zero) and only its expectation ``B`` is fixed. Micro-batching only bounds
memory: it changes nothing in the privacy analysis. The plan's arithmetic needs no torch (a
pipeline's plan is checked without it), so the samplers import it when they run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def sampling_rate(expected_batch_size: int, num_examples: int) -> float:
    """``q = B / N``: the probability that any one example joins a logical batch."""
    if num_examples <= 0:
        raise ValueError(f"the dataset must hold at least one example, got {num_examples}")
    if not 0 < expected_batch_size <= num_examples:
        raise ValueError(
            f"training.batch_size (the expected logical batch size) must be in [1, {num_examples}]"
            f" (the number of training examples), got {expected_batch_size}"
        )
    return expected_batch_size / num_examples


def total_steps(epochs: int, expected_batch_size: int, num_examples: int) -> int:
    """``floor(epochs / q) = floor(epochs * N / B)``, in exact integer arithmetic.

    Float division can land just below an integer (e.g. ``epochs / (B / N)``) and lose a step.
    """
    sampling_rate(expected_batch_size, num_examples)  # validates B and N
    if epochs < 0:
        raise ValueError(f"training.epochs must be >= 0, got {epochs}")
    return epochs * num_examples // expected_batch_size


def poisson_sample(
    num_examples: int, sampling_rate: float, generator: torch.Generator
) -> torch.Tensor:
    """Sorted int64 indices of the examples included, each independently with probability q.

    May be empty; the caller still takes the step (zero clipped sum plus noise).
    """
    import torch

    # float64: float32 uniforms lie on a 2^-24 grid, which rounds a small q up (q = 1e-7
    # became 1.19e-7), more often than the accountant was told.
    included = torch.rand(num_examples, generator=generator, dtype=torch.float64) < sampling_rate
    return torch.nonzero(included, as_tuple=True)[0].to(torch.int64)


def micro_batches(indices: torch.Tensor, max_physical_batch: int) -> list[torch.Tensor]:
    """Consecutive chunks of ``indices`` of at most ``max_physical_batch``; ``[]`` if empty."""
    if max_physical_batch <= 0:
        raise ValueError(f"max_physical_batch must be >= 1, got {max_physical_batch}")
    if indices.numel() == 0:
        return []  # torch.split would give one empty chunk
    return list(indices.split(max_physical_batch))
