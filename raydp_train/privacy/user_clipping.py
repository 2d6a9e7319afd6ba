"""User-level clipping: the user, not the row, is the example (ARCHITECTURE.md §2.14).

With `privacy.unit: user` each sampled user u contributes ONE clipped vector, the clipped sum
of the gradients of its rows R_u in the micro-batch (at most `privacy.rows_per_user` of them):

    g_u  = sum_{r in R_u} g_r                 ||g_u|| over ALL trained parameters jointly
    sum  = sum_u g_u min(1, C / ||g_u||)

or, with `privacy.user_contribution: mean`, g_u = (1/|R_u|) sum_{r in R_u} g_r (each row's
output gradient weighed by 1/|R_u|); either way one user moves the sum by at most C.

The norm of a sum is not the sum of the rows' norms. It is, for a Linear layer,
||sum_r G_r^T a_r||^2 = sum_{r,r'} <a_r a_r'^T, G_r G_r'^T>: the ghost norm of ONE example
whose tokens are the user's rows' tokens, one after the other. So the recorded inputs and
output gradients of every call, [B, ...] by row, are regrouped as [U, k, ...] (k: the most
rows any user of the micro-batch has; missing rows are zeros, whose output gradient is zero
and so adds nothing to any norm or sum), and every rule that reads the axes between the
examples and the features as tokens (`Rule.folds_examples`: Linear, Embedding, the norms,
GPT-2's Conv1D, LoRA, LSG's carriers) computes the users' norms and clipped sums exactly, as it
does for k folded rows an example. The rules that do not (convolutions, whose axes after the
examples are channels and space; rules that keep each call's arguments: the per-example path,
nn.MultiheadAttention, LSTM, EmbeddingBag) are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from raydp_train.privacy.rule_registry import LayerCalls, Rule, UnsupportedLayerError

UNITS = ("example", "user")
CONTRIBUTIONS = ("sum", "mean")  # privacy.user_contribution: a user's rows summed or averaged


def check_groupable(layers: list, unit: str = "user") -> str:
    """`unit`, after refusing (unit "user") by name a covered module whose rule cannot read a
    user's rows as tokens."""
    if unit not in UNITS:
        raise ValueError(f"privacy.unit must be one of {UNITS}, got {unit!r}")
    for name, module, rule in layers if unit == "user" else ():
        if not groups_rows(rule):
            raise UnsupportedLayerError(
                f"privacy.unit: user clips each user's summed gradient by reading the user's "
                f"rows as the tokens of one example, which the rule of module '{name}' "
                f"({type(module).__name__}) cannot do; freeze it (model.trainable), or set "
                "privacy.unit: example")
    return unit


def groups_rows(rule: Rule) -> bool:
    """Whether `rule` (LSG's carriers: the rule they wrap) reads [B, k, ...] as tokens."""
    base = getattr(rule, "base", rule)
    return bool(base.folds_examples) and not rule.records_call and not base.records_call


def user_layout(users: Tensor) -> Tensor:
    """[U, k] row indices, user by user in order of their ids; the padding index
    B marks a user's missing rows (k: the most rows of any user)."""
    rows = users.shape[0]
    _, user_of_row, counts = torch.unique(users, return_inverse=True, return_counts=True)
    order = torch.argsort(user_of_row, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(rows, device=users.device) - starts[user_of_row[order]]
    layout = torch.full((counts.numel(), int(counts.max())), rows, dtype=torch.int64,
                        device=users.device)
    layout[user_of_row[order], position] = order
    return layout


def group_by_user(used: list, calls: dict[nn.Module, LayerCalls], users: Tensor | None,
                  unit: str, contribution: str = "sum") -> int:
    """Regroup every used module's recorded calls from rows [B, ...] to users [U, k, ...] in
    place; returns U. A tensor several modules read (Q, K, V) is regrouped once, so they still
    share its Gram matrix. `contribution` "mean": each row's output gradient is weighed by
    1/k_u (k_u: its user's rows here); every parameter's gradient is linear in its layer's
    output gradient, so each user's gradient becomes its rows' mean, which is then clipped."""
    if contribution not in CONTRIBUTIONS:
        raise ValueError(f"privacy.user_contribution must be one of {CONTRIBUTIONS}, got "
                         f"{contribution!r}")
    if (users is None) != (unit == "example"):
        raise ValueError(f"privacy.unit {unit}: the engine needs the rows' user ids exactly "
                         "when the unit is user")
    check_groupable(used)
    layout = user_layout(users.to(torch.int64))
    regrouped: dict[tuple, Tensor] = {}
    rows = (layout < users.shape[0]).sum(1)  # k_u: each user's rows here, [U]

    def by_user(x: Tensor | None, weighed: bool = False) -> Tensor | None:
        if x is None:
            return None
        weighed = weighed and contribution == "mean"
        key = (x.data_ptr(), x.dtype, tuple(x.shape), x.stride(), weighed)
        if key not in regrouped:
            padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
            regrouped[key] = padded[layout.to(x.device)]
            if weighed:  # [U, k, ...] times 1/k_u (the padding rows are zeros already)
                scale = 1.0 / rows.to(x.device, x.dtype)  # in x's dtype: 1/3 exact to it
                regrouped[key] = regrouped[key] * scale.view(-1, 1, *[1] * (x.dim() - 1))
        return regrouped[key]

    for _, module, _ in used:
        recorded = calls[module]
        if any(x.shape[0] != users.shape[0] for x in recorded.inputs):
            raise ValueError(f"privacy.unit: user: {users.shape[0]} user ids for a micro-batch "
                             f"whose layer inputs have {recorded.inputs[0].shape[0]} rows")
        recorded.inputs = [by_user(x) for x in recorded.inputs]
        recorded.output_grads = [by_user(g, weighed=True) for g in recorded.output_grads]
        recorded.input_versions = [x._version for x in recorded.inputs]
    return layout.shape[0]


@contextmanager
def rows_as_examples(clipper) -> Iterator[None]:
    """The engine clipping rows, not users, for the length of a self-check: the check is of the
    rows (each row's own gradient, the model keeping rows apart); users only regroup them."""
    unit = getattr(clipper, "unit", None)  # None: an engine that clips nothing
    if unit is None:
        yield
        return
    clipper.unit = "example"
    try:
        yield
    finally:
        clipper.unit = unit
