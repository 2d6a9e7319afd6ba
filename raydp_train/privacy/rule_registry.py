"""What a layer rule is, and which rule serves which layer (ARCHITECTURE.md §2.3).

A rule names the gradient slots of a module (`slot_shapes`: by default its trainable
parameters) and turns what the hooks recorded -- the input of every call and the gradient of
the summed loss with respect to that call's output -- into
  * `squared_norms`: the per-example squared gradient norm over the module's slots, [B];
  * `add_clipped_sum`: sum_i c_i * grad_i for each slot, added into the slot's buffer.
A module called several times in one forward is handled by concatenating its calls along
the token axis: grad_i = sum over calls, which is exactly what the concatenation computes.

Rules register themselves for their layers with `@register_rule` (as Opacus's grad samplers
do); layer_rules.py and norm_rules.py register the built-in ones when they are imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from raydp_train.errors import UserError


class UnsupportedLayerError(UserError, TypeError):
    """A module owns trainable parameters the clipping engine cannot handle."""


@dataclass
class LayerCalls:
    """What the hooks recorded for one module during one forward/backward."""

    inputs: list[Tensor] = field(default_factory=list)
    # One per call: the output's gradient; for a rule that `records_call`, a list with one
    # gradient (or None) per floating-point tensor of the output.
    output_grads: list = field(default_factory=list)
    # For a rule that `records_call`: each call's (args, kwargs), tensors detached.
    arguments: list[tuple[tuple, dict]] = field(default_factory=list)
    # Each input's version counter when the layer ran: an in-place change after that would
    # make the recorded input (a detached alias) differ from what the layer saw.
    input_versions: list[int] = field(default_factory=list)
    # Filled by squared_norms, reused by add_clipped_sum (same backward pass).
    state: dict = field(default_factory=dict)


def cast_recorded(calls: list[LayerCalls], dtype: torch.dtype) -> None:
    """Every recorded floating-point input and output gradient in `dtype` (token ids stay
    integers; a tensor already in `dtype` is kept as is). A tensor several layers read (Q, K
    and V) is cast once, so they still share its Gram matrix."""
    cast: dict[tuple, Tensor] = {}

    def to_dtype(x):
        if isinstance(x, list):
            return [to_dtype(y) for y in x]
        if x is None or not x.is_floating_point() or x.dtype == dtype:
            return x
        key = (x.data_ptr(), x.dtype, tuple(x.shape), x.stride())
        if key not in cast:
            cast[key] = x.to(dtype)
        return cast[key]

    for recorded in calls:
        recorded.inputs = [to_dtype(x) for x in recorded.inputs]
        recorded.output_grads = [to_dtype(g) for g in recorded.output_grads]


def fold(x: Tensor, batch: int) -> Tensor:
    """[k * batch, ...] rows, example after example, as [batch, k, ...]."""
    return x.reshape(batch, x.shape[0] // batch, *x.shape[1:])


class Rule:
    """Per-example squared norms and clipped sums of one kind of layer.

    The engine calls `check` and `slot_shapes` once per module when it is built, then, for
    every micro-batch, `squared_norms` of every used module and, once the clip factors
    c_i = min(1, C / ||g_i||) are known, `add_clipped_sum` in the same backward.
    """

    # True: the hooks keep every argument of each call and the gradient of every tensor of its
    # output (the per-example path), not only the first input and the output's gradient.
    records_call = False
    # True: the rule sums over every axis between the examples and the features, so a call
    # whose rows fold k rows an example into the first axis can be given as [B, k, ...]
    # (example_axis.py); False: such a call is refused.
    folds_examples = False
    # True: the rule reads the examples where a batch_first=False module keeps them (axis 1),
    # so such a module is not refused (`examples_in` says where they are).
    handles_batch_second = False
    # True: the module owns its whole subtree's parameters, which its forward uses without
    # calling the children (nn.MultiheadAttention's `out_proj`).
    owns_subtree = False

    def examples_in(self, module: nn.Module, args: tuple, kwargs: dict) -> Tensor | None:
        """Of a call's arguments, the tensor whose first axis is the examples (the engine
        checks it against the batch); by default the first tensor with an axis."""
        return next((x for x in tree_flatten((args, kwargs))[0]
                     if isinstance(x, Tensor) and x.dim() > 0), None)

    def during_forward(self, module: nn.Module, calls: LayerCalls, ghost_leaf: Tensor):
        """A context manager the hooks enter for the module's forward (its parameters already
        detached) and leave when it returns, or None; for a rule that `records_call`."""
        return

    def check(self, module: nn.Module, name: str) -> None:
        """Raise UnsupportedLayerError, naming the module `name`, for settings the rule cannot
        handle; by default there are none."""

    def parameter_names(self, module: nn.Module) -> tuple[str, ...]:
        """The parameters of the module whose gradients the rule computes; the engine refuses
        a module that trains any other."""
        return ("weight", "bias")

    def slot_shapes(self, module: nn.Module) -> dict[str, torch.Size]:
        """The module's gradient slots by name; by default one per trainable parameter."""
        from raydp_train.privacy.owned_parameters import owned_parameters

        return {n: p.shape for n, p in owned_parameters(module).items()}

    def slots_from_gradients(self, module: nn.Module,
                             gradients: dict[str, Tensor]) -> dict[str, Tensor]:
        """One example's slot values from its gradients of the module's trained parameters
        (by name), computed the slow way: what `add_clipped_sum` adds for that example with
        a clip factor of 1. By default the slots are the parameters."""
        return {name: gradients[name] for name in self.slot_shapes(module)}

    def per_example_gradient(self, module: nn.Module, calls: LayerCalls,
                             slot: str) -> Tensor | None:
        """[B, *slot shape]: every example's gradient in the slot, after `squared_norms`, for
        the cross terms of a parameter shared with another layer (tied_weights.py); None
        where the rule cannot form it, and a tie through that slot is refused."""
        return None

    def squared_norms(self, module: nn.Module, calls: LayerCalls, slots: dict[str, Tensor],
                      gram_cache: dict) -> Tensor:
        """||grad_i||^2 summed over the slots, [B], from the recorded `calls`. What the clipped
        sum reuses goes into `calls.state`; `gram_cache` holds input Grams a a^T shared by the
        layers of one backward."""
        raise NotImplementedError(f"{type(self).__name__}.squared_norms")

    def add_clipped_sum(self, module: nn.Module, calls: LayerCalls, clip_factors: Tensor,
                        slots: dict[str, Tensor]) -> None:
        """slots[s] += sum_i clip_factors[i] * grad_i[s] for every slot s."""
        raise NotImplementedError(f"{type(self).__name__}.add_clipped_sum")


