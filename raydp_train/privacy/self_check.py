"""The engine checked against the slow way, on the user's own model (`privacy.self_check`).

The one-backward engine (clipping.py) is exact on every pattern its rules know; a model can
hold a pattern nobody foresaw. So on a few examples of a real micro-batch, before anything is
released, the engine's per-example norms and clipped sum are compared with one backward pass
per example (the definition of §2.1):

    g_j    = grad of loss_j, alone                      (autograd, one example at a time)
    n_j    = ||g_j||,   sum = sum_j min(1, C / n_j) g_j

in the engine's own slots (LSG's carriers: `Rule.slots_from_gradients`). Example j's forward
runs alone in a batch of the engine's shape: every row a copy of example j, loss_j taken at
row j. So a model that mixes examples still shows it (its batch holds example j alone), and
row j rounds exactly as in the engine's forward: a forward of one example rounds otherwise,
and a ReLU input within rounding of 0 then takes the other branch -- the true gradient of
another forward, which the check took for an engine error (a false alarm that stopped a sweep
in CI). Both run in eval mode (dropout off: two forwards would draw different masks). A
disagreement beyond the tolerance of the forward's dtype names the parameters: those whose
clipped sums differ, and those whose share of the norm differs (each layer with the layers it
shares parameters with, against the same parameters' slow share).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from raydp_train.errors import UserError
from raydp_train.privacy.clipping import PerExampleClipper


class SelfCheckError(UserError, RuntimeError):
    """The engine disagrees with one backward pass per example on this model."""


@dataclass
class SelfCheckReport:
    examples: int
    tolerance: float
    norm_error: float = 0.0  # max over examples of |n_engine - n_slow| / max n_slow
    sum_error: float = 0.0  # ||sum_engine - sum_slow|| / ||sum_slow||
    norm_parameters: list[str] = field(default_factory=list)  # whose share of a norm differs
    sum_parameters: list[str] = field(default_factory=list)  # whose clipped sum differs
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.norm_error <= self.tolerance and self.sum_error <= self.tolerance

    def message(self) -> str:
        named = "; ".join(part for part in (
            self.norm_parameters and f"per-example norms differ in {_listed(self.norm_parameters)}",
            self.sum_parameters and f"clipped sums differ in {_listed(self.sum_parameters)}",
        ) if part) or "the difference is spread over every parameter"
        return (
            f"privacy.self_check: the clipping engine disagrees with one backward pass per "
            f"example on this model ({self.examples} examples; norms off by "
            f"{self.norm_error:.2g}, clipped sum by {self.sum_error:.2g}, tolerance "
            f"{self.tolerance:.2g}): {named}. Nothing was released. The model holds a pattern "
            "the engine does not handle; freeze or rewrite those parameters' layers, and "
            "please report the model"
        )


def tolerance(dtype: torch.dtype) -> float:
    """Half the digits of the forward's dtype: sqrt(eps) (fp32 3.5e-4, bf16 0.088, fp64 1.5e-8)."""
    return torch.finfo(dtype).eps ** 0.5


def compare_with_per_example(
    clipper: PerExampleClipper, compute_losses: Callable[..., Tensor], args: tuple,
    examples: int = 2, forward_dtype: torch.dtype | None = None,
) -> SelfCheckReport:
    """The engine on the first `examples` examples of the micro-batch `args` (every tensor
    sliced along its first axis) against one backward each. The engine's buffer, the
    parameters' gradients and the model's train/eval mode are left as they were. Memory: a
    few copies of the flat buffer, never one per example."""
    started = time.perf_counter()
    batch = _first_examples(args, examples)
    count = max(_batch_size(batch), 0)
    report = SelfCheckReport(count, tolerance(forward_dtype or clipper.flat_grad.dtype))
    if count == 0:
        return report
    model, saved = clipper.model, clipper.flat_grad.clone()
    training = model.training
    model.eval()
    try:
        clipper.flat_grad.zero_()
        engine_norms = clipper.accumulate(compute_losses, *batch).norms
        engine_sum, parts = clipper.flat_grad.clone(), clipper.last_norm_parts
        slow = _slow_way(clipper, compute_losses, batch, count)
    finally:
        clipper.flat_grad.copy_(saved)
        clipper.bind_grads()
        model.train(training)
    _compare(clipper, report, engine_norms, engine_sum, parts, slow)
    report.seconds = time.perf_counter() - started
    return report


@dataclass
class _SlowWay:
    norms: Tensor  # [K], float64
    clipped_sum: Tensor  # like the flat buffer
    group_squares: Tensor  # [K, groups], float64: each group's share of ||g_j||^2
    groups: list  # the layer groups (joined by shared parameters) and their named slots


def _slow_way(clipper, compute_losses, batch: tuple, count: int) -> _SlowWay:
    """One backward per example: its norm, its share of each group, the clipped sum (norms
    summed slot by slot: one float32 norm over millions of numbers can be off by 1e-4)."""
    groups = [(modules, _group_slots(clipper, modules)) for modules in _groups(clipper)]
    clipped_sum = torch.zeros_like(clipper.flat_grad)
    squares = torch.zeros(count, len(groups), dtype=torch.float64)
    for j in range(count):
        gradient = clipper.slot_vector(_gradients(clipper, compute_losses, batch, j))
        for k, (_, slots) in enumerate(groups):
            squares[j, k] = sum(_square(clipper.slot_in(gradient, module, slot))
                                for _, module, slot in slots)
        norm = squares[j].sum().sqrt()
        factor = clipper.clip_norm / max(float(norm), clipper.clip_norm)
        clipped_sum.add_(gradient, alpha=factor)
    return _SlowWay(squares.sum(1).sqrt(), clipped_sum, squares, groups)


