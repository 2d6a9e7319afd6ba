"""Shared parameters: one trained parameter used by several layers (GPT-2's `wte` and
`lm_head`, two Linear layers sharing a bias), §2.3.

The parameter's per-example gradient is the sum of its uses' gradients, g_i = sum_u g_i^u,
clipped once with the rest of the example's gradient:

    ||g_i||^2          = sum_u ||g_i^u||^2 + 2 sum_{u<w} <g_i^u, g_i^w>
    sum_i c_i g_i      = sum_u (sum_i c_i g_i^u)

So each layer's rule computes its own use's norm and adds its own clipped sum into the ONE
slot the parameter has, exactly as if it were unshared; only the cross terms are new. Each is
the inner product of the two uses' gradients of THAT parameter (a weight's, or a bias's: a
shared bias gives 2 <sum_t G_t, sum_s H_s>). The large ones are products over token pairs,
exact, with O(B T_u T_w) memory (no per-example V x d gradient):

    Linear.weight x Linear.weight       <G^T a, H^T b>_i        = sum_{t,s} (G_t . H_s)(a_t . b_s)
    Embedding.weight x Linear.weight    <E(ids, F), G^T a>_i    = sum_{s,t} G_t[id_s] (F_s . a_t)
    Embedding.weight x Embedding.weight <E(ids, F), E(jds, H)>_i = sum_{s,t} [id_s = jd_t] (F_s . H_t)

(a, b: Linear inputs; G, H, F: output gradients; E(ids, F): the rows F_s added at rows id_s.)
Any other pair is the inner product of the per-example gradients both rules materialize
(`Rule.per_example_gradient`: biases, norm scales, convolution kernels); a pair where a rule
cannot is refused, naming both modules. Cross terms can cancel like any Gram form: each comes
in float64 with a bound on its rounding error (rounding.py), which the clip factor adds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import combinations

import torch
from torch import Tensor, nn

from raydp_train.privacy.embedding_rule import EmbeddingRule
from raydp_train.privacy.layer_rules import LinearRule
from raydp_train.privacy.owned_parameters import owned_parameters
from raydp_train.privacy.rounding import gathered_product, gram_product, inner_product
from raydp_train.privacy.rule_registry import LayerCalls, Rule, UnsupportedLayerError


@dataclass(frozen=True)
class Use:
    """A layer that uses a shared parameter, and the parameter's name (its slot) there."""

    module: nn.Module
    rule: Rule
    slot: str


@dataclass(frozen=True)
class Tie:
    """A trained parameter and each layer that uses it."""

    parameter_name: str
    uses: tuple[Use, ...]


# <g_i^u, g_i^w> per example and a bound on its rounding error, both float64 [B].
CrossTerm = Callable[[Use, LayerCalls, Use, LayerCalls], tuple[Tensor, Tensor]]


def find_ties(layers: list) -> list[Tie]:
    """The trained parameters owned by several of the (name, module, rule) `layers`; a pair
    of uses with no cross term is refused."""
    owners: dict[int, list] = {}
    names: dict[int, str] = {}
    for label, module, rule in layers:
        slots = rule.slot_shapes(module)
        for name, p in owned_parameters(module).items():
            if p.requires_grad:
                owners.setdefault(id(p), []).append((label, Use(module, rule, name), name in slots))
                names.setdefault(id(p), name if label == "<root>" else f"{label}.{name}")
    ties = []
    for key, uses in owners.items():
        if len(uses) < 2:
            continue
        for (label_a, use_a, slot_a), (label_b, use_b, slot_b) in combinations(uses, 2):
            if not (slot_a and slot_b) or _cross_term(use_a, use_b) is None:
                raise UnsupportedLayerError(
                    f"modules '{label_a}' ({type(use_a.module).__name__}) and '{label_b}' "
                    f"({type(use_b.module).__name__}) share the trainable parameter "
                    f"'{names[key]}' (as '{use_a.slot}' and '{use_b.slot}'); per-example "
                    "clipping has no cross term for this pair: untie them or freeze the "
                    "shared parameter"
                )
        ties.append(Tie(names[key], tuple(use for _, use, _ in uses)))
    return ties


@dataclass(frozen=True)
class TieTerm:
    """A tie's 2 sum_{u<w} <g_i^u, g_i^w> over its used pairs, and its rounding bound."""

    tie: Tie
    value: Tensor  # [B], float64
    rounding: Tensor  # [B], float64


