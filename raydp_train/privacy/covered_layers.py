"""Which modules the clipping engine covers, with which rule, and where their gradients go
(ARCHITECTURE.md §2.3): every module that owns a trained parameter gets a rule or is refused
by name, before anything runs; so are models the hooks cannot follow (a compiled model,
batch-second layers, a re-parametrized weight) and modules whose state comes from the batch."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.utils import parametrize

from raydp_train.errors import UserError
from raydp_train.privacy.owned_parameters import (
    USES_CHILDREN_FUNCTIONALLY,
    WHOLE_SUBTREE,
    owned_parameters,
)
from raydp_train.privacy.per_example_path import PER_EXAMPLE_PATH
from raydp_train.privacy.rule_registry import (
    Rule,
    UnsupportedLayerError,
    rule_for,
    supported_layers,
    why_no_rule,
)


class BatchDimensionError(UserError, ValueError):
    """A layer saw a leading dimension that is not the example dimension."""


class TrainedSetChangedError(UserError, RuntimeError):
    """A parameter started or stopped requiring grad after the engine was built."""


def trained_names(model: nn.Module) -> dict[int, str]:
    """Every parameter that requires grad, by identity, with its (first) qualified name."""
    return {id(p): name for name, p in model.named_parameters() if p.requires_grad}


def check_trained_set(model: nn.Module, built_with: dict[int, str]) -> None:
    """What trains is fixed when the engine is built: every rule and slot rests on it. A
    parameter unfrozen since has neither, and its raw, unclipped gradient would reach the
    optimizer; one frozen since would still be clipped and stepped. Either is refused."""
    now = trained_names(model)
    if now == built_with:
        return
    started = sorted(set(now.values()) - set(built_with.values()))
    stopped = sorted(set(built_with.values()) - set(now.values()))
    changes = "; ".join(part for part in (
        started and f"now trained: {', '.join(repr(n) for n in started)}",
        stopped and f"now frozen: {', '.join(repr(n) for n in stopped)}") if part)
    raise TrainedSetChangedError(
        f"the model's trained parameters changed after the clipping engine was built "
        f"({changes}); nothing of this step was computed or released. Set requires_grad "
        "before building the engine (a new PrivateStep, or a new run)")


def own_trainable(module: nn.Module) -> list[Tensor]:
    return list(owned_parameters(module).values())


def refuse_batch_second(model: nn.Module) -> None:
    """Layers under a module that declares [T, B, ...] inputs would read tokens as examples
    (undetectable when T == B), so such a module must not hold trained parameters."""
    for name, module in model.named_modules():
        rule = rule_for(module)
        if rule is not None and rule.handles_batch_second:
            continue  # reads the examples on axis 1 (nn.MultiheadAttention)
        if _batch_second(module) and any(p.requires_grad for p in module.parameters()):
            raise BatchDimensionError(
                f"module '{name or '<root>'}' ({type(module).__name__}) has batch_first=False: "
                "per-example clipping needs the example dimension first in every trained "
                "layer; build it with batch_first=True or freeze it"
            )


def _batch_second(module: nn.Module) -> bool:
    """Declares [T, B, ...] inputs: batch_first=False, or a torch Transformer layer whose
    attention has it (the layer's Linear and norm layers then read tokens as examples)."""
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return module.self_attn.batch_first is False
    return getattr(module, "batch_first", True) is False


def refuse_compiled(model: nn.Module) -> None:
    """A compiled module runs a captured graph: the hooks the engine relies on would not run
    as the model's Python code does (and dynamo fails inside them)."""
    for name, module in model.named_modules():
        if hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None):
            raise UnsupportedLayerError(
                f"module '{name or '<root>'}' ({type(module).__name__}) is compiled with "
                "torch.compile; per-example clipping hooks every trained layer and needs the "
                "uncompiled model: pass the module itself, not its compiled form"
            )


def refuse_state_from_the_batch(model: nn.Module) -> None:
    """Modules that change what an example contributes, or the saved model, from the batch
    itself, outside the clipped sum and its noise, are refused trained or frozen: BatchNorm
    normalizes each example by the batch's statistics (one example moves every other's
    gradient) and, like InstanceNorm with running statistics, keeps un-noised running means
    of the data in the model; an Embedding or EmbeddingBag with max_norm rescales, in place,
    the rows of the tokens a batch holds."""
    for name, module in model.named_modules():
        label = f"module '{name or '<root>'}' ({type(module).__name__})"
        if isinstance(module, _BatchNorm) or (
                isinstance(module, _InstanceNorm) and module.track_running_stats):
            raise UnsupportedLayerError(
                f"{label} normalizes with statistics of the batch or keeps running statistics "
                "of the data, outside clipping and noise, trained or frozen: replace it with "
                "GroupNorm or LayerNorm, which normalize each example by itself (model.fix: "
                "true, or raydp_train.fix(model), does it)")
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            raise UnsupportedLayerError(
                f"{label} has max_norm={module.max_norm}: it rescales, in place, the rows of "
                "the tokens each batch holds, outside clipping and noise: build it without "
                "max_norm")


