"""The normalization layers' rules (ARCHITECTURE.md §2.3): LayerNorm, RMSNorm and GroupNorm
have few parameters, so their per-example gradients are formed outright ([B, *param.shape])
and clipped from there. Each rule registers itself for its layers when this is imported."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raydp_train.privacy.layer_rules import drop_padding
from raydp_train.privacy.rule_registry import LayerCalls, Rule, register_rule


class MaterializedRule(Rule):
    """Layers with few parameters: form the per-example gradients [B, *param.shape]."""

    def per_example_grads(self, module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    def squared_norms(self, module, calls: LayerCalls, slots: dict, gram_cache: dict) -> Tensor:
        totals: dict[str, Tensor] = {}
        for x, g in zip(calls.inputs, calls.output_grads):
            for name, grad in self.per_example_grads(module, x, g).items():
                totals[name] = totals[name] + grad if name in totals else grad
        totals = {n: grad for n, grad in totals.items() if n in slots}
        calls.state["per_example"] = totals
        batch = calls.inputs[0].shape[0]
        norms = calls.inputs[0].new_zeros(batch)
        for grad in totals.values():
            norms = norms + grad.reshape(batch, -1).square().sum(1)
        return norms

    def add_clipped_sum(self, module, calls: LayerCalls, clip_factors: Tensor, slots) -> None:
        for name, grad in calls.state["per_example"].items():
            slots[name].add_(torch.tensordot(clip_factors, grad, dims=1))

    def per_example_gradient(self, module, calls: LayerCalls, slot: str) -> Tensor | None:
        return calls.state["per_example"].get(slot)


def _sum_to_parameter(values: Tensor, param_dims: int) -> Tensor:
    """Sum [B, *middle, *param_shape] down to [B, *param_shape]."""
    middle = tuple(range(1, values.dim() - param_dims))
    return values.sum(middle) if middle else values


def _drop_padded_tokens(x: Tensor, g: Tensor, normalized_dims: int) -> tuple[Tensor, Tensor]:
    """A norm over the last axis of [B, T, d] tokens: cut the trailing gradient-free ones."""
    if x.dim() != 3 or normalized_dims != 1:
        return x, g
    x, g, _ = drop_padding(x, g)
    return x, g


class NormRule(MaterializedRule):
    """gamma_i = sum_t G_i[t] * normalized(x_i[t]) (beta_i = sum_t G_i[t] when there is a
    bias), summed over the non-normalized axes; padding tokens cut first."""

    folds_examples = True

    def per_example_grads(self, module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
        shape = self.normalized_shape(module)
        x, g = _drop_padded_tokens(x, g, len(shape))
        grads = {"weight": _sum_to_parameter(g * self.normalized(module, x, shape), len(shape))}
        if getattr(module, "bias", None) is not None:
            grads["bias"] = _sum_to_parameter(g, len(shape))
        return grads

    def normalized(self, module: nn.Module, x: Tensor, shape: tuple[int, ...]) -> Tensor:
        raise NotImplementedError

    def normalized_shape(self, module: nn.Module) -> tuple[int, ...]:
        return tuple(module.normalized_shape)

    def eps(self, module: nn.Module) -> float | None:
        return module.eps


@register_rule(nn.LayerNorm)
class LayerNormRule(NormRule):
    """xhat = (x - mean) / sqrt(var + eps)."""

    def normalized(self, module: nn.Module, x: Tensor, shape: tuple[int, ...]) -> Tensor:
        return F.layer_norm(x, shape, eps=self.eps(module))


@register_rule(nn.RMSNorm)
class RMSNormRule(NormRule):
    """x / rms(x), rms(x) = sqrt(mean(x^2) + eps)."""

    def normalized(self, module: nn.Module, x: Tensor, shape: tuple[int, ...]) -> Tensor:
        return F.rms_norm(x, shape, eps=self.eps(module))


@register_rule(nn.GroupNorm)
class GroupNormRule(MaterializedRule):
    """gamma_i[c] = sum over positions of G_i[c] * xhat_i[c]; beta_i[c] = sum of G_i[c]."""

    def per_example_grads(self, module, x: Tensor, g: Tensor) -> dict[str, Tensor]:
        normalized = F.group_norm(x, module.num_groups, eps=module.eps)
        spatial = tuple(range(2, x.dim()))
        weighted = g * normalized
        return {
            "weight": weighted.sum(spatial) if spatial else weighted,
            "bias": g.sum(spatial) if spatial else g,
        }