def tie_terms(ties: list[Tie], used: dict[nn.Module, LayerCalls], like: Tensor) -> list[TieTerm]:
    """Each tie's cross terms over its uses that took part in the loss.

    Call after every used layer's `squared_norms`: the terms read what those left in
    `calls.state`."""
    terms = []
    for tie in ties:
        value = torch.zeros_like(like, dtype=torch.float64)
        rounding = torch.zeros_like(value)
        present = [use for use in tie.uses if use.module in used]
        for use_a, use_b in combinations(present, 2):
            term = _cross_term(use_a, use_b)
            pair, bound = term(use_a, used[use_a.module], use_b, used[use_b.module])
            value, rounding = value + 2 * pair, rounding + 2 * bound
        terms.append(TieTerm(tie, value, rounding))
    return terms


def _cross_term(use_a: Use, use_b: Use) -> CrossTerm | None:
    """The cross term of two uses, in either order; None for a pair with none."""
    kinds = (_kind(use_a), _kind(use_b))
    if kinds in _TOKEN_PAIR_TERMS:
        return _TOKEN_PAIR_TERMS[kinds]
    if kinds[::-1] in _TOKEN_PAIR_TERMS:
        swapped = _TOKEN_PAIR_TERMS[kinds[::-1]]
        return lambda a, calls_a, b, calls_b: swapped(b, calls_b, a, calls_a)
    if EmbeddingRule in (type(use_a.rule), type(use_b.rule)):
        return None  # its per-example gradient would be dense [B, V, d]
    if all(type(use.rule).per_example_gradient is not Rule.per_example_gradient
           for use in (use_a, use_b)):
        return _materialized
    return None


def _kind(use: Use) -> tuple[type, str]:
    return type(use.rule), use.slot


def _materialized(use_a: Use, calls_a: LayerCalls, use_b: Use,
                  calls_b: LayerCalls) -> tuple[Tensor, Tensor]:
    grads_a = use_a.rule.per_example_gradient(use_a.module, calls_a, use_a.slot)
    grads_b = use_b.rule.per_example_gradient(use_b.module, calls_b, use_b.slot)
    return inner_product(grads_a, grads_b)


def _linear_linear(first: Use, calls_a: LayerCalls, second: Use,
                   calls_b: LayerCalls) -> tuple[Tensor, Tensor]:
    a, b = calls_a.state, calls_b.state
    inputs = torch.bmm(a["a"], b["a"].transpose(1, 2))
    grads = torch.bmm(a["g"], b["g"].transpose(1, 2))
    return gram_product(inputs, grads, (a["a"].norm(dim=2), b["a"].norm(dim=2)),
                        (a["g"].norm(dim=2), b["g"].norm(dim=2)), a["a"].shape[2],
                        a["g"].shape[2])


def _embedding_linear(embedding: Use, calls_e: LayerCalls, linear: Use,
                      calls_l: LayerCalls) -> tuple[Tensor, Tensor]:
    ids, rows = calls_e.state["ids"], calls_e.state["g"]  # [B, S], [B, S, d]
    a, g = calls_l.state["a"], calls_l.state["g"]  # [B, T, d], [B, T, V]
    picked = g.gather(2, ids.unsqueeze(1).expand(-1, g.shape[1], -1))  # G_t[id_s]: [B, T, S]
    return gathered_product(picked, torch.bmm(a, rows.transpose(1, 2)),
                            (a.norm(dim=2), rows.norm(dim=2)), a.shape[2])


def _embedding_embedding(first: Use, calls_a: LayerCalls, second: Use,
                         calls_b: LayerCalls) -> tuple[Tensor, Tensor]:
    rows_a, rows_b = calls_a.state["g"], calls_b.state["g"]
    same_id = calls_a.state["ids"].unsqueeze(2) == calls_b.state["ids"].unsqueeze(1)
    return gathered_product(same_id, torch.bmm(rows_a, rows_b.transpose(1, 2)),
                            (rows_a.norm(dim=2), rows_b.norm(dim=2)), rows_a.shape[2])


# Exact rule types and the slot each use is in: a subclass (a convolution, GPT-2's
# transposed Conv1D, LSG's carriers) lays its weight out differently and takes the
# materialized term or is refused.
_TOKEN_PAIR_TERMS: dict[tuple[tuple[type, str], tuple[type, str]], CrossTerm] = {
    ((LinearRule, "weight"), (LinearRule, "weight")): _linear_linear,
    ((EmbeddingRule, "weight"), (LinearRule, "weight")): _embedding_linear,
    ((EmbeddingRule, "weight"), (EmbeddingRule, "weight")): _embedding_embedding,
}
