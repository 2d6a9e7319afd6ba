"""nn.PReLU's rule (ARCHITECTURE.md §2.3): y = max(0, x) + w min(0, x), w one slope or one
per channel (axis 1 of the input), so

    grad w_i[c] = sum over the positions p of channel c of dL/dy_i[p] min(0, x_i[p])

materialized [B, channels] (few parameters): the vector clipped is the vector added.
"""

from __future__ import annotations

from torch import Tensor, nn

from raydp_train.privacy.rule_registry import LayerCalls, Rule, register_rule


@register_rule(nn.PReLU)
class PReLURule(Rule):
    """nn.PReLU: per-example slope gradients, summed over the calls."""

    def parameter_names(self, module: nn.Module) -> tuple[str, ...]:
        return ("weight",)

    def squared_norms(self, module, calls: LayerCalls, slots: dict, gram_cache: dict) -> Tensor:
        grads = 0
        for x, g in zip(calls.inputs, calls.output_grads):
            contribution = g * x.clamp(max=0)
            batch = contribution.shape[0]
            if module.num_parameters == 1:
                grads = grads + contribution.reshape(batch, -1).sum(1, keepdim=True)
            else:
                grads = grads + contribution.reshape(batch, module.num_parameters, -1).sum(2)
        calls.state["grads"] = grads
        return grads.square().sum(1)

    def add_clipped_sum(self, module, calls: LayerCalls, clip_factors: Tensor, slots) -> None:
        slots["weight"].add_(clip_factors @ calls.state["grads"])

    def per_example_gradient(self, module, calls: LayerCalls, slot: str) -> Tensor | None:
        return calls.state["grads"]
