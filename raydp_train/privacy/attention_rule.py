"""nn.MultiheadAttention's rule (ARCHITECTURE.md §2.3): its projections as Linear calls.

The module computes q = x_q W_q^T + b_q, k = x_k W_k^T + b_k, v = x_v W_v^T + b_v (row blocks of
the packed `in_proj_weight`, or `q/k/v_proj_weight`), appends `bias_k`/`bias_v` and a zero key
and value if asked, O = A(q, k, v) (the heads' softmax attention) and y = O W_o^T + b_o with
`out_proj`'s parameters (read, never called). The hooks keep the call's arguments and dL/dy;
the rule recomputes q, k, v and O for the whole batch and G_q, G_k, G_v = dL/d(q, k, v) by one
backward of A alone, at the cotangent dL/dO = dL/dy W_o. Each projection is then a Linear:

    grad W_q,i = G_q,i^T x_q,i     grad b_q,i = sum_t G_q,i[t]     (k, v alike)
    grad W_o,i = (dL/dy_i)^T O_i   grad b_o,i = sum_t dL/dy_i[t]
    grad bias_k,i = G_k,i at the appended position                 (bias_v alike)

The packed weight's blocks are disjoint rows: its squared norm is the blocks' sum (one block,
[G_q G_k G_v], when query, key and value are one tensor). With batch_first=False the examples
are on axis 1, and the rule reads them there.
"""

from __future__ import annotations

import inspect
import math
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raydp_train.privacy.attention_capture import AttentionCapture
from raydp_train.privacy.layer_rules import (
    add_linear_clipped_sum,
    cat_tokens,
    linear_blocks_norms,
)
from raydp_train.privacy.rule_registry import (
    LayerCalls,
    Rule,
    UnsupportedLayerError,
    register_rule,
)

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