def _square(values: Tensor) -> float:
    """||values||^2 of one slot (torch's cascade sum: ~5e-8 relative over 8M float32 numbers,
    where a BLAS dot drifts by 1e-4), summed over slots in Python's float64."""
    return float(values.square().sum())


def _compare(clipper, report: SelfCheckReport, engine_norms: Tensor, engine_sum: Tensor,
             parts, slow: _SlowWay) -> None:
    # Norms matter through the clip factor min(1, C / norm): an error counts relative to the
    # largest norm or C, whichever is larger (all-zero gradients, e.g. one class, are exact
    # however tiny the engine's rounding is).
    scale = max(float(slow.norms.max()), clipper.clip_norm)
    report.norm_error = float((engine_norms.double().cpu() - slow.norms).abs().max()) / scale
    expected = slow.clipped_sum
    total = max(_square(expected), 1e-60) ** 0.5
    report.sum_error = _square(engine_sum - expected) ** 0.5 / total
    if report.passed:
        return
    report.sum_parameters = list(dict.fromkeys(
        name for name, module, slot in _slots(clipper)
        if _square(clipper.slot_in(engine_sum, module, slot)
                   - clipper.slot_in(expected, module, slot)) ** 0.5 > report.tolerance * total
    ))
    report.norm_parameters = list(dict.fromkeys(
        _norm_mismatches(clipper, parts, slow, scale**2, report.tolerance)))


def _norm_mismatches(clipper, parts, slow: _SlowWay, scale: float, tol: float) -> list[str]:
    """The parameters of each group of layers (joined by shared parameters) whose squared
    norm, as the engine summed it, differs from the same slots' slow squared norm; a group's
    shared parameters first."""
    mismatched = []
    for k, (modules, slots) in enumerate(slow.groups):
        engine = sum((parts.layers[m].double().cpu() for m in modules if m in parts.layers),
                     torch.zeros(slow.norms.shape[0], dtype=torch.float64))
        engine = engine + sum((term.double().cpu() for tie, term in parts.ties
                               if tie.uses[0].module in modules), torch.zeros_like(engine))
        if float((engine - slow.group_squares[:, k]).abs().max()) / scale > tol:
            shared = [tie.parameter_name for tie in clipper.ties if tie.uses[0].module in modules]
            mismatched += shared + [name for name, _, _ in slots]
    return mismatched


def _group_slots(clipper, modules: set) -> list[tuple[str, nn.Module, str]]:
    """The named slots of a group of layers, a shared parameter's one slot once."""
    slots = {}
    for name, module, slot in _slots(clipper):
        if module in modules:
            slots.setdefault(clipper.slots[module][slot].storage_offset(), (name, module, slot))
    return list(slots.values())


def _groups(clipper) -> list[set[nn.Module]]:
    """The covered layers, joined into one group wherever they share a parameter."""
    groups = [{module} for _, module, _ in clipper.layers]
    for tie in clipper.ties:
        joined = [g for g in groups if any(use.module in g for use in tie.uses)]
        groups = [g for g in groups if g not in joined] + [set().union(*joined)]
    return groups


def _slots(clipper) -> list[tuple[str, nn.Module, str]]:
    """(the parameter's name, module, slot) of every slot; a slot that is no parameter (LSG's
    carriers) is named after its module."""
    labels = {module: label for label, module, _ in clipper.layers}
    named = []
    for module, slots in clipper.slots.items():
        for slot in slots:
            param = module._parameters.get(slot)
            name = clipper.parameter_name(param) if param is not None else None
            named.append((name or f"{labels[module]}.{slot}", module, slot))
    return named


def _gradients(clipper, compute_losses, batch: tuple, j: int) -> dict[int, Tensor]:
    """Example j's gradients of the trained parameters, by autograd alone: its loss in a
    batch of `batch`'s shape that holds it alone (the engine's hooks record nothing outside
    its own passes)."""
    loss = compute_losses(*_alone(batch, j))[j]
    if not loss.requires_grad:
        return {}
    grads = torch.autograd.grad(loss, clipper.parameters, allow_unused=True)
    return {id(p): g for p, g in zip(clipper.parameters, grads) if g is not None}


def _alone(value, j: int):
    """Every tensor in `value` with each example along its first axis replaced by example j;
    same shape and strides, so row j computes as it did."""
    return _each_tensor(value, lambda t: torch.empty_like(t).copy_(t[j:j + 1].expand_as(t)))


def _first_examples(value, stop: int):
    """Every tensor in `value` sliced [:stop]."""
    return _each_tensor(value, lambda t: t[:stop])


def _each_tensor(value, change: Callable[[Tensor], Tensor]):
    """`value` with `change` applied to every tensor of at least one axis in it (nested
    tuples and lists too)."""
    if isinstance(value, Tensor) and value.dim() > 0:
        return change(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_each_tensor(v, change) for v in value)
    return value


def _batch_size(value) -> int:
    if isinstance(value, Tensor) and value.dim() > 0:
        return value.shape[0]
    if isinstance(value, (tuple, list)):
        return next((n for n in map(_batch_size, value) if n >= 0), -1)
    return -1


def _listed(names: list[str], shown: int = 8) -> str:
    quoted = ", ".join(f"'{name}'" for name in names[:shown])
    return quoted + (f" and {len(names) - shown} more" if len(names) > shown else "")
