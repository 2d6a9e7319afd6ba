"""The engine checked against the slow way, on the user's own model (`privacy.self_check`).

The one-backward engine (clipping.py) is exact on every pattern its rules know; a model can
hold a pattern nobody foresaw, or mix the examples of a batch. So on a real micro-batch,
before anything of it is released, the check tests the invariant the privacy analysis rests
on, for a set J of examples drawn at random from the batch:

    S(batch) - S(batch without J) = sum_{j in J} c_j g_j,   c_j <= min(1, C / ||g_j||)

where S is the engine's clipped sum, c_j its clip factor for j and g_j = grad of loss_j
computed the slow way (autograd, one backward per example). "Without J": their losses weigh
nothing and their inputs are replaced by other rows', so nothing of them is left in the
batch; a model that mixes examples (in training mode only, from row 2 on, by any means)
changes the other rows' gradients and fails the equation. One more pass removes a random half
H of the rows at once: every other row's per-example norm must stay as it was, and the rows of
H must get none (a kept row's loss reaching a removed row's activations mixes them). A last
pass weighs every row's loss by its own random w_i: every row's norm must scale by w_i, which
any gradient crossing from one row's loss to another row's activations breaks, for every
pair of rows at once.

Every pass runs in the model's own mode (training, dropout on) from the same random state and
in the batch's shape, so each row draws the same dropout mask and rounds alike in every pass;
the full pass IS the micro-batch's release (`keep_pass`), and the random state after the
check is the one after that pass. A disagreement beyond the tolerance of the forward's dtype
names the parameters: those whose share of the removal differs, and those whose share of the
norm differs (each layer with the layers it shares parameters with). The engine may clip
more than the slow norm asks (its clip factor adds a bound on the rounding of Gram forms),
never less.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from raydp_train.errors import UserError
from raydp_train.privacy.clipping import MicroBatchStats, PerExampleClipper
from raydp_train.privacy.random_state import random_state, restore_random_state
from raydp_train.privacy.slow_gradients import (
    SlowWay,
    batch_size,
    each_tensor,
    named_slots,
    slow_way,
    square,
)


class SelfCheckError(UserError, RuntimeError):
    """The engine's clipped sum does not behave as one clipped gradient per example."""


@dataclass
class SelfCheckReport:
    examples: int
    tolerance: float
    norm_error: float = 0.0  # max |engine - slow| / max(slow norm, C): engine norm too large,
    #                          or its clip basis below the slow norm
    sum_error: float = 0.0  # ||S(batch) - S(batch without J) - sum_J c_j g_j|| / C
    sensitivity: float = 0.0  # max over j in J of c_j ||g_j|| / C
    mixing_error: float = 0.0  # removing half the rows: max change of another row's norm
    norm_parameters: list[str] = field(default_factory=list)  # whose share of a norm differs
    sum_parameters: list[str] = field(default_factory=list)  # whose leave-one-out differs
    seconds: float = 0.0
    release_seconds: float = 0.0  # of `seconds`, the full pass (the micro-batch's release)
    stats: MicroBatchStats | None = None  # the full pass's, when it was kept as the release

    @property
    def passed(self) -> bool:
        return (max(self.norm_error, self.sum_error, self.mixing_error) <= self.tolerance
                and self.sensitivity <= 1 + self.tolerance)

    def message(self) -> str:
        named = "; ".join(part for part in (
            self.norm_parameters and f"per-example norms differ in {_listed(self.norm_parameters)}",
            self.sum_parameters and "removing the examples changes the clipped sum in "
            f"{_listed(self.sum_parameters)}",
        ) if part) or "the difference is spread over every parameter"
        return (
            f"privacy.self_check: removing one example from the batch does not remove exactly "
            f"its own clipped gradient ({self.examples} examples drawn at random, the largest "
            f"{self.sensitivity:.3g} C; the sum without them off by {self.sum_error:.2g} C; "
            f"norms off by {self.norm_error:.2g}; removing half the batch moved the other "
            f"rows' norms by {self.mixing_error:.2g}; tolerance {self.tolerance:.2g}): {named}. "
            "Nothing was released. The model mixes the examples of a batch (batch statistics, "
            "in-batch negatives, rolling or centring over the batch, in training mode too) or "
            "holds a pattern the engine does not handle; compute each example's output from "
            "that example alone, or freeze those parameters' layers, and please report the model"
        )


def tolerance(dtype: torch.dtype) -> float:
    """Half the digits of the forward's dtype: sqrt(eps) (fp32 3.5e-4, bf16 0.088, fp64 1.5e-8)."""
    return torch.finfo(dtype).eps ** 0.5


