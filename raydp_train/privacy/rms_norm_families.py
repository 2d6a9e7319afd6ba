"""The RMSNorm classes of transformers' decoder families (LlamaRMSNorm, Qwen2RMSNorm,
MistralRMSNorm, ...), recognized by what they compute (ARCHITECTURE.md §2.3).

A module qualifies if it has no children, one parameter `weight` of shape [d] and a float
epsilon (`eps` or `variance_epsilon`), AND its own forward, run on random inputs with a random
weight, returns

    weight * x / sqrt(mean(x^2 over the last axis) + eps)

Llama computes this in float32 and casts back; the tolerance allows that rounding. Anything
else (Gemma's (1 + weight), an epsilon outside the root, ...) is refused. Each instance is
checked on its own: an instance may carry attributes (a gain) or a forward of its own.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from raydp_train.privacy.norm_rules import RMSNormRule
from raydp_train.privacy.rule_registry import Rule, register_matcher

_EPSILON_NAMES = ("eps", "variance_epsilon")


class RMSNormFamilyRule(RMSNormRule):
    """An RMSNorm over the last axis, its shape and epsilon read by structure."""

    def normalized_shape(self, module: nn.Module) -> tuple[int, ...]:
        return tuple(module.weight.shape)

    def eps(self, module: nn.Module) -> float:
        return epsilon(module)


_RULE = RMSNormFamilyRule()


@register_matcher("RMSNorm classes by what they compute "
                  "(weight * x / sqrt(mean(x^2) + eps), checked against their forward)")
def match_rms_norm(module: nn.Module) -> Rule | None:
    if not _has_rms_norm_structure(module):
        return None
    return _RULE if _computes_rms_norm(module) else None


def epsilon(module: nn.Module) -> float | None:
    """The module's float `eps` or `variance_epsilon`, if it has one."""
    for name in _EPSILON_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _has_rms_norm_structure(module: nn.Module) -> bool:
    parameters = dict(module.named_parameters(recurse=False))
    return (
        next(module.children(), None) is None
        and list(parameters) == ["weight"]
        and parameters["weight"].dim() == 1
        and epsilon(module) is not None
    )


def _computes_rms_norm(module: nn.Module) -> bool:
    """Run a float64 copy of the module, with a random weight, on inputs whose mean square is
    near epsilon (where its place in the formula shows), around 1 and large."""
    probe = copy.deepcopy(module).to(device="cpu", dtype=torch.float64)
    eps, hidden = epsilon(probe), probe.weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # A new weight, not a copy into the old: a sharded (FSDP) weight takes no plain copy.
        probe.weight = nn.Parameter(torch.randn(hidden, generator=generator, dtype=torch.float64))
        for scale in (max(eps, 1e-12) ** 0.5, 1.0, 1e3):
            x = scale * torch.randn(2, 3, hidden, generator=generator, dtype=torch.float64)
            expected = probe.weight * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
            try:
                got = probe(x)
            except (RuntimeError, TypeError, ValueError):  # cannot take one [B, T, d] tensor
                return False
            if not _close(got, expected):
                return False
    return True


def _close(got, expected: Tensor) -> bool:
    """Equal up to float32 rounding of the computation (Llama's upcast)."""
    return (
        isinstance(got, Tensor) and got.shape == expected.shape
        and bool(torch.allclose(got.double(), expected, rtol=1e-5,
                                atol=1e-5 * expected.abs().max().item()))
    )
