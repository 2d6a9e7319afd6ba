"""The built-in layer rules (ARCHITECTURE.md §2.3); what a rule does is in rule_registry.py.

Linear and the convolutions share the Linear rule's one-matmul clipped sum and Gram shortcut;
Embedding's rule is in embedding_rule.py, the normalization layers' in norm_rules.py. Each
rule registers itself for its layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raydp_train.privacy.rounding import gram_product, unit_roundoff
from raydp_train.privacy.rule_registry import (
    LayerCalls,
    Rule,
    UnsupportedLayerError,
    register_rule,
)

# ---------------------------------------------------------------------------- Linear family


def linear_weight_norm(a: Tensor, g: Tensor, gram_cache: dict, key: tuple | None) -> tuple:
    """||G_i^T a_i||_F^2 for a [B,T,m], g [B,T,n]; returns (norms, per-example grads or None,
    rounding bound [B] float64 or None).

    Ghost: <a a^T, G G^T>, O(T^2 (m+n)), when 2 T^2 <= m n; otherwise materialize G_i^T a_i.
    The ghost form's terms can cancel (rounding.py): it comes with a bound on its rounding
    error, and the clip factor is taken from norm^2 + bound. The other two forms are sums of
    squares of the very numbers the clipped sum adds, and need none.
    """
    tokens, in_features, out_features = a.shape[1], a.shape[2], g.shape[2]
    if 2 * tokens * tokens <= in_features * out_features:
        if tokens == 1:
            return a.square().sum((1, 2)) * g.square().sum((1, 2)), None, None
        # Q, K and V projections read the same input tensor: compute its Gram once.
        cached = gram_cache.get(key) if key is not None else None
        if cached is None:
            cached = torch.bmm(a, a.transpose(1, 2)), a.norm(dim=2)
            if key is not None:
                gram_cache[key] = cached
        input_gram, input_norms = cached
        grad_norms = g.norm(dim=2)
        value, bound = gram_product(input_gram, torch.bmm(g, g.transpose(1, 2)),
                                    (input_norms, input_norms), (grad_norms, grad_norms),
                                    in_features, out_features)
        norms = value.to(a.dtype)
        return norms, None, bound + unit_roundoff(a.dtype) * value.abs()
    per_example = torch.bmm(g.transpose(1, 2), a)
    return per_example.square().sum((1, 2)), per_example, None


def add_rounding(calls: LayerCalls, bound: Tensor | None) -> None:
    """Add a Gram form's rounding bound [B] to what the engine adds to the squared norms
    before it forms the clip factors (`calls.state["rounding"]`)."""
    if bound is not None:
        calls.state["rounding"] = calls.state.get("rounding", 0) + bound


def linear_blocks_norms(blocks: list, calls: LayerCalls, gram_cache: dict) -> tuple:
    """(sum of ||G_i^T a_i||^2 over the blocks [(a [B,T,m], g [B,T,n])] -- separate weights,
    or disjoint row blocks of one -- and each block's materialized gradients or None), the
    ghost forms' rounding bounds added to `calls`. For rules made of Linear calls."""
    norms, materialized = 0, []
    for a, g in blocks:
        block_norms, per_example, bound = linear_weight_norm(a, g, gram_cache, None)
        norms = norms + block_norms
        materialized.append(per_example)
        add_rounding(calls, bound)
    return norms, materialized


def add_linear_clipped_sum(
    grad: Tensor, a: Tensor, g: Tensor, clip_factors: Tensor, per_example, rows=None
) -> None:
    """grad += sum_i c_i G_i^T a_i as ONE matmul over all (i, t) (or from materialized grads).

    `rows` ([K, 2] (example, token) pairs, from `drop_padding`) limits the matmul to the
    tokens whose output gradient is nonzero; the others add exactly nothing.
    """
    if per_example is not None:
        grad.add_(torch.einsum("b,bnm->nm", clip_factors, per_example))
        return
    if rows is None:
        scale = clip_factors.view(-1, 1, 1)
    else:
        examples, tokens = rows.unbind(1)
        a, g = a[examples, tokens], g[examples, tokens]
        scale = clip_factors[examples].unsqueeze(1)
    if g.shape[-1] <= a.shape[-1]:
        g = g * scale
    else:
        a = a * scale
    grad.addmm_(g.reshape(-1, g.shape[-1]).t(), a.reshape(-1, a.shape[-1]))


def drop_padding(a: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """Drop the token positions that padding leaves without gradient; exact.

    Right padding behind an attention mask gets an output gradient of exactly zero, and a
    zero gradient row adds nothing to G^T a, to G G^T or to sum_t G. So the trailing
    positions whose gradient is zero in every example are cut from a [B,T,m] and g [B,T,n],
    and the (example, token) pairs left with a nonzero gradient are returned as `rows`
    ([K, 2]) for the clipped sum. A batch whose last position is in use costs one look at
    g[:, -1] and comes back unchanged, with rows None; so does a batch whose kept positions
    are all in use (a causal LM's: only the last position, which has no next token, is cut),
    since gathering every row would only copy them.
    """
    if g.shape[1] == 1 or g[:, -1].any():
        return a, g, None
    in_use = (g != 0).any(2)  # [B, T]; NaN counts as in use. One cheap pass over g.
    positions = in_use.any(0).nonzero()
    kept = int(positions[-1]) + 1 if positions.numel() else 1
    in_use = in_use[:, :kept]
    return a[:, :kept], g[:, :kept], None if in_use.all() else in_use.nonzero()


def gram_key(x: Tensor, token_view: tuple, kept_tokens: int) -> tuple:
    """Identifies a Gram matrix a a^T by the layer input's memory (not the Python object: each
    hook recorded its own `detach()` of the one tensor that Q, K and V read, and inputs are
    checked unchanged since their layers ran), the rule's token view of it (a convolution's
    unfolded patches depend on its kernel, stride, padding and dilation) and the tokens kept.
    Valid for single calls (a stacked input is a new tensor)."""
    memory = (x.device, x.data_ptr(), x.dtype, tuple(x.shape), x.stride())
    return memory, token_view, kept_tokens


def cat_tokens(tensors: list[Tensor]) -> Tensor:
    """Concatenate calls along the token axis (no copy for the usual single call)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, 1)


@register_rule(nn.Linear)
class LinearRule(Rule):
    """nn.Linear: input [B, ..., m], output gradient [B, ..., n]."""

    folds_examples = True
    # Its tokens' features are its input's, so layers reading one input may share a Gram
    # (a transposed convolution's are its output gradient's patches: never).
    shares_input_gram = True

    def tokens(self, module: nn.Module, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """Both as [B, T, features] (T = 1 for plain vectors)."""
        return x.reshape(x.shape[0], -1, x.shape[-1]), g.reshape(g.shape[0], -1, g.shape[-1])

    def groups(self, module: nn.Module) -> int:
        return 1

    def token_view(self, module: nn.Module) -> tuple:
        """What, besides the input itself, `tokens` depends on: two layers share an input Gram
        only if their inputs AND token views are equal."""
        return ("last axis as features",)

    def stacked_tokens(self, module, calls: LayerCalls) -> tuple[Tensor, Tensor, Tensor | None]:
        """All calls as one [B, T, m] input and [B, T, n] output gradient, with the positions
        padding left without gradient dropped (`drop_padding`: the kept rows, or None)."""
        pairs = [self.tokens(module, x, g) for x, g in zip(calls.inputs, calls.output_grads)]
        return drop_padding(cat_tokens([a for a, _ in pairs]), cat_tokens([g for _, g in pairs]))

    def squared_norms(self, module, calls: LayerCalls, slots: dict, gram_cache: dict) -> Tensor:
        a, g, rows = self.stacked_tokens(module, calls)
        calls.state.update(a=a, g=g, rows=rows)
        norms = a.new_zeros(a.shape[0])
        if "weight" in slots:
            shareable = (self.shares_input_gram and len(calls.inputs) == 1
                         and self.groups(module) == 1)
            view = self.token_view(module)
            key = gram_key(calls.inputs[0], view, a.shape[1]) if shareable else None
            per_group = []
            for a_part, g_part in self._group_slices(module, a, g):
                group_norms, per_example, bound = linear_weight_norm(a_part, g_part,
                                                                     gram_cache, key)
                norms = norms + group_norms
                per_group.append(per_example)
                add_rounding(calls, bound)
            calls.state["per_example"] = per_group
        if "bias" in slots:
            bias_grads = g.sum(1)
            calls.state["bias_grads"] = bias_grads
            norms = norms + bias_grads.square().sum(1)
        return norms

    def add_clipped_sum(self, module, calls: LayerCalls, clip_factors: Tensor, slots) -> None:
        a, g = calls.state["a"], calls.state["g"]
        if "weight" in slots:
            # Group k of a grouped conv owns rows [k n/groups, (k+1) n/groups) of the weight.
            groups = self.groups(module)
            blocks = slots["weight"].view(groups, -1, a.shape[2] // groups)
            slices = self._group_slices(module, a, g)
            for block, (a_part, g_part), per_example in zip(
                blocks, slices, calls.state["per_example"]
            ):
                add_linear_clipped_sum(block, a_part, g_part, clip_factors, per_example,
                                       calls.state["rows"])
        if "bias" in slots:
            slots["bias"].add_(clip_factors @ calls.state["bias_grads"])

    def per_example_gradient(self, module, calls: LayerCalls, slot: str) -> Tensor | None:
        """The bias's sum_t G_i[t]; the weight's G_i^T a_i per group, materialized."""
        if slot == "bias":
            return calls.state["bias_grads"]
        a, g = calls.state["a"], calls.state["g"]
        blocks = [
            torch.bmm(g_part.transpose(1, 2), a_part) if per_example is None else per_example
            for (a_part, g_part), per_example in zip(
                self._group_slices(module, a, g), calls.state["per_example"])
        ]
        return self.weight_layout(module, torch.cat(blocks, 1))

    def weight_layout(self, module: nn.Module, grads: Tensor) -> Tensor:
        """Per-example weight gradients [B, n, m] laid out as the weight is stored."""
        return grads.reshape(grads.shape[0], *module.weight.shape)

    def _group_slices(self, module, a: Tensor, g: Tensor):
        groups = self.groups(module)
        if groups == 1:
            yield a, g
            return
        in_size, out_size = a.shape[2] // groups, g.shape[2] // groups
        for k in range(groups):
            yield (
                a[:, :, k * in_size : (k + 1) * in_size],
                g[:, :, k * out_size : (k + 1) * out_size],
            )


@register_rule(nn.Conv1d, nn.Conv2d)
class ConvRule(LinearRule):
    """nn.Conv1d / nn.Conv2d: unfold the input into patches, then the Linear rule applies."""

    folds_examples = False  # its input's axes after the examples are channels and space

    def token_view(self, module: nn.Module) -> tuple:
        """Unfolded patches: channels as features, one token per output position."""
        return (type(module).__name__, module.kernel_size, module.stride, module.padding,
                module.dilation)

    def check(self, module: nn.Module, name: str) -> None:
        if module.padding_mode != "zeros":
            raise UnsupportedLayerError(
                f"module '{name}' ({type(module).__name__}) uses padding_mode="
                f"'{module.padding_mode}'; only 'zeros' is supported for per-example clipping"
            )

    def groups(self, module: nn.Module) -> int:
        return module.groups

    def tokens(self, module: nn.Module, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        if isinstance(module, nn.Conv1d):
            x = x.unsqueeze(2)  # [B, C, 1, L]: a 1-D conv is a 2-D conv of height 1
            kernel, stride = (1, *module.kernel_size), (1, *module.stride)
            dilation, padding = (1, *module.dilation), module.padding
            padding = padding if isinstance(padding, str) else (0, *padding)
        else:
            kernel, stride = module.kernel_size, module.stride
            dilation, padding = module.dilation, module.padding
        if isinstance(padding, str):
            x = _pad_same(x, kernel, dilation) if padding == "same" else x
            padding = (0, 0)
        patches = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
        batch = g.shape[0]
        return patches.transpose(1, 2), g.reshape(batch, g.shape[1], -1).transpose(1, 2)


def _pad_same(x: Tensor, kernel, dilation) -> Tensor:
    """Zero-pad as torch does for padding='same' (extra padding goes right/bottom)."""
    pads = []
    for size, rate in zip(reversed(kernel), reversed(dilation)):
        total = rate * (size - 1)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads)


@register_rule("transformers.pytorch_utils.Conv1D")
class TransposedLinearRule(LinearRule):
    """Hugging Face's GPT-2 `Conv1D`: y = x W + b with W stored [in, out], i.e. a Linear
    whose weight is transposed; the clipped sum is written through the transposed view."""

    def weight_layout(self, module: nn.Module, grads: Tensor) -> Tensor:
        return grads.transpose(1, 2)

    def add_clipped_sum(self, module, calls: LayerCalls, clip_factors: Tensor, slots) -> None:
        transposed = {**slots, "weight": slots["weight"].t()} if "weight" in slots else slots
        super().add_clipped_sum(module, calls, clip_factors, transposed)

