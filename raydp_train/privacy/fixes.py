"""What can be made private automatically (ARCHITECTURE.md §2.3), as Opacus's
`ModuleValidator.fix`: `model.fix: true` in a pipeline, `raydp_train.fix(model)` in Python.

    BatchNorm1d/2d/3d (C channels)      -> GroupNorm(g, C), g the most groups (at most 32) of
                                           at least 2 channels each, its affine scale and
                                           shift kept: each example normalized by itself
    InstanceNorm with running statistics -> the same InstanceNorm without them

Each change is one line naming the module. What cannot be changed without changing what the
model means (a batch-second layer, an Embedding's max_norm) is left, and the engine's refusal
names the fix by hand.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

MAX_GROUPS = 32  # as in Wu & He's GroupNorm and Opacus's fix


def fix(model: nn.Module) -> list[str]:
    """Replace, in place, every module of `model` that batch statistics would make
    non-private by one that normalizes each example by itself; one line per module changed.
    A model that is itself such a module is not replaced (its owner must): refused later."""
    changes = []
    for name, module in list(model.named_modules()):
        replacement = _replacement(module)
        if replacement is None or not name:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, replacement)
        changes.append(f"model.fix: module '{name}' ({type(module).__name__}) -> "
                       f"{_describe(replacement)}")
    return changes


def _replacement(module: nn.Module) -> nn.Module | None:
    if isinstance(module, _BatchNorm):
        return _group_norm(module)
    if isinstance(module, _InstanceNorm) and module.track_running_stats:
        return _carried_over(module, type(module)(
            module.num_features, module.eps, module.momentum, module.affine,
            track_running_stats=False))
    return None


def _group_norm(norm: _BatchNorm) -> nn.GroupNorm:
    channels = norm.num_features
    return _carried_over(norm, nn.GroupNorm(_groups(channels), channels, norm.eps,
                                            affine=norm.affine))


def _carried_over(old: nn.Module, new: nn.Module) -> nn.Module:
    """`new` with `old`'s affine scale and shift (trained or frozen as they were), on its
    device and in its dtype."""
    if old.affine:
        with torch.no_grad():
            new.weight.copy_(old.weight)
            new.bias.copy_(old.bias)
        new.requires_grad_(old.weight.requires_grad)
    return new.to(**_placement(old))


def _groups(channels: int) -> int:
    """The most groups, at most MAX_GROUPS, that divide the channels into groups of at least
    two: a group of one channel has nothing to normalize over at a 1 x 1 spatial size."""
    fitting = [g for g in range(1, MAX_GROUPS + 1) if channels % g == 0 and channels // g >= 2]
    return max(fitting, default=1)


def _placement(module: nn.Module) -> dict:
    """The device and floating dtype of the module replaced, for its replacement."""
    tensor = next((t for t in [*module.parameters(), *module.buffers()]
                   if t.is_floating_point()), None)
    if tensor is None:
        return {}
    return {"device": tensor.device, "dtype": tensor.dtype}


def _describe(module: nn.Module) -> str:
    if isinstance(module, nn.GroupNorm):
        return f"GroupNorm({module.num_groups}, {module.num_channels})"
    return f"{type(module).__name__} without running statistics"