# A layer class, or the qualified name of a class of a library not imported here.
_RULES: dict[type | str, Rule] = {}


def _qualified_name(layer: type | str) -> str:
    return layer if isinstance(layer, str) else f"{layer.__module__}.{layer.__qualname__}"


def register_rule(*layers: type | str) -> Callable[[type[Rule]], type[Rule]]:
    """Class decorator: an instance of the Rule serves each of `layers` (classes, or qualified
    class names such as "transformers.pytorch_utils.Conv1D"). One rule per layer."""

    def register(rule_class: type[Rule]) -> type[Rule]:
        if not issubclass(rule_class, Rule):
            raise TypeError(f"@register_rule decorates Rule subclasses, got {rule_class!r}")
        for layer in layers:
            name = _qualified_name(layer)
            taken = {_qualified_name(known): rule for known, rule in _RULES.items()}
            if name in taken:
                raise ValueError(
                    f"layer {name} already has a rule ({type(taken[name]).__name__}); "
                    f"cannot register {rule_class.__name__} for it too"
                )
            _RULES[layer] = rule_class()
        return rule_class

    return register


# Matchers recognize a layer by what it computes rather than by its class (transformers'
# RMSNorm classes); asked only when no registered class serves the module.
_MATCHERS: dict[str, Callable[[nn.Module], Rule | None]] = {}


def register_matcher(description: str):
    """Function decorator: `match(module) -> Rule | None` is asked about modules whose class
    has no rule; `description` says what it accepts in the list of supported layers."""

    def register(match: Callable[[nn.Module], Rule | None]):
        _MATCHERS[description] = match
        return match

    return register


def rule_for(module: nn.Module) -> Rule | None:
    """The rule of the module's type, if the module computes what that type's forward does
    (`changed_behaviour`), else the first matcher's that accepts it."""
    rule = _registered_rule(module)
    for match in _MATCHERS.values():
        if rule is not None:
            break
        rule = match(module)
    return rule


def _registered_layer(module: nn.Module) -> tuple[type, Rule] | None:
    """The nearest class in the module's MRO that has a rule, and the rule."""
    for cls in type(module).__mro__:
        rule = _RULES.get(cls) or _RULES.get(_qualified_name(cls))
        if rule is not None:
            return cls, rule
    return None


def _registered_rule(module: nn.Module) -> Rule | None:
    found = _registered_layer(module)
    if found is None or changed_behaviour(module, found[0]) is not None:
        return None
    return found[1]


# Methods a subclass may redefine without changing what its forward computes: construction,
# initialization, printing and (de)serialization. Any other redefined method (`forward`,
# `_conv_forward`, `__call__`, ...) may change the computation the rule was derived for.
_BEHAVIOUR_NEUTRAL = frozenset({
    "__init__", "reset_parameters", "extra_repr", "__repr__", "__setstate__", "__getstate__",
    "_load_from_state_dict", "_save_to_state_dict", "__init_subclass__",
})
# FSDP2's classes (`fully_shard` makes FSDP<Layer>): they gather the weights around the
# forward and shard them after, and change nothing the forward computes.
_NEUTRAL_WRAPPERS = ("torch.distributed.fsdp.",)


def changed_behaviour(module: nn.Module, layer: type) -> str | None:
    """How `module` (an instance of a subclass of `layer`) may compute something other than
    `layer`'s forward: a method of `layer` redefined by its class or set on the instance
    itself; None if neither. Rules bind to behaviour, not to class names."""
    for name, value in vars(module).items():
        if callable(value) and hasattr(layer, name):
            return f"the instance's own `{name}` replaces {layer.__name__}.{name}"
    for cls in type(module).__mro__:
        if cls is layer:
            break
        if f"{cls.__module__}.".startswith(_NEUTRAL_WRAPPERS):
            continue
        for name, value in vars(cls).items():
            if name not in _BEHAVIOUR_NEUTRAL and _is_method(value) and hasattr(layer, name):
                return f"class {cls.__name__} redefines {layer.__name__}.{name}"
    return None


def why_no_rule(module: nn.Module) -> str:
    """Why a module of a class with a registered rule does not get it ('' if it has none)."""
    found = _registered_layer(module)
    reason = found and changed_behaviour(module, found[0])
    return f" ({reason}, so the {found[0].__name__} rule does not apply)" if reason else ""


def _is_method(value) -> bool:
    return callable(value) or isinstance(value, (staticmethod, classmethod, property))


def supported_layers() -> str:
    """The registered layers, sorted (class names, and full names of classes not imported),
    then what the matchers accept."""
    names = ", ".join(sorted(
        layer if isinstance(layer, str) else layer.__name__ for layer in _RULES
    ))
    return "; ".join([names, *_MATCHERS])
