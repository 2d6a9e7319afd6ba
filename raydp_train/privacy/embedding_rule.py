"""nn.Embedding's rule (ARCHITECTURE.md §2.3): per-example rows summed per (example, id)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from raydp_train.privacy.layer_rules import cat_tokens
from raydp_train.privacy.rule_registry import (
    LayerCalls,
    Rule,
    UnsupportedLayerError,
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
