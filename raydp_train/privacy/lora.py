"""DP-LoRA (ARCHITECTURE.md §2.9; Yu et al. 2022): a low-rank adapter on each chosen Linear
layer (or GPT-2 Conv1D), its base weight frozen. `LoraLinear` folds the adapter into the layer's one matmul,
y = x (W + s B A)^T + b with s = alpha / r, and `LoraRule` forms A's and B's per-example
gradients from the layer's input and output gradient through rank-r products, in the same
one backward as every other trained parameter's; noise and accounting are DP-SGD's. Saved
as the merged model, and the adapters alone in peft's format."""

from __future__ import annotations

import fnmatch
import math
from copy import deepcopy
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raydp_train.errors import UserError
from raydp_train.privacy.layer_rules import (
    LinearRule,
    add_linear_clipped_sum,
    add_rounding,
    gram_key,
    linear_weight_norm,
)
from raydp_train.privacy.rule_registry import LayerCalls, Rule, register_rule


class LoraSetupError(UserError, ValueError):
    """The pipeline's privacy.lora settings do not fit the model; the message names the field."""


# GPT-2's projections: y = x W + b with W stored [in, out] (named, so torch alone suffices).
TRANSPOSED_LINEAR = "transformers.pytorch_utils.Conv1D"


def _transposed(layer: nn.Module) -> bool:
    return f"{type(layer).__module__}.{type(layer).__qualname__}" == TRANSPOSED_LINEAR