def compare_with_per_example(
    clipper: PerExampleClipper, compute_losses: Callable[..., Tensor], args: tuple,
    examples: int = 2, forward_dtype: torch.dtype | None = None,
    chooser: random.Random | None = None, keep_pass: bool = False,
) -> SelfCheckReport:
    """The engine on the micro-batch `args` (its tensors' first axis is the example axis)
    against the slow way, for `examples` rows drawn by `chooser` (default: from os.urandom).

    `keep_pass`: the full pass's clipped sum stays added to the engine's buffer (and its stats
    in `report.stats`), as `clipper.accumulate` would have left it; otherwise the buffer is
    left as it was. Parameters' gradients and the model's mode are left as they were."""
    started = time.perf_counter()
    count = max(batch_size(args), 0)
    chosen = _choose(count, examples, chooser)
    report = SelfCheckReport(len(chosen), tolerance(forward_dtype or clipper.flat_grad.dtype))
    saved, first_state = clipper.flat_grad.clone(), random_state()
    try:
        clipper.flat_grad.zero_()
        stats = clipper.accumulate(compute_losses, *args)
        full, after_state = clipper.flat_grad.clone(), random_state()
        report.release_seconds = time.perf_counter() - started
        basis = clipper.last_clip_basis
        factors = clipper.last_clip_factors
        parts = clipper.last_norm_parts
        removed = _removal(clipper, compute_losses, args, chosen, chooser, first_state, full)[0]
        report.mixing_error = max(
            _half_removed(clipper, compute_losses, args, chooser, first_state, full,
                          stats.norms),
            _reweighted(clipper, compute_losses, args, chooser, first_state, stats.norms))
        slow = slow_way(clipper, compute_losses, args, chosen, first_state)
    finally:
        clipper.flat_grad.copy_(saved)
        clipper.bind_grads()
    restore_random_state(after_state)
    if keep_pass:
        clipper.flat_grad.add_(full)
        report.stats = stats
    _compare(clipper, report, chosen, stats.norms, basis, factors, parts, removed, slow, full)
    report.seconds = time.perf_counter() - started
    return report


def check_rule(model: nn.Module, per_example_loss: Callable[..., Tensor], features: Tensor,
               labels: Tensor, clip_norm: float = 1.0) -> SelfCheckReport:
    """The engine on `model` against one backward pass per example, on every example of the
    batch: the test of a rule of your own (`register_rule`). `per_example_loss(model,
    features, labels)` returns [B] losses. `report.passed`, or `report.message()` says what
    differs. Run it in float64 (torch.set_default_dtype) to see the method, not rounding."""
    clipper = PerExampleClipper(model, clip_norm)
    try:
        return compare_with_per_example(clipper, per_example_loss, (model, features, labels),
                                        examples=features.shape[0])
    finally:
        clipper.close()


def _choose(count: int, examples: int, chooser: random.Random | None) -> list[int]:
    chooser = chooser or random.Random(os.urandom(16))
    return sorted(chooser.sample(range(count), min(examples, count)))


def _removal(clipper, compute_losses, args: tuple, rows: list[int], chooser, state,
             full: Tensor) -> tuple[Tensor, Tensor]:
    """S(batch) - S(batch without `rows`), and the per-example norms of the pass without them:
    each removed row's input replaced by a kept row's, its loss weighing nothing, from the
    same random state as the full pass."""
    count = batch_size(args)
    kept = [k for k in range(count) if k not in rows]
    if not kept:
        return full.clone(), torch.zeros(count)
    chooser = chooser or random.Random(os.urandom(16))
    batch = args
    for j in rows:
        batch = _replaced(batch, j, chooser.choice(kept))

    def losses_without(*batch) -> Tensor:
        losses = compute_losses(*batch)
        weighed = torch.ones_like(losses, dtype=torch.bool)
        weighed[rows] = False
        return torch.where(weighed, losses, torch.zeros_like(losses))

    clipper.flat_grad.zero_()
    restore_random_state(state)
    norms = clipper.accumulate(losses_without, *batch).norms
    return full - clipper.flat_grad, norms