def covered_layers(model: nn.Module, rules: dict, other_layers: str = "per_example") -> list:
    """(name, module, rule) for every module owning trainable parameters: its rule, else the
    per-example path (`other_layers` "per_example"), else refused by name."""
    layers, inside = [], set()
    for name, module in model.named_modules():
        if module in inside:  # owned by a module on the per-example path, with its subtree
            continue
        rule = rules.get(module) or rule_for(module)
        if rule is None and other_layers == "per_example":
            rule = PER_EXAMPLE_PATH
        if rule is not None and (rule.owns_subtree or (
                rule is PER_EXAMPLE_PATH and isinstance(module, USES_CHILDREN_FUNCTIONALLY))):
            WHOLE_SUBTREE.add(module)
            inside |= set(module.modules()) - {module}
        params = own_trainable(module)
        if not params:
            continue
        label = name or "<root>"
        _refuse_parametrization(module, label)
        if rule is None:
            names = ", ".join(f"'{n}'" for n in owned_parameters(module))
            raise UnsupportedLayerError(
                f"module '{label}' ({type(module).__name__}) owns trainable parameter(s) "
                f"{names} but per-example clipping has no rule for it{why_no_rule(module)}; "
                f"supported: {supported_layers()}. Set privacy.other_layers: per_example "
                "(their per-example gradients by torch.func), freeze them "
                "(requires_grad=False) or replace the module"
            )
        _refuse_one_parameter_twice(module, label)
        rule.check(module, label)
        _check_parameter_names(module, label, rule)
        layers.append((label, module, rule))
    return layers


def _refuse_parametrization(module: nn.Module, label: str) -> None:
    """torch.nn.utils.parametrize computes a weight from parameters held in a child
    (`parametrizations.weight.original0`), called with no example in it."""
    if isinstance(module, parametrize.ParametrizationList):
        raise UnsupportedLayerError(
            f"module '{label}' ({type(module).__name__}) re-parametrizes its owner's weight "
            "(torch.nn.utils.parametrize, e.g. parametrizations.weight_norm): per-example "
            "clipping has no rule for it, and it is called without the batch, so the "
            "per-example path cannot follow it; remove the re-parametrization or freeze it")


def _refuse_one_parameter_twice(module: nn.Module, label: str) -> None:
    """One Parameter under two names of the same module (a norm whose `weight` is its `bias`):
    its rule would compute each name's gradient as if they were two parameters."""
    names: dict[int, str] = {}
    for name, param in module._parameters.items():
        if param is None or not param.requires_grad:
            continue
        if id(param) in names:
            raise UnsupportedLayerError(
                f"module '{label}' ({type(module).__name__}) holds one trainable parameter "
                f"under two names, '{names[id(param)]}' and '{name}'; per-example clipping "
                "needs each of a layer's parameters distinct: give each its own tensor or "
                "freeze it")
        names[id(param)] = name


def _check_parameter_names(module: nn.Module, label: str, rule: Rule) -> None:
    """A trained parameter the rule does not know (weight_norm's `weight_g` and `weight_v`,
    spectral_norm's `weight_orig`) would get no gradient at all."""
    known = rule.parameter_names(module)
    unknown = [n for n in owned_parameters(module) if n not in known]
    if unknown:
        raise UnsupportedLayerError(
            f"module '{label}' ({type(module).__name__}) has trainable parameter(s) "
            f"{', '.join(repr(n) for n in unknown)} that its clipping rule "
            f"({type(rule).__name__}) does not compute, only {', '.join(known)} (a "
            "re-parametrization such as torch.nn.utils.weight_norm or spectral_norm renames "
            "them); remove the re-parametrization or freeze those parameters"
        )


def slot_views(layers: list, like: Tensor) -> tuple[Tensor, dict[nn.Module, dict[str, Tensor]]]:
    """One flat buffer and each module's gradient slots as views of it. The modules of a tied
    parameter share its one slot, so their rules' clipped sums add up there."""
    offsets: dict = {}  # a parameter (or a module's non-parameter slot) -> its offset
    layout, size = [], 0
    for _, module, rule in layers:
        for name, shape in rule.slot_shapes(module).items():
            param = owned_parameters(module).get(name)
            key = id(param) if param is not None else (id(module), name)
            if key not in offsets:
                offsets[key], size = size, size + shape.numel()
            layout.append((module, name, offsets[key], shape))
    flat = like.new_zeros(size)
    slots: dict[nn.Module, dict[str, Tensor]] = {module: {} for _, module, _ in layers}
    for module, name, offset, shape in layout:
        slots[module][name] = flat[offset : offset + shape.numel()].view(shape)
    return flat, slots


def check_uniform(params: list[Tensor]) -> None:
    """One dtype and device, float32 or float64: in bfloat16 or float16 the per-example norms
    were measured 0.7% off, so a clipped example could pass C."""
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise ValueError(f"trainable parameters must share one dtype and device, got {kinds}")
    (dtype, _), = kinds
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"trainable parameters in {dtype}: per-example norms and the clipped "
                         "sum need float32 or float64 parameters (for a bfloat16 forward: "
                         "training.precision: bf16, which keeps them in float32)")