class LoraLinear(nn.Module):
    """A frozen `base_layer` (nn.Linear, or GPT-2's transposed Conv1D) plus a rank-r update:
    A [r, in] drawn as nn.Linear draws its weights, B [out, r] = 0, so the layer starts as the
    base layer."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.base_layer = base.requires_grad_(False)
        self.scaling = alpha / rank
        weight = base.weight
        out_features, in_features = weight.t().shape if _transposed(base) else weight.shape
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform(a=sqrt(5)), as nn.Linear
        a = torch.rand(rank, in_features, generator=generator, dtype=weight.dtype)
        self.lora_A = nn.Parameter((2 * a - 1).mul_(bound).to(weight.device))
        self.lora_B = nn.Parameter(weight.new_zeros(out_features, rank))

    def merged_weight(self) -> Tensor:
        """W + s B A, [out, in]."""
        weight = self.base_layer.weight
        weight = weight.t() if _transposed(self.base_layer) else weight
        return weight + self.scaling * (self.lora_B @ self.lora_A)

    def forward(self, x: Tensor) -> Tensor:
        weight, bias = self.merged_weight(), self.base_layer.bias
        # A base kept in bf16 (model.frozen_dtype): W + s B A is promoted, the bias cast.
        return F.linear(x, weight, None if bias is None else bias.to(weight.dtype))


@register_rule(LoraLinear)
class LoraRule(Rule):
    """From the layer's input x [B, T, m] and output gradient g [B, T, n]: B's per-example
    gradient is (s g)^T h with h = x A^T, A's is u^T x with u = (s g) B -- Linear gradients of
    two rank-r carriers, so the [n, m] weight gradient of W is never formed."""

    _tokens = LinearRule()
    folds_examples = True

    def parameter_names(self, module: nn.Module) -> tuple[str, ...]:
        return ("lora_A", "lora_B")

    def squared_norms(self, module, calls: LayerCalls, slots: dict, gram_cache: dict) -> Tensor:
        x, g, rows = self._tokens.stacked_tokens(module, calls)
        scaled = g * module.scaling
        h, u = x @ module.lora_A.detach().t(), scaled @ module.lora_B.detach()
        # Q, K and V read one input: share its Gram with theirs (single calls only).
        key = (gram_key(calls.inputs[0], self._tokens.token_view(module), x.shape[1])
               if len(calls.inputs) == 1 else None)
        norms_a, per_example_a, bound_a = linear_weight_norm(x, u, gram_cache, key)
        norms_b, per_example_b, bound_b = linear_weight_norm(h, scaled, gram_cache, None)
        add_rounding(calls, bound_a)
        add_rounding(calls, bound_b)
        calls.state.update(pairs={"lora_A": (x, u, per_example_a),
                                  "lora_B": (h, scaled, per_example_b)}, rows=rows)
        return norms_a + norms_b

    def add_clipped_sum(self, module, calls: LayerCalls, clip_factors: Tensor, slots) -> None:
        for name, (inputs, grads, per_example) in calls.state["pairs"].items():
            add_linear_clipped_sum(slots[name], inputs, grads, clip_factors, per_example,
                                   calls.state["rows"])


def add_adapters(model: nn.Module, settings, seed: int) -> list[str]:
    """Replace the chosen trainable Linear layers by LoraLinear (A drawn from `seed`, B zero,
    so the model starts unchanged), their base weights frozen; freeze the other trainable
    parameters too with `train_other: freeze`. The names of the adapted layers."""
    targets = adapted_layers(model, settings)
    if settings.train_other == "freeze":
        model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)  # every rank draws the same A
    for name in targets:
        owner, _, attribute = name.rpartition(".")
        parent = model.get_submodule(owner)
        setattr(parent, attribute, LoraLinear(getattr(parent, attribute), settings.rank,
                                              settings.alpha, generator))
    return targets


def adapted_layers(model: nn.Module, settings) -> list[str]:
    """Trainable Linear layers named by `settings.layers`, or with min(in, out) > rank."""
    linear = {name: m for name, m in model.named_modules()
              if (type(m) is nn.Linear or _transposed(m)) and m.weight.requires_grad}
    if settings.layers is None:
        chosen = [n for n, m in linear.items() if min(m.weight.shape) > settings.rank]
        if not chosen:
            raise LoraSetupError(f"privacy.lora.rank: no trainable Linear layer has min(in, out) "
                                 f"> {settings.rank}; lower the rank or name privacy.lora.layers")
        return chosen
    unmatched = [p for p in settings.layers if not any(fnmatch.fnmatch(n, p) for n in linear)]
    if unmatched:
        shown = ", ".join(list(linear)[-3:]) or "none"
        raise LoraSetupError(f"privacy.lora.layers: patterns {unmatched} match no trainable "
                             f"Linear layer (trainable Linear layers end: {shown})")
    return [n for n in linear if any(fnmatch.fnmatch(n, p) for p in settings.layers)]


def merged(model: nn.Module) -> nn.Module:
    """A copy of `model` with each adapter merged into its base weight (W + s B A) and the
    plain layer put back: the architecture the model was built with."""
    plain = deepcopy(model)
    for name, module in list(plain.named_modules()):
        if isinstance(module, LoraLinear):
            layer, weight = module.base_layer, module.merged_weight().detach()
            # In the merged dtype: a bf16 base (model.frozen_dtype) would round B A away.
            layer.weight = nn.Parameter(weight.t().contiguous() if _transposed(layer) else weight,
                                        requires_grad=False)
            if layer.bias is not None:
                layer.bias = nn.Parameter(layer.bias.detach().to(weight.dtype),
                                          requires_grad=layer.bias.requires_grad)
            owner, _, attribute = name.rpartition(".")
            setattr(plain.get_submodule(owner), attribute, layer)
    return plain


def save_adapter(model: nn.Module, folder: Path) -> None:
    """The adapters alone, in peft's format (adapter_config.json, adapter_model.safetensors),
    so that `PeftModel.from_pretrained(<the base checkpoint>, folder)` is the trained model:
    keys as peft names them on the Hugging Face model inside ours, and every module with a
    trained parameter (the head, norms, biases) or a parameter the checkpoint lacked in
    `modules_to_save`, stored whole. A mean-pooled classifier's names keep their `model.`: they
    fit the checkpoint wrapped by hf_mean_pooled.mean_pooled, and peft refuses them on the
    checkpoint's own class, which would pool [CLS] instead."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    prefix, inner = _peft_base(model)
    kept_prefix = prefix if getattr(model, "pooling", "cls") == "mean" else ""
    adapters = {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}
    state = {}
    for name, module in adapters.items():
        key = f"base_model.model.{kept_prefix}{name.removeprefix(prefix)}"
        state[f"{key}.lora_A.weight"] = module.lora_A.detach().cpu().contiguous()
        state[f"{key}.lora_B.weight"] = module.lora_B.detach().cpu().contiguous()
    kept = _modules_to_save(model, prefix, inner, adapters)
    for name in kept:
        for key, value in model.get_submodule(prefix + name).state_dict().items():
            key = f"base_model.model.{kept_prefix}{name}.{key}"
            state[key] = value.detach().cpu().contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "adapter_model.safetensors")
    first = next(iter(adapters.values()))
    rank = first.lora_A.shape[0]
    LoraConfig(r=rank, lora_alpha=first.scaling * rank, bias="none",
               target_modules=[kept_prefix + name.removeprefix(prefix) for name in adapters],
               modules_to_save=[kept_prefix + name for name in kept] or None,
               fan_in_fan_out=_transposed(first.base_layer),
               base_model_name_or_path=getattr(inner, "name_or_path", None) or None,
               ).save_pretrained(folder)


def _peft_base(model: nn.Module) -> tuple[str, nn.Module]:
    """The model peft would wrap: the Hugging Face model inside ours ("model.", model.model)
    if there is one, else ours ("", model)."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "config") and hasattr(inner, "base_model"):
        return "model.", inner
    return "", model


def _modules_to_save(model: nn.Module, prefix: str, inner: nn.Module, adapters) -> list[str]:
    """Names (under `prefix`) of the modules that own a trained parameter outside the
    adapters, or a parameter the checkpoint did not hold."""
    fresh = set(getattr(inner, "newly_initialized", ()))
    owners = []
    for name, parameter in model.named_parameters():
        owner = name.rpartition(".")[0]
        if owner in adapters or not name.startswith(prefix):
            continue
        if parameter.requires_grad or name.removeprefix(prefix) in fresh:
            owners.append(owner.removeprefix(prefix))
    return list(dict.fromkeys(owners))
