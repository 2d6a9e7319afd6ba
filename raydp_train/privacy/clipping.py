"""Per-example clipped gradient sum in one forward and one backward (ARCHITECTURE.md §2.3).

    g~_i = g_i * min(1, C / ||g_i||)        ||g_i|| over ALL trainable parameters jointly
    sum  = sum_i g~_i                        written into each parameter's .grad

Forward hooks keep each covered layer's input; a tensor hook on its output keeps the output
gradient. During the private backward the covered parameters do not require grad ("ghost
differentiation"), so autograd computes activation gradients only and the layer rules form
the norms and the clipped sum from what the hooks kept. Every gradient slot (normally a
parameter's `.grad`) is a view of one flat buffer, so noise and all-reduce act on one tensor.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import Tensor, nn

# Importing these registers the built-in rules (lora: DP-LoRA's adapter layers).
from raydp_train.privacy import layer_rules, lora, rms_norm_families  # noqa: F401
from raydp_train.privacy.parameter_uses import ParameterUseAudit, ParameterUseError
from raydp_train.privacy.rule_registry import (
    LayerCalls,
    UnsupportedLayerError,
    cast_recorded,
    rule_for,
    supported_layers,
)
from raydp_train.privacy.tied_weights import cross_terms, find_ties

__all__ = [
    "BatchDimensionError", "MicroBatchStats", "ParameterUseError", "PerExampleClipper",
    "UnsupportedLayerError",
]


class BatchDimensionError(ValueError):
    """A layer saw a leading dimension that is not the example dimension."""


class MicroBatchStats(NamedTuple):
    losses: Tensor  # per-example losses, detached
    norms: Tensor  # per-example gradient norms before clipping


class PerExampleClipper:
    """Accumulates sum_i clip(g_i, C) over micro-batches into a flat gradient buffer."""

    def __init__(self, model: nn.Module, clip_norm: float, rules: dict | None = None):
        """`rules` overrides the rule of chosen modules (LSG's low-rank carriers)."""
        if not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
        self.model = model
        self.clip_norm = float(clip_norm)
        _refuse_batch_second(model)
        self.layers = _covered_layers(model, rules or {})
        self.ties = find_ties(self.layers)
        # A tied parameter is owned by several layers but trained (and slotted) once.
        owned = {id(p): p for _, module, _ in self.layers for p in _own_trainable(module)}
        self.parameters = list(owned.values())
        if not self.parameters:
            raise ValueError("the model has no trainable parameters")
        _check_uniform(self.parameters)
        first = self.parameters[0]
        self.flat_grad, self.slots = _slot_views(self.layers, first)
        bound = {
            id(module._parameters[name]): (module._parameters[name], view)
            for module, named in self.slots.items()
            for name, view in named.items()
            if module._parameters.get(name) is not None
        }
        self._bound = list(bound.values())
        self._calls: dict[nn.Module, LayerCalls] = {}
        self._audit = ParameterUseAudit(model, {module: name for name, module, _ in self.layers})
        self._audited_patterns: set[tuple] = set()
        self._recording = False
        self._ghost_leaf = torch.zeros((), dtype=first.dtype, device=first.device)
        self._ghost_leaf.requires_grad_(True)
        self._handles = [
            module.register_forward_hook(self._on_forward, with_kwargs=True)
            for _, module, _ in self.layers
        ]

    # ------------------------------------------------------------------ public
    def accumulate(self, compute_losses: Callable[..., Tensor], *args) -> MicroBatchStats:
        """Run forward + backward of one micro-batch; add its clipped sum to `flat_grad`.

        `compute_losses(*args)` runs the model and returns the per-example loss vector [B]
        (the engine owns the reduction). The first micro-batch, and any later one whose layer
        calls differ from every audited one, is audited (parameter_uses.py): a trained
        parameter used outside its layer's forward is refused before anything is summed.
        """
        self.bind_grads()
        audit = not self._audited_patterns
        random_state = _random_state()
        losses = self._forward_backward(compute_losses, args, audit)
        if not audit and losses.shape[0] and self._call_pattern() not in self._audited_patterns:
            # The layers were called in a way no audited pass saw: run this one again, audited,
            # with the same random draws (dropout), so the result is that of a single pass.
            audit = True
            _restore_random_state(random_state)
            losses = self._forward_backward(compute_losses, args, audit)
        try:
            if losses.shape[0] == 0:  # an empty micro-batch adds nothing
                return MicroBatchStats(losses.detach(), losses.detach().clone())
            if audit:
                self._audited_patterns.add(self._call_pattern())
            return MicroBatchStats(losses.detach(), self._clip_and_sum(losses.shape[0]))
        finally:
            self._calls = {}

    def bind_grads(self) -> Tensor:
        """(Re)bind every `.grad` to the flat buffer and return it. Binding at the start of a
        step means even a step over an empty sample hands the optimizer the buffer (its noise)."""
        for p, view in self._bound:
            if p.grad is not view:
                p.grad = view
        return self.flat_grad

    def zero_grad(self) -> None:
        self.bind_grads().zero_()

    @property
    def num_parameters(self) -> int:
        return self.flat_grad.numel()

    def close(self) -> None:
        """Remove the hooks; the model trains normally again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ hooks
    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Tensor):
        if not self._recording or not isinstance(output, Tensor):
            return None
        layer_input = _layer_input(module, args, kwargs)
        calls = self._calls.setdefault(module, LayerCalls())
        call_index = len(calls.inputs)
        calls.inputs.append(layer_input.detach())
        calls.input_versions.append(layer_input._version)
        calls.output_grads.append(None)
        if not output.requires_grad:
            # Covered parameters do not require grad here, so nothing before this layer
            # does either: join the graph through a zero leaf so the backward reaches us.
            output = output + self._ghost_leaf

        shape = output.shape

        def keep_grad(grad: Tensor) -> None:
            calls.output_grads[call_index] = grad.detach().reshape(shape)

        return _hooked_output(output, keep_grad)

    def _forward_backward(self, compute_losses: Callable[..., Tensor], args: tuple,
                          audit: bool) -> Tensor:
        """One forward and backward under the hooks; the per-example losses."""
        self._calls = {}
        context = self._audited_differentiation() if audit else self._ghost_differentiation()
        with context:
            losses = compute_losses(*args)
            self._check_losses(losses)
            if losses.shape[0]:
                self._backward(losses)
        return losses

    def _backward(self, losses: Tensor) -> None:
        try:
            losses.sum().backward()
        except RuntimeError:
            # Autograd refuses a tensor it saved and the model then changed in place; when
            # that tensor is a layer's input, say which layer.
            self._check_inputs_unchanged()
            raise

    def _call_pattern(self) -> tuple:
        return tuple((id(module), len(calls.inputs)) for module, calls in self._calls.items())

    @contextmanager
    def _ghost_differentiation(self) -> Iterator[None]:
        for p in self.parameters:
            p.requires_grad_(False)
        self._recording = True
        try:
            yield
        finally:
            self._recording = False
            for p in self.parameters:
                p.requires_grad_(True)
            self._ghost_leaf.grad = None

    @contextmanager
    def _audited_differentiation(self) -> Iterator[None]:
        """The covered parameters keep requiring grad, so the audit sees every differentiable
        use of them; autograd's own (unclipped) gradients are thrown away afterwards."""
        for p in self.parameters:
            p.grad = None  # autograd must not add into the flat buffer
        self._recording = True
        try:
            with self._audit.watching():
                yield
        finally:
            self._recording = False
            for p in self.parameters:
                p.grad = None
            self.bind_grads()

    # ------------------------------------------------------------------ math
    def _clip_and_sum(self, batch_size: int) -> Tensor:
        used = self._used_layers(batch_size)
        # A forward under autocast (bf16) records bfloat16 tensors; the norms decide the clip
        # factors the privacy guarantee rests on, so they are computed in the parameters' dtype.
        cast_recorded([self._calls[module] for _, module, _ in used], self.flat_grad.dtype)
        with torch.autocast(self.flat_grad.device.type, enabled=False):
            return self._clip_and_sum_recorded(used, batch_size)

    def _clip_and_sum_recorded(self, used: list, batch_size: int) -> Tensor:
        squared = self.flat_grad.new_zeros(batch_size)
        gram_cache: dict = {}
        for _, module, rule in used:
            slots = self.slots[module]
            squared = squared + rule.squared_norms(module, self._calls[module], slots, gram_cache)
        used_calls = {module: self._calls[module] for _, module, _ in used}
        squared = squared + cross_terms(self.ties, used_calls, squared)
        # The Gram shortcut <a a^T, G G^T> can cancel to a tiny negative number.
        norms = squared.clamp(min=0).sqrt()
        clip_factors = self.clip_norm / norms.clamp(min=self.clip_norm)
        for _, module, rule in used:
            rule.add_clipped_sum(module, self._calls[module], clip_factors, self.slots[module])
        return norms

    def _used_layers(self, batch_size: int) -> list:
        """Layers that took part in the loss, after checking their example dimension."""
        self._check_inputs_unchanged()
        used = []
        for name, module, rule in self.layers:
            calls = self._calls.get(module)
            if calls is None:
                continue
            for x in calls.inputs:
                if x.shape[0] != batch_size:
                    raise BatchDimensionError(
                        f"module '{name}' ({type(module).__name__}) was called with leading "
                        f"dimension {x.shape[0]} but the batch has {batch_size} examples; "
                        "per-example clipping needs the example dimension first (e.g. pass "
                        "position_ids of shape [B, T], not [1, T])"
                    )
            # A call whose output did not reach the loss contributes a zero gradient.
            kept = [(x, g) for x, g in zip(calls.inputs, calls.output_grads) if g is not None]
            if kept:
                calls.inputs, calls.output_grads = [x for x, _ in kept], [g for _, g in kept]
                used.append((name, module, rule))
        return used

    def _check_inputs_unchanged(self) -> None:
        for name, module, _ in self.layers:
            calls = self._calls.get(module)
            for x, version in zip(calls.inputs, calls.input_versions) if calls else ():
                if x._version != version:
                    raise ValueError(
                        f"the input of module '{name}' ({type(module).__name__}) was modified "
                        "in place after the layer ran; per-example clipping needs layer inputs "
                        "unchanged until the backward pass (use an out-of-place operation)"
                    )

    def _check_losses(self, losses: Tensor) -> None:
        if not isinstance(losses, Tensor) or losses.dim() != 1:
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
            raise ValueError(
                f"compute_losses must return a per-example loss vector of shape [B], got {shape}"
            )
        if not losses.requires_grad:
            raise ValueError("the loss does not depend on any trainable parameter")


def _random_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _restore_random_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _layer_input(module: nn.Module, args: tuple, kwargs: dict) -> Tensor:
    """The first argument of the layer's forward, passed by position or by keyword."""
    if args:
        return args[0]
    name = next(iter(inspect.signature(module.forward).parameters))
    return kwargs[name]


def _hooked_output(output: Tensor, keep_grad: Callable[[Tensor], None]) -> Tensor:
    """`output`, hooked so that `keep_grad` gets dLoss/d(output) even if the model then
    changes it in place.

    A hook on a tensor changed in place still receives the gradient of its value before the
    change, unless the tensor is a view (F.linear on [B, T, m] with a bias returns one, and so
    does GPT-2's Conv1D): an in-place change to a view re-routes the backward through its base,
    and a hook on the view never fires. So a view that reshapes its whole base is hooked on the
    base (same numbers, same order); any other view is replaced by a copy.
    """
    base = output._base
    if base is None:
        output.register_hook(keep_grad)
        return output
    if _reshapes_whole_base(output, base):
        base.register_hook(keep_grad)
        return output
    output = output.clone()
    output.register_hook(keep_grad)
    return output


def _reshapes_whole_base(view: Tensor, base: Tensor) -> bool:
    return (
        view.is_contiguous() and base.is_contiguous() and view.numel() == base.numel()
        and view.storage_offset() == base.storage_offset()
    )


def _own_trainable(module: nn.Module) -> list[Tensor]:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def _refuse_batch_second(model: nn.Module) -> None:
    """Layers under a module that declares [T, B, ...] inputs would read tokens as examples
    (undetectable when T == B), so such a module must not hold trained parameters."""
    for name, module in model.named_modules():
        if getattr(module, "batch_first", True) is False and any(
            p.requires_grad for p in module.parameters()
        ):
            raise BatchDimensionError(
                f"module '{name or '<root>'}' ({type(module).__name__}) has batch_first=False: "
                "per-example clipping needs the example dimension first in every trained "
                "layer; build it with batch_first=True or freeze it"
            )


def _covered_layers(model: nn.Module, rules: dict) -> list:
    """(name, module, rule) for every module owning trainable parameters; refuse the rest."""
    layers = []
    for name, module in model.named_modules():
        params = _own_trainable(module)
        if not params:
            continue
        label = name or "<root>"
        rule = rules.get(module) or rule_for(module)
        if rule is None:
            raise UnsupportedLayerError(
                f"module '{label}' ({type(module).__name__}) owns trainable parameters "
                f"but per-example clipping has no rule for it; supported: {supported_layers()}. "
                "Freeze it (requires_grad=False) or replace it"
            )
        rule.check(module, label)
        layers.append((label, module, rule))
    return layers


def _slot_views(layers: list, like: Tensor) -> tuple[Tensor, dict[nn.Module, dict[str, Tensor]]]:
    """One flat buffer and each module's gradient slots as views of it. The modules of a tied
    parameter share its one slot, so their rules' clipped sums add up there."""
    offsets: dict = {}  # a parameter (or a module's non-parameter slot) -> its offset
    layout, size = [], 0
    for _, module, rule in layers:
        for name, shape in rule.slot_shapes(module).items():
            param = module._parameters.get(name)
            key = id(param) if param is not None else (id(module), name)
            if key not in offsets:
                offsets[key], size = size, size + shape.numel()
            layout.append((module, name, offsets[key], shape))
    flat = like.new_zeros(size)
    slots: dict[nn.Module, dict[str, Tensor]] = {module: {} for _, module, _ in layers}
    for module, name, offset, shape in layout:
        slots[module][name] = flat[offset : offset + shape.numel()].view(shape)
    return flat, slots


def _check_uniform(params: list[Tensor]) -> None:
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise ValueError(f"trainable parameters must share one dtype and device, got {kinds}")

