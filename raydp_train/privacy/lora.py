"""DP-LoRA (ARCHITECTURE.md §2.9; Yu et al. 2022): low-rank adapters made by `peft` on chosen
Linear layers, their base weights frozen. The adapters' A and B are plain `nn.Linear`
modules, so the engine clips their per-example gradients with the Linear rule, in the same one
backward as every other trained parameter; noise and accounting are DP-SGD's."""

from __future__ import annotations

import fnmatch
import re
from copy import deepcopy
from pathlib import Path

import torch
from torch import nn

from raydp_train.errors import UserError


class LoraSetupError(UserError, ValueError):
    """The pipeline's privacy.lora settings do not fit the model; the message names the field."""


def add_adapters(model: nn.Module, settings, seed: int) -> list[str]:
    """Give the chosen trainable Linear layers a LoRA adapter (A random from `seed`, B zero, so
    the model starts unchanged); freeze their base weights, and the other trainable
    parameters too with `train_other: freeze`. The names of the adapted layers."""
    from peft import LoraConfig, inject_adapter_in_model

    targets = adapted_layers(model, settings)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                        lora_dropout=settings.dropout, bias="none",
                        target_modules="^(" + "|".join(map(re.escape, targets)) + ")$")
    with torch.random.fork_rng(devices=[]):  # every rank draws the same A
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model)
    for name, parameter in model.named_parameters():
        # An adapted layer's own weight is now `<layer>.base_layer.weight`: not in `trainable`.
        keep_training = name in trainable and settings.train_other != "freeze"
        parameter.requires_grad_(".lora_" in name or keep_training)
    return targets


def adapted_layers(model: nn.Module, settings) -> list[str]:
    """Trainable Linear layers named by `settings.layers`, or with min(in, out) > rank."""
    linear = {name: m for name, m in model.named_modules()
              if type(m) is nn.Linear and m.weight.requires_grad}
    if settings.layers is None:
        chosen = [n for n, m in linear.items() if min(m.in_features, m.out_features) > settings.rank]
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
    """A copy of `model` with each adapter merged into its base weight (W + (alpha/r) B A) and
    the plain layer put back: the architecture the model was built with."""
    from peft.tuners.lora import LoraLayer

    plain = deepcopy(model)
    for name, module in list(plain.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            owner, _, attribute = name.rpartition(".")
            setattr(plain.get_submodule(owner), attribute, module.get_base_layer())
    return plain


def save_adapter(model: nn.Module, folder: Path) -> None:
    """The adapters alone, in peft's format (adapter_config.json, adapter_model.safetensors)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    save_file(state, folder / "adapter_model.safetensors")
    model.peft_config["default"].save_pretrained(folder)
