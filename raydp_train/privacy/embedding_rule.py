"""nn.Embedding's and nn.EmbeddingBag's rules (ARCHITECTURE.md §2.3): per-example rows summed
per (example, id)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from raydp_train.privacy.layer_rules import cat_tokens
from raydp_train.privacy.rule_registry import (
    LayerCalls,
    Rule,
    UnsupportedLayerError,
    changed_behaviour,
    register_matcher,
    register_rule,
)


@register_rule(nn.Embedding)
class EmbeddingRule(Rule):
    """nn.Embedding: grad_i[v] = sum of G_i[t] over the tokens t with id v.

    Rows are summed per (example, id) with one index_add over the unique pairs, so neither
    a T x T token-equality Gram nor a dense V x d per-example gradient is ever formed.
    """

    folds_examples = True

    def parameter_names(self, module: nn.Module) -> tuple[str, ...]:
        return ("weight",)

    def check(self, module: nn.Module, name: str) -> None:
        if module.sparse or module.scale_grad_by_freq:
            raise UnsupportedLayerError(
                f"module '{name}' (Embedding) uses sparse=True or scale_grad_by_freq=True, "
                "which per-example clipping does not support"
            )

    def squared_norms(self, module, calls: LayerCalls, slots: dict, gram_cache: dict) -> Tensor:
        ids = cat_tokens([x.reshape(x.shape[0], -1) for x in calls.inputs])
        g = cat_tokens([g.reshape(g.shape[0], -1, g.shape[-1]) for g in calls.output_grads])
        batch, vocab = ids.shape[0], module.num_embeddings
        if module.padding_idx is not None:
            g = g.masked_fill((ids == module.padding_idx).unsqueeze(-1), 0)
        example = torch.arange(batch, device=ids.device).unsqueeze(1)
        pair_keys, pair_index = torch.unique(example * vocab + ids, return_inverse=True)
        row_sums = g.new_zeros(pair_keys.shape[0], g.shape[-1])
        row_sums.index_add_(0, pair_index.reshape(-1), g.reshape(-1, g.shape[-1]))
        calls.state.update(pair_keys=pair_keys, row_sums=row_sums, ids=ids, g=g)
        norms = g.new_zeros(batch)
        return norms.index_add_(0, pair_keys // vocab, row_sums.square().sum(1))

    def add_clipped_sum(self, module, calls: LayerCalls, clip_factors: Tensor, slots) -> None:
        pair_keys, row_sums = calls.state["pair_keys"], calls.state["row_sums"]
        vocab = module.num_embeddings
        scaled = row_sums * clip_factors[pair_keys // vocab].unsqueeze(1)
        slots["weight"].index_add_(0, pair_keys % vocab, scaled)


@register_matcher("nn.EmbeddingBag in mode 'sum' or 'mean'")
def _embedding_bag(module: nn.Module) -> Rule | None:
    """Mode 'max' sends each dimension's gradient to one row of the bag: it takes the
    per-example path."""
    if (isinstance(module, nn.EmbeddingBag) and module.mode in ("sum", "mean")
            and changed_behaviour(module, nn.EmbeddingBag) is None):
        return EMBEDDING_BAG
    return None


class EmbeddingBagRule(EmbeddingRule):
    """nn.EmbeddingBag, mode sum or mean, one bag per example (rows of a 2-D input, or the
    bags `offsets` cuts from a 1-D input): entry j of bag b with id v adds w_j / n_b dL/dy_b
    to grad_b[v] (w_j its per_sample_weight or 1, n_b the bag's entries other than
    padding_idx for 'mean', else 1); then rows summed per (example, id) as for Embedding."""

    records_call = True  # offsets and per_sample_weights are arguments too
    folds_examples = False  # a bag is an example: its rows are not tokens to fold

    def examples_in(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        ids, offsets, _ = _bag_arguments(args, kwargs)
        if ids.dim() == 2 or offsets is None:
            return ids
        return offsets[:-1] if module.include_last_offset else offsets

    def squared_norms(self, module, calls: LayerCalls, slots: dict, gram_cache: dict) -> Tensor:
        entries = [_entries(module, *_bag_arguments(*arguments), grads[0])
                   for arguments, grads in zip(calls.arguments, calls.output_grads)]
        examples, ids, rows = (torch.cat(parts) for parts in zip(*entries))
        batch, vocab = calls.inputs[0].shape[0], module.num_embeddings
        pair_keys, pair_index = torch.unique(examples * vocab + ids, return_inverse=True)
        row_sums = rows.new_zeros(pair_keys.shape[0], rows.shape[-1])
        row_sums.index_add_(0, pair_index, rows)
        calls.state.update(pair_keys=pair_keys, row_sums=row_sums)
        norms = rows.new_zeros(batch)
        return norms.index_add_(0, pair_keys // vocab, row_sums.square().sum(1))


EMBEDDING_BAG = EmbeddingBagRule()


def _bag_arguments(args: tuple, kwargs: dict) -> tuple:
    """(input, offsets, per_sample_weights) of an EmbeddingBag call."""
    named = dict(zip(("input", "offsets", "per_sample_weights"), args), **kwargs)
    return named["input"], named.get("offsets"), named.get("per_sample_weights")


def _entries(module, ids: Tensor, offsets, weights, grad: Tensor) -> tuple:
    """(bag [N], id [N], w_j / n_b dL/dy_b [N, d]) of every entry other than padding_idx."""
    if ids.dim() == 2:
        bags = torch.arange(ids.shape[0], device=ids.device).repeat_interleave(ids.shape[1])
        ids, weights = ids.reshape(-1), None if weights is None else weights.reshape(-1)
    else:
        starts = offsets[:-1] if module.include_last_offset else offsets
        positions = torch.arange(ids.shape[0], device=ids.device)
        bags = torch.searchsorted(starts, positions, right=True) - 1
    kept = bags >= 0
    if module.padding_idx is not None:
        kept &= ids != module.padding_idx
    bags, ids = bags[kept], ids[kept]
    scale = grad.new_ones(bags.shape[0]) if weights is None else weights[kept].to(grad.dtype)
    if module.mode == "mean":
        counts = torch.zeros(grad.shape[0], dtype=grad.dtype, device=grad.device)
        counts.index_add_(0, bags, torch.ones_like(scale))
        scale = scale / counts[bags]
    return bags, ids, grad[bags] * scale.unsqueeze(1)