@register_rule(nn.MultiheadAttention)
class AttentionRule(Rule):
    """nn.MultiheadAttention: packed or separate q/k/v weights, with or without biases,
    bias_k/bias_v, add_zero_attn, masks, either layout; dropout in training is refused."""

    records_call = True  # the masks and key/value are needed, not only the query
    handles_batch_second = True
    owns_subtree = True  # out_proj's parameters are read, out_proj never called

    def __init__(self):
        self.labels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def check(self, module: nn.Module, name: str) -> None:
        self.labels[module] = name

    def parameter_names(self, module: nn.Module) -> tuple[str, ...]:
        return tuple(name for name, _ in module.named_parameters())

    def examples_in(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        query = args[0] if args else kwargs.get("query")
        if not isinstance(query, Tensor):
            return None
        return query if module.batch_first or query.dim() != 3 else query.transpose(0, 1)

    def during_forward(self, module: nn.Module, calls: LayerCalls, ghost_leaf: Tensor):
        return AttentionCapture(module, calls, ghost_leaf, attention)

    def squared_norms(self, module, calls: LayerCalls, slots: dict, gram_cache: dict) -> Tensor:
        self._refuse_dropout(module)
        records = _captured(module, calls) or [
            _recomputed(module, args, kwargs, grads)
            for (args, kwargs), grads in zip(calls.arguments, calls.output_grads)]
        weights, biases = _merged_blocks(
            [_record_blocks(module, record, slots, len(records) == 1) for record in records])
        norms, per_example = linear_blocks_norms([(a, g) for _, _, a, g in weights], calls,
                                                 gram_cache)
        for grads in biases.values():
            norms = norms + grads.reshape(grads.shape[0], -1).square().sum(1)
        calls.state.update(weights=weights, biases=biases, per_example=per_example)
        return norms

    def add_clipped_sum(self, module, calls: LayerCalls, clip_factors: Tensor, slots) -> None:
        for (slot, rows, a, g), materialized in zip(calls.state["weights"],
                                                    calls.state["per_example"]):
            target = slots[slot] if rows is None else slots[slot][rows]
            add_linear_clipped_sum(target, a, g, clip_factors, materialized)
        for slot, grads in calls.state["biases"].items():
            slots[slot].add_((clip_factors @ grads.reshape(grads.shape[0], -1))
                             .view(slots[slot].shape))

    def _refuse_dropout(self, module: nn.Module) -> None:
        if module.training and module.dropout > 0:
            label = self.labels.get(module, type(module).__name__)
            raise UnsupportedLayerError(
                f"module '{label}' (MultiheadAttention) has dropout={module.dropout} in "
                "training mode: its forward draws random numbers, which the rule's "
                "recomputation of the attention would draw again, differently; set its "
                "dropout to 0, or freeze its parameters")


def _captured(module: nn.Module, calls: LayerCalls) -> list | None:
    """The records of the calls that reached the loss, if the capture took every call of the
    pass (attention_capture.py); else None, and the rule recomputes them."""
    captured = calls.state.get("captured")
    if not captured or any(record is None for record in captured):
        return None
    dtype = module.out_proj.weight.dtype
    records = []
    for record in captured:
        grads = {name: record.get(name) for name in ("q", "k", "v", "bias_k", "bias_v")}
        if all(g is None for g in grads.values()) and record.get("y") is None:
            continue  # its output did not reach the loss
        inputs = [x.to(dtype) for x in record["inputs"]]
        projected = {name: g.to(dtype) for name, g in grads.items() if g is not None}
        for name, x in zip("qkv", inputs):  # a projection that did not reach the loss
            projected.setdefault(name, x.new_zeros(*x.shape[:2], module.embed_dim))
        grad_y = record.get("y")
        records.append({"inputs": inputs, "projected": projected,
                        "attended": record["attended"].to(dtype),
                        "grad_y": None if grad_y is None else grad_y.to(dtype)})
    return records


def _recomputed(module: nn.Module, args: tuple, kwargs: dict, output_grads: list) -> dict:
    """A call's record (inputs, G of q, k, v, bias_k, bias_v, O, dL/dy; batch first) by
    recomputing the projections and the attention from its recorded arguments."""
    call = _SIGNATURE.bind(module, *args, **kwargs)
    call.apply_defaults()
    given = call.arguments
    dtype = module.out_proj.weight.dtype
    inputs = [given[name].to(dtype) for name in ("query", "key", "value")]
    if not module.batch_first:
        inputs = [x.transpose(0, 1) for x in inputs]
    grad_y, grad_weights = (list(output_grads) + [None])[:2]
    if grad_y is not None:
        grad_y = grad_y.to(dtype) if module.batch_first else grad_y.to(dtype).transpose(0, 1)
    projected, attended = _projections_and_gradients(module, inputs, given, grad_y, grad_weights)
    return {"inputs": inputs, "projected": projected, "attended": attended, "grad_y": grad_y}


def _record_blocks(module: nn.Module, record: dict, slots: dict, only_call: bool) -> tuple:
    """One call's Linear blocks [(slot, rows, a [B,T,m], g [B,T,n])] and bias gradients
    {slot: [B, ...]}, for the trained slots. Several calls' blocks of one slot must cover
    the same rows (their tokens are concatenated): only a single call may pack q, k, v."""
    inputs, projected, grad_y = record["inputs"], record["projected"], record["grad_y"]
    attended = record["attended"]
    weights, biases = _in_projection_blocks(module, inputs, projected, slots, only_call)
    if grad_y is not None:
        if "out_proj.weight" in slots:
            weights.append(("out_proj.weight", None, attended, grad_y))
        if "out_proj.bias" in slots:
            biases["out_proj.bias"] = grad_y.sum(1)
    for slot in ("bias_k", "bias_v"):
        if slot in slots:
            biases[slot] = projected.get(slot, torch.zeros_like(inputs[0][:, 0, :1]).expand(
                -1, module.embed_dim))
    return weights, biases


def _in_projection_blocks(module, inputs: list, projected: dict, slots: dict,
                          pack: bool) -> tuple:
    grads = [projected[name] for name in ("q", "k", "v")]
    weights, biases = [], {}
    if module._qkv_same_embed_dim and "in_proj_weight" in slots:
        if pack and _same_tensor(*inputs):
            weights.append(("in_proj_weight", None, inputs[0], torch.cat(grads, 2)))
        else:
            size = module.embed_dim
            weights += [("in_proj_weight", slice(k * size, (k + 1) * size), x, g)
                        for k, (x, g) in enumerate(zip(inputs, grads))]
    for name, x, g in zip(("q_proj_weight", "k_proj_weight", "v_proj_weight"), inputs, grads):
        if not module._qkv_same_embed_dim and name in slots:
            weights.append((name, None, x, g))
    if "in_proj_bias" in slots:
        biases["in_proj_bias"] = torch.cat([g.sum(1) for g in grads], 1)
    return weights, biases


def _same_tensor(*tensors: Tensor) -> bool:
    """One memory, shape and layout (the hooks detached each argument on its own)."""
    first = tensors[0]
    return all(x.data_ptr() == first.data_ptr() and x.shape == first.shape
               and x.stride() == first.stride() and x.dtype == first.dtype for x in tensors)


def _merged_blocks(per_call: list) -> tuple[list, dict]:
    """The calls' blocks of one slot and rows concatenated along the tokens; biases summed."""
    weights: dict = {}
    biases: dict = {}
    for call_weights, call_biases in per_call:
        for slot, rows, a, g in call_weights:
            key = (slot, None if rows is None else (rows.start, rows.stop))
            weights.setdefault(key, (slot, rows, [], []))
            weights[key][2].append(a)
            weights[key][3].append(g)
        for slot, grads in call_biases.items():
            biases[slot] = biases[slot] + grads if slot in biases else grads
    merged = [(slot, rows, cat_tokens(a), cat_tokens(g)) for slot, rows, a, g in weights.values()]
    return merged, biases


def _projections_and_gradients(module, inputs: list, given: dict, grad_y, grad_weights):
    """({q, k, v: G [B, T, E], bias_k, bias_v: [B, E]}, O [B, L, E]): one forward of the
    projections and the attention, one backward of the attention."""
    weight_q, weight_k, weight_v = _projection_weights(module)
    bias = module.in_proj_bias
    biases = (None,) * 3 if bias is None else bias.detach().chunk(3)
    with torch.enable_grad():
        leaves = {name: F.linear(x, w, b).detach().requires_grad_()
                  for name, x, w, b in zip("qkv", inputs, (weight_q, weight_k, weight_v), biases)}
        batch = inputs[0].shape[0]
        if module.bias_k is not None:
            for name in ("bias_k", "bias_v"):
                leaves[name] = getattr(module, name).detach().reshape(1, -1).expand(
                    batch, -1).clone().requires_grad_()
        attended, weights = attention(module, leaves, given)
        outputs, cotangents = [], []
        if grad_y is not None:
            outputs.append(attended)
            cotangents.append(grad_y @ module.out_proj.weight.detach())
        if grad_weights is not None and weights is not None:
            outputs.append(weights)
            cotangents.append(grad_weights.to(weights.dtype))
        grads = torch.autograd.grad(outputs, list(leaves.values()), cotangents,
                                    allow_unused=True)
    projected = {name: torch.zeros_like(leaf) if g is None else g
                 for (name, leaf), g in zip(leaves.items(), grads)}
    return projected, attended.detach()


def _projection_weights(module) -> tuple[Tensor, Tensor, Tensor]:
    if module._qkv_same_embed_dim:
        return module.in_proj_weight.detach().chunk(3)
    return tuple(getattr(module, f"{name}_proj_weight").detach() for name in "qkv")


def attention(module, leaves: dict, given: dict) -> tuple[Tensor, Tensor | None]:
    """O [B, L, E] (before out_proj) and the attention weights, as
    F.multi_head_attention_forward computes them from the projections."""
    q, k, v = leaves["q"], leaves["k"], leaves["v"]
    key_padding_mask, mask = _canonical_masks(given, q.dtype)
    batch = q.shape[0]
    if "bias_k" in leaves:
        k = torch.cat([k, leaves["bias_k"].unsqueeze(1)], 1)
        v = torch.cat([v, leaves["bias_v"].unsqueeze(1)], 1)
        key_padding_mask, mask = _pad_masks(key_padding_mask, mask)
    if module.add_zero_attn:
        k, v = (torch.cat([x, x.new_zeros(batch, 1, x.shape[2])], 1) for x in (k, v))
        key_padding_mask, mask = _pad_masks(key_padding_mask, mask)
    heads, head_dim = module.num_heads, module.head_dim
    causal = given["is_causal"] and key_padding_mask is None and not given["need_weights"]
    length, source = q.shape[1], k.shape[1]
    if causal:
        mask = None
    elif mask is not None:  # [L, S], [1, L, S] or [B * heads, L, S]
        shared = mask.dim() == 2 or mask.shape[0] == 1
        mask = mask.view(1 if shared else batch, 1 if shared else heads, length, source)
    if key_padding_mask is not None:
        padding = key_padding_mask.view(batch, 1, 1, source)
        mask = padding if mask is None else mask + padding
    split = [x.view(batch, x.shape[1], heads, head_dim).transpose(1, 2) for x in (q, k, v)]
    if given["need_weights"]:
        scores = (split[0] * math.sqrt(1.0 / float(head_dim))) @ split[1].transpose(-2, -1)
        weights = torch.softmax(scores if mask is None else scores + mask, dim=-1)
        out = weights @ split[2]
        weights = weights.mean(1) if given["average_attn_weights"] else weights
    else:
        out, weights = F.scaled_dot_product_attention(*split, mask, 0.0, causal), None
    return out.transpose(1, 2).reshape(batch, length, -1), weights


def _canonical_masks(given: dict, dtype: torch.dtype) -> tuple:
    """The masks as additive floats, as nn.MultiheadAttention.forward makes them."""
    attn_mask = given["attn_mask"]
    key_padding_mask = F._canonical_mask(
        mask=given["key_padding_mask"], mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask), other_name="attn_mask", target_type=dtype)
    attn_mask = F._canonical_mask(mask=attn_mask, mask_name="attn_mask", other_type=None,
                                  other_name="", target_type=dtype, check_other=False)
    return key_padding_mask, attn_mask


def _pad_masks(key_padding_mask, mask) -> tuple:
    """One more key position, masked by neither mask (an appended bias or zero key)."""
    return tuple(None if m is None else F.pad(m, (0, 1)) for m in (key_padding_mask, mask))
