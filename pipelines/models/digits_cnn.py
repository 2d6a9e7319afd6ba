"""A model of your own for `model.kind: torch` (pipelines/digits_custom_model.yaml): a small
CNN with GroupNorm (BatchNorm mixes examples, so DP-SGD cannot clip it per example), and its
per-example loss."""

import torch
from torch import nn


def small_cnn(channels: int = 8, groups: int = 2, num_classes: int = 10) -> nn.Module:
    """[B, 1, 8, 8] digits -> [B, num_classes] logits (num_classes given by raydp_train)."""
    return nn.Sequential(
        nn.Conv2d(1, channels, kernel_size=3, padding=1),
        nn.GroupNorm(groups, channels),
        nn.ReLU(),
        nn.Conv2d(channels, channels, kernel_size=3, padding=1, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(channels * 4 * 4, num_classes),
    )


def smoothed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`model.loss`: one loss per example (reduction "none": each example is clipped on its
    own), here cross-entropy with label smoothing 0.1."""
    return nn.functional.cross_entropy(logits, labels, reduction="none", label_smoothing=0.1)