def _half_removed(clipper, compute_losses, args: tuple, chooser, state, full: Tensor,
                  norms: Tensor) -> float:
    """Remove a random half of the rows at once: the largest change of a kept row's norm, or
    norm of a removed row, relative to max(largest norm, C)."""
    count = batch_size(args)
    if count < 2:
        return 0.0
    removed = _choose(count, count // 2, chooser)
    _, after = _removal(clipper, compute_losses, args, removed, chooser, state, full)
    expected = norms.clone()
    expected[removed] = 0
    changed = float((after - expected).abs().max())
    return changed / max(float(norms.max()), clipper.clip_norm)


def _reweighted(clipper, compute_losses, args: tuple, chooser, state, norms: Tensor) -> float:
    """Every row's loss weighed by its own random w_i in [0.5, 2): without mixing, row i's
    gradient is w_i times its own, so its norm must be w_i n_i. Any loss whose gradient
    reaches another row's activations (a roll, a permutation, a batch mean: mixing after a
    trained layer) moves a norm off that, whichever rows it joins: one pass for every pair."""
    count = batch_size(args)
    if count < 2:
        return 0.0
    chooser = chooser or random.Random(os.urandom(16))
    weights = torch.tensor([chooser.uniform(0.5, 2.0) for _ in range(count)])

    def weighed_losses(*batch) -> Tensor:
        losses = compute_losses(*batch)
        return losses * weights.to(losses.device, losses.dtype)

    clipper.flat_grad.zero_()
    restore_random_state(state)
    after = clipper.accumulate(weighed_losses, *args).norms
    expected = norms * weights.to(norms.device, norms.dtype)
    changed = float((after - expected).abs().max())
    return changed / max(float(expected.max()), clipper.clip_norm)


def _compare(clipper, report: SelfCheckReport, chosen: list[int], engine_norms: Tensor,
             basis: Tensor, factors: Tensor, parts, removed: Tensor, slow: SlowWay,
             full: Tensor) -> None:
    if not chosen:
        return
    clip_norm = clipper.clip_norm
    # Norms matter through the clip factor min(1, C / norm): an error counts relative to the
    # largest norm or C, whichever is larger (all-zero gradients are exact however tiny the
    # engine's rounding is). The engine may clip more than the slow norm asks, never less.
    scale = max(float(slow.norms.max()), clip_norm)
    rows = torch.tensor(chosen)
    reported, clip_basis = engine_norms[rows].double().cpu(), basis[rows].double().cpu()
    over = (reported - slow.norms).clamp(min=0)
    under = (slow.norms - clip_basis).clamp(min=0)
    report.norm_error = float(torch.maximum(over, under).max()) / scale
    # Summing B rows rounds by about eps ||S||: removing rows moves that rounding too.
    allowance = 4 * torch.finfo(full.dtype).eps * square(full) ** 0.5 / clip_norm
    expected = sum(slow.gradients[row] * float(factors[j]) for row, j in enumerate(chosen))
    error = square(removed - expected) ** 0.5 / clip_norm
    report.sum_error = max(error - allowance, 0.0)
    report.sensitivity = max(float(factors[j]) * float(slow.norms[row])
                             for row, j in enumerate(chosen)) / clip_norm
    wrong_slots = set()
    if report.sum_error > report.tolerance:
        wrong_slots = {
            name for name, module, slot in named_slots(clipper)
            if square(clipper.slot_in(removed, module, slot)
                      - clipper.slot_in(expected, module, slot)) ** 0.5
            > report.tolerance * clip_norm
        }
    if report.passed:
        return
    report.sum_parameters = sorted(wrong_slots)
    report.norm_parameters = list(dict.fromkeys(
        _norm_mismatches(clipper, parts, rows, slow, scale**2, report.tolerance)))


def _norm_mismatches(clipper, parts, rows: Tensor, slow: SlowWay, scale: float,
                     tol: float) -> list[str]:
    """The parameters of each group of layers (joined by shared parameters) whose squared
    norm, as the engine summed it, differs from the same slots' slow squared norm; a group's
    shared parameters first."""
    mismatched = []
    for k, (modules, members) in enumerate(slow.groups):
        engine = sum((parts.layers[m][rows].double().cpu() for m in modules
                      if m in parts.layers), torch.zeros(len(rows), dtype=torch.float64))
        engine = engine + sum((term.value[rows].cpu() for term in parts.ties
                               if term.tie.uses[0].module in modules), torch.zeros_like(engine))
        if float((engine - slow.group_squares[:, k]).abs().max()) / scale > tol:
            shared = [tie.parameter_name for tie in clipper.ties if tie.uses[0].module in modules]
            mismatched += shared + [name for name, _, _ in members]
    return mismatched


def _replaced(value, j: int, k: int):
    """Every tensor in `value` with example j (along its first axis) replaced by example k."""
    def replace(t: Tensor) -> Tensor:
        copy = t.clone()
        copy[j] = t[k]
        return copy
    return each_tensor(value, replace)


def _listed(names: list[str], shown: int = 8) -> str:
    quoted = ", ".join(f"'{name}'" for name in names[:shown])
    return quoted + (f" and {len(names) - shown} more" if len(names) > shown else "")
