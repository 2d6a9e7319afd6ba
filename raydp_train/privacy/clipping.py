"""Per-example clipped gradient sum in one forward and one backward (ARCHITECTURE.md §2.3).

    g~_i = g_i * min(1, C / ||g_i||)        ||g_i|| over ALL trainable parameters jointly
    sum  = sum_i g~_i                        written into each parameter's .grad

Forward hooks keep each covered layer's input; a tensor hook on its output keeps the output
gradient. During the private backward the covered parameters do not require grad ("ghost
differentiation"), so autograd computes activation gradients only and the layer rules form
the norms and the clipped sum from what the hooks kept. Every gradient slot (normally a
parameter's `.grad`) is a view of one flat buffer, so noise and all-reduce act on one tensor.

Every pass checks that no trained parameter reaches the loss outside its own layer: the
parameters keep requiring grad, but inside each covered layer's forward the layer sees
detached aliases of them. Autograd therefore gives a parameter a `.grad` only through a path
the rules cannot see (a stray functional use, a custom autograd.Function, a hook), whatever
the model's control flow in that micro-batch; such a pass is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from raydp_train.privacy import builtin_rules  # noqa: F401 -- registers the built-in rules
from raydp_train.privacy.covered_layers import (
    BatchDimensionError,
    TrainedSetChangedError,
    check_trained_set,
    check_uniform,
    covered_layers,
    own_trainable,
    refuse_batch_second,
    refuse_compiled,
    refuse_state_from_the_batch,
    slot_views,
    trained_names,
)
from raydp_train.privacy.example_axis import NO_CHANGE, check_example_axis, leading_size
from raydp_train.privacy.layer_recording import LayerRecorder
from raydp_train.privacy.layer_reduction import LayerReduction
from raydp_train.privacy.owned_parameters import owned_parameters
from raydp_train.privacy.parameter_uses import ParameterUseAudit, ParameterUseError
from raydp_train.privacy.per_example_path import PER_EXAMPLE_PATH
from raydp_train.privacy.random_state import random_state, restore_random_state
from raydp_train.privacy.rounding import full_precision_matmuls, gamma
from raydp_train.privacy.rule_registry import LayerCalls, UnsupportedLayerError, cast_recorded
from raydp_train.privacy.sharding import is_sharded, local_tensor
from raydp_train.privacy.shared_calls import SharedOutputs, take_shared_path
from raydp_train.privacy.tied_weights import TieTerm, find_ties, tie_terms
from raydp_train.privacy.user_clipping import check_groupable, group_by_user

__all__ = [
    "BatchDimensionError", "MicroBatchStats", "ParameterUseError", "PerExampleClipper",
    "TrainedSetChangedError", "UnsupportedLayerError",
]


class NormParts(NamedTuple):
    """What each per-example squared norm was summed from (for the self-check's diagnosis)."""

    layers: dict[nn.Module, Tensor]  # each used layer's own squared norm, [B]
    ties: list[TieTerm]  # each shared parameter's cross terms, [B] float64


class MicroBatchStats(NamedTuple):
    losses: Tensor  # per-example losses, detached
    norms: Tensor  # per-example gradient norms before clipping


class PerExampleClipper(LayerRecorder):
    """Accumulates sum_i clip(g_i, C) over micro-batches into a flat gradient buffer."""

    def __init__(self, model: nn.Module, clip_norm: float, rules: dict | None = None,
                 other_layers: str = "per_example", stability: float | None = None,
                 unit: str = "example", quantile=None, user_contribution: str = "sum"):
        """`rules` overrides the rule of chosen modules (LSG's low-rank carriers);
        `other_layers` (privacy.other_layers): a module with no rule takes the per-example
        path ("per_example") or is refused ("refuse"); `stability`: automatic clipping,
        c_i = C / (||g_i|| + stability), instead of min(1, C / ||g_i||); `unit`: "user"
        clips each user's summed (`user_contribution` "mean": mean) rows (user_clipping.py);
        `quantile`: adaptive clipping (privacy/adaptive_clipping.py), whose C the step
        moves after each release."""
        if not clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
        self.model = model
        self.clip_norm = float(clip_norm)
        self.stability, self.quantile, self.contribution = stability, quantile, user_contribution
        refuse_batch_second(model)
        refuse_compiled(model)
        refuse_state_from_the_batch(model)
        self.layers = covered_layers(model, rules or {}, other_layers)
        self.other_layers, self.unit = other_layers, check_groupable(self.layers, unit)
        self._index_rules()
        self.shared_calls: list[str] = []  # modules on the path called without the examples
        self.ties = find_ties(self.layers)
        # A tied parameter is owned by several layers but trained (and slotted) once.
        owned = {id(p): p for _, module, _ in self.layers for p in own_trainable(module)}
        self.parameters = list(owned.values())
        if not self.parameters:
            raise ValueError("the model has no trainable parameters")
        check_uniform(self.parameters)
        first = local_tensor(self.parameters[0])  # a sharded one's shard (sharding.py)
        # Sharded: the whole layout on the meta device, this rank's rows in `flat_grad`.
        sharded = is_sharded(self.parameters[0])
        self.layout, self.slots = slot_views(self.layers, first.to("meta") if sharded else first)
        self.bound = list({id(param): (param, view) for module, named in self.slots.items()
                           for name, view in named.items()
                           if (param := owned_parameters(module).get(name)) is not None}.values())
        self.reduction = (LayerReduction(self.bound, self.layout, self.slots, first)
                          if sharded else None)
        self.flat_grad = self.reduction.local if sharded else self.layout
        self.last_norm_parts: NormParts | None = None
        # The last micro-batch's clip basis sqrt(norm^2 + rounding bound) and clip factors.
        self.last_clip_basis: Tensor | None = None
        self.last_clip_factors: Tensor | None = None
        self._calls: dict[nn.Module, LayerCalls] = {}
        self._audit = ParameterUseAudit(model, {module: name for name, module, _ in self.layers})
        self._names = {key: name for key, (_, name) in self._audit.owner_of.items()}
        self._recording = False
        self._swapped: dict[nn.Module, dict[str, Tensor]] = {}  # real parameters, during forward
        self._contexts: list = []  # rules' contexts entered for a forward
        self._ghost_leaf = torch.zeros((), dtype=first.dtype, device=first.device)
        self._ghost_leaf.requires_grad_(True)
        self._handles: dict[nn.Module, tuple] = {}
        for _, module, _ in self.layers:
            self._hook(module)
        # What trains is fixed here: every rule, slot and the optimizer's view rest on it.
        self._trained_names = trained_names(model)
        self._example_axis_checked = False  # on the first micro-batch (example_axis.py)
        self._axes, self._pass_batch, self._shared_outputs = NO_CHANGE, None, SharedOutputs()

    # ------------------------------------------------------------------ public
    def accumulate(self, compute_losses: Callable[..., Tensor], *args,
                   users: Tensor | None = None) -> MicroBatchStats:
        """Run forward + backward of one micro-batch; add its clipped sum to `flat_grad`.

        `compute_losses(*args)` runs the model and returns the per-example loss vector [B]
        (the engine owns the reduction). A trained parameter that reached the loss outside its
        layer's forward in this pass is refused by name before anything is summed. `users`
        ([B] ids, unit "user"): each user's rows are clipped as one example (norms [U]).
        """
        check_trained_set(self.model, self._trained_names)
        if not self._example_axis_checked:
            self._axes = check_example_axis(self.layers, compute_losses, args,
                                            share=self.other_layers == "per_example")
            self._take_shared_path()
            self._example_axis_checked = True
        self._pass_batch = leading_size(args)
        self._keep_hooks_innermost()
        state = random_state()
        try:
            losses, stray = self._forward_backward(compute_losses, args)
            if stray:
                restore_random_state(state)
                self._audit.refuse(stray, lambda: compute_losses(*args))
            if losses.shape[0] == 0:  # an empty micro-batch adds nothing
                if self.reduction is not None:  # but joins the ranks' reductions
                    self.reduction.add_nothing()
                self.last_clip_basis = self.last_clip_factors = losses.detach().clone()
                return MicroBatchStats(losses.detach(), losses.detach().clone())
            return MicroBatchStats(losses.detach(), self._clip_and_sum(losses.shape[0], users))
        finally:
            self._calls = {}

    def _index_rules(self) -> None:
        self._records_call = {m: rule for _, m, rule in self.layers if rule.records_call}
        # The modules without a rule of their own, by name (the run record lists them).
        self.per_example_path = [n for n, _, rule in self.layers if rule is PER_EXAMPLE_PATH]

    def _take_shared_path(self) -> None:
        if self._axes.shared:
            self.layers = take_shared_path(self.layers, self.ties, self._axes.shared)
            self._index_rules()
            self.shared_calls = [n for n, m, _ in self.layers if m in self._axes.shared]

    def bind_grads(self) -> Tensor:
        """(Re)bind every `.grad` to the flat buffer and return it. Binding at the start of a
        step means even a step over an empty sample hands the optimizer the buffer (its noise)."""
        for p, view in self.bound:
            if p.grad is not view and not is_sharded(p):  # sharded: ShardedSums.bind
                p.grad = view
        return self.flat_grad

    def zero_grad(self) -> None:
        self.bind_grads().zero_()

    @property
    def num_parameters(self) -> int:
        return self.layout.numel()

    def slot_vector(self, gradients: dict[int, Tensor]) -> Tensor:
        """One example's gradients (by parameter id; missing: zero) laid out as the flat
        buffer, in each rule's slots (slots_from_gradients): what its clipped sum would add
        for that example with a clip factor of 1."""
        flat = self.flat_grad.new_zeros(self.layout.numel())
        for _, module, rule in self.layers:
            named = {name: gradients.get(id(p), torch.zeros_like(p))
                     for name, p in owned_parameters(module).items()}
            for slot, value in rule.slots_from_gradients(module, named).items():
                self.slot_in(flat, module, slot).copy_(value.reshape(self.slots[module][slot].shape))
        return flat

    def slot_in(self, flat: Tensor, module: nn.Module, slot: str) -> Tensor:
        """`flat` (laid out as the buffer; [K, P] for K examples) at a module's slot: a view
        when `flat` is one vector."""
        view = self.slots[module][slot]
        start = view.storage_offset() - self.layout.storage_offset()
        return flat[..., start : start + view.numel()].reshape((*flat.shape[:-1], *view.shape))

    def parameter_name(self, parameter: Tensor) -> str:
        """The qualified name of a trained parameter (a tied one's first name)."""
        return self._names[id(parameter)]

    def close(self) -> None:
        """Remove the hooks; the model trains normally again."""
        for handles in self._handles.values():
            for handle in handles:
                handle.remove()
        self._handles = {}

    def _forward_backward(self, compute_losses: Callable[..., Tensor],
                          args: tuple) -> tuple[Tensor, list[Tensor]]:
        """One forward and backward under the hooks: the per-example losses, and the trained
        parameters that got a gradient outside their layers (stray uses)."""
        self._calls, self._shared_outputs = {}, SharedOutputs()  # none left by a failed pass
        with self._ghost_differentiation():
            losses = compute_losses(*args)
            self._check_losses(losses)
            if losses.shape[0]:
                self._backward(losses)
            stray = [p for p in self.parameters if p.grad is not None]
        return losses, stray

    def _backward(self, losses: Tensor) -> None:
        try:
            self._shared_outputs.per_example_gradients(losses)
            losses.sum().backward()
        except RuntimeError:
            # Autograd refuses a tensor it saved and the model then changed in place; when
            # that tensor is a layer's input, say which layer.
            self._check_inputs_unchanged()
            raise

    # ------------------------------------------------------------------ math
    def _clip_and_sum(self, batch_size: int, users: Tensor | None = None) -> Tensor:
        used = self._used_layers(batch_size)
        if self.unit == "user" or users is not None:  # [B, ...] rows as [U, k, ...]
            batch_size = group_by_user(used, self._calls, users, self.unit, self.contribution)
        # A forward under autocast (bf16) records bfloat16 tensors; the norms decide the clip
        # factors the privacy guarantee rests on, so they are computed in the parameters' dtype.
        cast_recorded([self._calls[module] for _, module, _ in used], self.flat_grad.dtype)
        with torch.autocast(self.flat_grad.device.type, enabled=False), full_precision_matmuls():
            return self._clip_and_sum_recorded(used, batch_size)

    def _clip_and_sum_recorded(self, used: list, batch_size: int) -> Tensor:
        gram_cache: dict = {}
        parts = {
            module: rule.squared_norms(module, self._calls[module], self.slots[module], gram_cache)
            for _, module, rule in used
        }
        like = self.flat_grad.new_zeros(batch_size)
        ties = tie_terms(self.ties, {module: self._calls[module] for module in parts}, like)
        self.last_norm_parts = NormParts(parts, ties)
        squared, rounding = self._squared_norms(parts, ties)
        # A Gram form can cancel to a tiny or negative number: the clip factor comes from the
        # squared norm plus the bound on its rounding error, never below the true one.
        basis = (squared.clamp(min=0) + rounding).sqrt()
        # Automatic clipping scales every example to just under C (Bu et al. 2023).
        scale = basis + self.stability if self.stability else basis.clamp(min=self.clip_norm)
        clip_factors = (self.clip_norm / scale).to(self.flat_grad.dtype)
        self.last_clip_basis, self.last_clip_factors = basis, clip_factors
        if self.reduction is not None:  # sharded: summed over the ranks, bucket by bucket
            self.reduction.add_clipped_sums(used, self._calls, clip_factors)
        for _, module, rule in used if self.reduction is None else ():
            rule.add_clipped_sum(module, self._calls[module], clip_factors, self.slots[module])
        return squared.clamp(min=0).sqrt().to(self.flat_grad.dtype)

    def _squared_norms(self, parts: dict[nn.Module, Tensor],
                       ties: list) -> tuple[Tensor, Tensor]:
        """||g_i||^2 summed over layers and cross terms in float64, and the bound on its
        rounding error: the Gram forms' own (`calls.state["rounding"]`) and the sum's."""
        terms = [part.double() for part in parts.values()] + [term.value for term in ties]
        squared = torch.stack(terms).sum(0)
        rounding = sum((self._calls[module].state.get("rounding", 0) for module in parts),
                       squared.new_zeros(squared.shape))
        rounding = rounding + sum((term.rounding for term in ties), torch.zeros_like(rounding))
        summing = gamma(len(terms), torch.float64) * torch.stack(terms).abs().sum(0)
        return squared, rounding + summing

    def _check_losses(self, losses: Tensor) -> None:
        if not isinstance(losses, Tensor) or losses.dim() != 1:
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
            raise ValueError(
                f"compute_losses must return a per-example loss vector of shape [B], got {shape}"
            )
        if not losses.requires_grad:
            raise ValueError("the loss does not depend on any trainable parameter")
