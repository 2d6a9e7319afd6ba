"""Tied weights: one parameter used by several layers (GPT-2's `wte` and `lm_head`), §2.3.

The parameter's per-example gradient is the sum of its uses' gradients, g_i = sum_u g_i^u,
clipped once with the rest of the example's gradient:

    ||g_i||^2          = sum_u ||g_i^u||^2 + 2 sum_{u<w} <g_i^u, g_i^w>
    sum_i c_i g_i      = sum_u (sum_i c_i g_i^u)

So each layer's rule computes its own use's norm and adds its own clipped sum into the ONE
slot the parameter has, exactly as if it were untied; only the cross terms are new. Each is a
product over token pairs, exact, with O(B T_u T_w) memory (no per-example V x d gradient):

    Linear x Linear        <G^T a, H^T b>_i          = sum_{t,s} (G_t . H_s) (a_t . b_s)
    Embedding x Linear     <E(ids, F), G^T a>_i      = sum_{s,t} G_t[id_s] (F_s . a_t)
    Embedding x Embedding  <E(ids, F), E(jds, H)>_i  = sum_{s,t} [id_s = jd_t] (F_s . H_t)

(a, b: Linear inputs; G, H, F: output gradients; E(ids, F): the rows F_s added at rows id_s.)
Any other pair of layer kinds sharing a trained parameter is refused, naming both modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

import torch
from torch import Tensor, nn

from raydp_train.privacy.layer_rules import EmbeddingRule, LinearRule
from raydp_train.privacy.rule_registry import LayerCalls, Rule, UnsupportedLayerError


@dataclass(frozen=True)
class Tie:
    """A trained parameter and the (module, rule) of each layer that uses it."""

    parameter_name: str
    uses: tuple[tuple[nn.Module, Rule], ...]


def find_ties(layers: list) -> list[Tie]:
    """The trained parameters owned by several of the (name, module, rule) `layers`; a pair
    of uses with no cross term below is refused."""
    owners: dict[int, list] = {}
    names: dict[int, str] = {}
    for label, module, rule in layers:
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad:
                owners.setdefault(id(p), []).append((label, module, rule))
                names.setdefault(id(p), name if label == "<root>" else f"{label}.{name}")
    ties = []
    for key, uses in owners.items():
        if len(uses) < 2:
            continue
        for (label_a, module_a, rule_a), (label_b, module_b, rule_b) in combinations(uses, 2):
            if _cross_term(rule_a, rule_b) is None:
                raise UnsupportedLayerError(
                    f"modules '{label_a}' ({type(module_a).__name__}) and '{label_b}' "
                    f"({type(module_b).__name__}) share the trainable parameter "
                    f"'{names[key]}' (tied weights); per-example clipping supports tied "
                    "weights between Linear and Embedding layers only: untie them or freeze "
                    "the shared parameter"
                )
        ties.append(Tie(names[key], tuple((module, rule) for _, module, rule in uses)))
    return ties


def cross_terms(ties: list[Tie], used: dict[nn.Module, LayerCalls], like: Tensor) -> Tensor:
    """2 sum_{u<w} <g_i^u, g_i^w> over every tie's uses that took part in the loss, [B].

    Call after every used layer's `squared_norms`: the terms read what those left in
    `calls.state`."""
    total = torch.zeros_like(like)
    for tie in ties:
        present = [(module, rule) for module, rule in tie.uses if module in used]
        for (module_a, rule_a), (module_b, rule_b) in combinations(present, 2):
            term = _cross_term(rule_a, rule_b)
            total = total + 2 * term(used[module_a].state, used[module_b].state)
    return total


def _cross_term(rule_a: Rule, rule_b: Rule) -> Callable[[dict, dict], Tensor] | None:
    """The cross term of two uses' states, in either order; None for an unsupported pair."""
    kinds = (type(rule_a), type(rule_b))
    if kinds in _CROSS_TERMS:
        return _CROSS_TERMS[kinds]
    swapped = _CROSS_TERMS.get(kinds[::-1])
    return None if swapped is None else (lambda a, b: swapped(b, a))


def _linear_linear(first: dict, second: dict) -> Tensor:
    inputs = torch.bmm(first["a"], second["a"].transpose(1, 2))
    grads = torch.bmm(first["g"], second["g"].transpose(1, 2))
    return (inputs * grads).sum((1, 2))


def _embedding_linear(embedding: dict, linear: dict) -> Tensor:
    ids, rows = embedding["ids"], embedding["g"]  # [B, S], [B, S, d]
    a, g = linear["a"], linear["g"]  # [B, T, d], [B, T, V]
    picked = g.gather(2, ids.unsqueeze(1).expand(-1, g.shape[1], -1))  # G_t[id_s]: [B, T, S]
    return (picked * torch.bmm(a, rows.transpose(1, 2))).sum((1, 2))


def _embedding_embedding(first: dict, second: dict) -> Tensor:
    same_id = first["ids"].unsqueeze(2) == second["ids"].unsqueeze(1)  # [B, S, S']
    rows = torch.bmm(first["g"], second["g"].transpose(1, 2))
    return (rows * same_id).sum((1, 2))


# Exact rule types: a subclass (a convolution, GPT-2's transposed Conv1D, LSG's low-rank
# carriers) lays its weight out differently and is refused.
_CROSS_TERMS: dict[tuple[type, type], Callable[[dict, dict], Tensor]] = {
    (LinearRule, LinearRule): _linear_linear,
    (EmbeddingRule, LinearRule): _embedding_linear,
    (EmbeddingRule, EmbeddingRule): _embedding_embedding,
}
