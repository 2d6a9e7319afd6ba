"""The slow way: each chosen example's gradient by one backward pass of its own, laid out
in the clipping engine's slots (§2.3), for the self-check (self_check.py).

The batch's forward runs once, from the engine's random state and in its shape, so each row
rounds and draws its dropout mask as in the engine's forward (a batch of 1 rounds otherwise:
a ReLU input within rounding of 0 takes the other branch); then one backward per example.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from raydp_train.privacy.owned_parameters import owned_parameters
from raydp_train.privacy.random_state import restore_random_state
from raydp_train.privacy.sharding import weights_held


@dataclass
class SlowWay:
    norms: Tensor  # [K], float64
    gradients: list[Tensor]  # each chosen example's gradient, laid out as the flat buffer
    group_squares: Tensor  # [K, groups], float64: each group's share of ||g_j||^2
    groups: list  # the layer groups (joined by shared parameters) and their named slots


def slow_way(clipper, compute_losses, batch: tuple, chosen: list[int], state) -> SlowWay:
    """One forward of the batch (from the engine's random state: the same dropout masks),
    then one backward per chosen example: its gradient, norm and share of each group (norms
    summed slot by slot: one float32 norm over millions of numbers can be off by 1e-4)."""
    groups = [(modules, group_slots(clipper, modules)) for modules in layer_groups(clipper)]
    squares = torch.zeros(len(chosen), len(groups), dtype=torch.float64)
    gradients = []
    restore_random_state(state)
    with weights_held(clipper.model):  # sharded: the gathered weights are the ones differentiated
        losses = compute_losses(*batch)
        for row, j in enumerate(chosen):
            last = row == len(chosen) - 1
            gradient = clipper.slot_vector(example_gradients(clipper, losses[j], not last))
            for k, (_, members) in enumerate(groups):
                squares[row, k] = sum(square(clipper.slot_in(gradient, module, slot))
                                      for _, module, slot in members)
            gradients.append(gradient)
    return SlowWay(squares.sum(1).sqrt(), gradients, squares, groups)


def square(values: Tensor) -> float:
    """||values||^2 of one slot (torch's cascade sum: ~5e-8 relative over 8M float32 numbers,
    where a BLAS dot drifts by 1e-4), summed over slots in Python's float64."""
    return float(values.square().sum())


def group_slots(clipper, modules: set) -> list[tuple[str, nn.Module, str]]:
    """The named slots of a group of layers, a shared parameter's one slot once."""
    slots = {}
    for name, module, slot in named_slots(clipper):
        if module in modules:
            slots.setdefault(clipper.slots[module][slot].storage_offset(), (name, module, slot))
    return list(slots.values())


def layer_groups(clipper) -> list[set[nn.Module]]:
    """The covered layers, joined into one group wherever they share a parameter."""
    groups = [{module} for _, module, _ in clipper.layers]
    for tie in clipper.ties:
        joined = [g for g in groups if any(use.module in g for use in tie.uses)]
        groups = [g for g in groups if g not in joined] + [set().union(*joined)]
    return groups


def named_slots(clipper) -> list[tuple[str, nn.Module, str]]:
    """(the parameter's name, module, slot) of every slot; a slot that is no parameter (LSG's
    carriers) is named after its module."""
    labels = {module: label for label, module, _ in clipper.layers}
    named = []
    for module, slots in clipper.slots.items():
        for slot in slots:
            param = owned_parameters(module).get(slot)
            name = clipper.parameter_name(param) if param is not None else None
            named.append((name or f"{labels[module]}.{slot}", module, slot))
    return named


def example_gradients(clipper, loss: Tensor, keep_graph: bool) -> dict[int, Tensor]:
    """One example's loss differentiated by autograd alone, with respect to the trained
    parameters (the engine's hooks record nothing outside its own passes)."""
    if not loss.requires_grad:
        return {}
    # The covered layers' parameters as they are now: under sharding, the gathered ones.
    params = list({id(p): p for _, module, _ in clipper.layers
                   for p in owned_parameters(module).values()}.values())
    grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=keep_graph)
    return {id(p): g for p, g in zip(params, grads) if g is not None}


def each_tensor(value, change: Callable[[Tensor], Tensor]):
    """`value` with `change` applied to every tensor of at least one axis in it (nested
    tuples and lists too)."""
    if isinstance(value, Tensor) and value.dim() > 0:
        return change(value)
    if isinstance(value, (tuple, list)):
        return type(value)(each_tensor(v, change) for v in value)
    return value


def batch_size(value) -> int:
    if isinstance(value, Tensor) and value.dim() > 0:
        return value.shape[0]
    if isinstance(value, (tuple, list)):
        return next((n for n in map(batch_size, value) if n >= 0), -1)
    return -1
