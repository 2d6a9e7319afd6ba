"""nn.LSTM's rule (ARCHITECTURE.md §2.3): each layer's two weights as Linear calls.

Layer l computes, for t = 1..T, the gates z_t = x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh
(i, f, g, o), c_t = sigma(f) c_{t-1} + sigma(i) tanh(g), h_t = sigma(o) tanh(c_t). With
G_t = dL/dz_t, the gradients of example n are

    grad W_ih = sum_t G_t^T x_t     grad W_hh = sum_t G_t^T h_{t-1}     grad b_ih = grad b_hh = sum_t G_t

two Linear calls over the T steps (inputs x and h shifted by one step, output gradient G),
ghost or materialized as the Linear rule chooses. The hooks keep the call's arguments and the
gradients of its outputs (the sequence, h_n, c_n); the rule recomputes the recurrence for the
batch with a zero leaf added to every layer's input projection, whose gradient is G, by one
backward of the recurrence. Served: batch_first, one direction, no proj_size, no dropout
between layers; other LSTMs take the per-example path.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from raydp_train.privacy.layer_rules import (
    add_linear_clipped_sum,
    cat_tokens,
    linear_blocks_norms,
)
from raydp_train.privacy.rule_registry import (
    LayerCalls,
    Rule,
    changed_behaviour,
    register_matcher,
)


class LstmRule(Rule):
    """nn.LSTM (batch_first, one direction, no projection), any number of layers."""

    records_call = True  # the initial state and every output's gradient

    def parameter_names(self, module: nn.Module) -> tuple[str, ...]:
        return tuple(name for name, _ in module.named_parameters())

    def squared_norms(self, module, calls: LayerCalls, slots: dict, gram_cache: dict) -> Tensor:
        per_call = [_layer_blocks(module, args, kwargs, grads)
                    for (args, kwargs), grads in zip(calls.arguments, calls.output_grads)]
        weights, biases = [], {}
        for layer in range(module.num_layers):
            inputs, previous, gates = (cat_tokens([call[layer][k] for call in per_call])
                                       for k in range(3))
            weights += [(f"weight_ih_l{layer}", inputs, gates),
                        (f"weight_hh_l{layer}", previous, gates)]
            for name in (f"bias_ih_l{layer}", f"bias_hh_l{layer}"):
                biases[name] = gates.sum(1)
        weights = [block for block in weights if block[0] in slots]
        biases = {name: grads for name, grads in biases.items() if name in slots}
        norms, materialized = linear_blocks_norms([(a, g) for _, a, g in weights], calls,
                                                  gram_cache)
        for grads in biases.values():
            norms = norms + grads.square().sum(1)
        calls.state.update(weights=weights, biases=biases, materialized=materialized)
        return norms

    def add_clipped_sum(self, module, calls: LayerCalls, clip_factors: Tensor, slots) -> None:
        for (name, a, g), per_example in zip(calls.state["weights"],
                                             calls.state["materialized"]):
            add_linear_clipped_sum(slots[name], a, g, clip_factors, per_example)
        for name, grads in calls.state["biases"].items():
            slots[name].add_(clip_factors @ grads)


LSTM_RULE = LstmRule()


@register_matcher("nn.LSTM batch_first, one direction, no proj_size")
def _lstm(module: nn.Module) -> Rule | None:
    """Dropout between layers would be drawn again by the recomputation: the per-example
    path (which refuses it in training) takes such an LSTM."""
    if (isinstance(module, nn.LSTM) and module.batch_first and not module.bidirectional
            and module.proj_size == 0 and (module.dropout == 0 or module.num_layers == 1)
            and changed_behaviour(module, nn.LSTM) is None):
        return LSTM_RULE
    return None


def _layer_blocks(module, args: tuple, kwargs: dict, output_grads: list) -> list:
    """Per layer: (its input [B, T, m], h_{t-1} [B, T, H], G [B, T, 4H]) of one call."""
    named = dict(zip(("input", "hx"), args), **kwargs)
    x, state = named["input"], named.get("hx")
    dtype, hidden = module.weight_ih_l0.dtype, module.hidden_size
    batch, steps = x.shape[0], x.shape[1]
    if state is None:
        state = (x.new_zeros(module.num_layers, batch, hidden, dtype=dtype),) * 2
    grad_out, grad_h, grad_c = (list(output_grads) + [None] * 3)[:3]
    with torch.enable_grad():
        layer_input, leaves, records, finals = x.to(dtype), [], [], []
        for layer in range(module.num_layers):
            weights = [None if (w := getattr(module, f"{kind}_l{layer}", None)) is None
                       else w.detach()
                       for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
            leaf = layer_input.new_zeros(batch, steps, 4 * hidden).requires_grad_()
            outputs, previous, final = _recurrence(layer_input, weights, leaf,
                                                   state[0][layer].to(dtype),
                                                   state[1][layer].to(dtype))
            leaves.append(leaf)
            records.append((layer_input.detach(), previous))
            finals.append(final)
            layer_input = outputs
        targets = [(layer_input, grad_out)] + [
            (torch.stack([f[k] for f in finals]), g) for k, g in ((0, grad_h), (1, grad_c))]
        chosen = [(t, g.to(dtype)) for t, g in targets if g is not None]
        gates = torch.autograd.grad([t for t, _ in chosen], leaves, [g for _, g in chosen],
                                    allow_unused=True)
    return [(a, h, torch.zeros_like(leaf) if g is None else g)
            for (a, h), leaf, g in zip(records, leaves, gates)]


def _recurrence(x: Tensor, weights: list, leaf: Tensor, h: Tensor, c: Tensor) -> tuple:
    """(outputs [B, T, H], h_{t-1} [B, T, H] detached, (h_T, c_T))."""
    weight_ih, weight_hh, bias_ih, bias_hh = weights
    projected = x @ weight_ih.t() + leaf
    if bias_ih is not None:
        projected = projected + bias_ih + bias_hh
    outputs, previous = [], []
    for t in range(x.shape[1]):
        previous.append(h.detach())
        i, f, g, o = (projected[:, t] + h @ weight_hh.t()).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outputs.append(h)
    return torch.stack(outputs, 1), torch.stack(previous, 1), (h, c)
