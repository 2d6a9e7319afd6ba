"""Calls shared by the examples (ARCHITECTURE.md §2.3): a module whose input has no example
axis (a relative position bias looked up with [T, T] bucket ids, or computed from no input at
all) returns one output O that the model broadcasts against every example. Example i's
gradient of the module's parameters is the VJP of the call at dL_i/dO, but a backward of the
batch only yields sum_i dL_i/dO. So each example's dL_i/dO comes from a backward of its own,
from its loss to the shared outputs only (the graph kept), before the batch's backward; the
per-example path (per_example_path.py) then pulls each back through the module. Exact for any
layout of the call, and B backwards dearer than a rule: the engine says so once, naming the
modules (freezing them avoids the cost).
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from raydp_train.privacy.per_example_path import PER_EXAMPLE_PATH
from raydp_train.privacy.rule_registry import LayerCalls, UnsupportedLayerError


def take_shared_path(layers: list, ties: list, shared: frozenset) -> list:
    """`layers` with each shared module's rule replaced by the per-example path."""
    for index, (name, module, rule) in enumerate(layers):
        if module not in shared or rule is PER_EXAMPLE_PATH:
            continue
        if any(use.module is module for tie in ties for use in tie.uses):
            raise UnsupportedLayerError(
                f"module '{name}' ({type(module).__name__}) is called without the examples "
                "and shares a parameter with another layer; untie it or freeze it")
        if rule.slot_shapes(module) != PER_EXAMPLE_PATH.slot_shapes(module):
            raise UnsupportedLayerError(
                f"module '{name}' ({type(module).__name__}) is called without the examples, "
                "and its rule keeps gradients of its own shape (LSG's carriers); freeze it")
        PER_EXAMPLE_PATH.check(module, name)
        layers[index] = (name, module, PER_EXAMPLE_PATH)
    named = [name for name, module, _ in layers if module in shared]
    if named:
        warnings.warn(
            f"modules {', '.join(named)} are called without the examples (a table shared by "
            "the batch): their per-example gradients take one backward per example; freeze "
            "them to avoid the cost", stacklevel=3)
    return layers


class SharedOutputs:
    """The output tensors of the shared calls of one pass, and the calls they belong to."""

    def __init__(self):
        self.entries: list[tuple[LayerCalls, int, list[Tensor]]] = []

    def add(self, calls: LayerCalls, index: int, tensors: list[Tensor]) -> None:
        self.entries.append((calls, index, tensors))

    def per_example_gradients(self, losses: Tensor) -> None:
        """Each shared call's output gradients as [B, *shape]: row i from example i's loss
        alone (None where no example's loss reaches that output)."""
        if not self.entries:
            return
        outputs = [t for _, _, tensors in self.entries for t in tensors]
        rows: list[list[Tensor | None]] = [[] for _ in outputs]
        for i in range(losses.shape[0]):
            grads = torch.autograd.grad(losses[i], outputs, retain_graph=True,
                                        allow_unused=True)
            for kept, grad in zip(rows, grads):
                kept.append(grad)
        stacked = iter([_stack(kept, output) for kept, output in zip(rows, outputs)])
        for calls, index, tensors in self.entries:
            calls.output_grads[index] = [next(stacked) for _ in tensors]
        self.entries = []


def _stack(grads: list[Tensor | None], output: Tensor) -> Tensor | None:
    if all(g is None for g in grads):
        return None
    return torch.stack([torch.zeros_like(output) if g is None else g.detach() for g in grads])
