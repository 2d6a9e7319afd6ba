"""Frozen weights kept in a lower precision (`model.frozen_dtype`): a frozen base holds half
the memory in bf16 or fp16, while what trains (adapters, LSG's layers, the head, norms) stays
in its own dtype.

Run after the mechanism has frozen what it freezes. A module all of whose own parameters are
frozen is cast, and hooked: its floating-point inputs are cast to that dtype before its forward
and its floating-point outputs back to the trained parameters' dtype after it, so every trained
layer reads and returns what it did, and the clipping engine (which sees only trained layers)
is exact for the function the model computes. A frozen weight read outside its module's
forward (LoRA's merged weight W + s B A) is promoted by the arithmetic itself.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_map

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def keep_frozen_in(model: nn.Module, frozen_dtype: str) -> int:
    """Cast and hook the wholly frozen modules (above); the bytes this saves."""
    dtype = DTYPES[frozen_dtype]
    trained = next((p.dtype for p in model.parameters() if p.requires_grad), None)
    if dtype == torch.float32 or trained is None:
        return 0
    saved = 0
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if not own or any(p.requires_grad or not p.is_floating_point() for p in own):
            continue
        saved += sum(p.numel() * (p.element_size() - dtype.itemsize) for p in own)
        _keep_in(module, dtype, trained)
    return saved


def keep_as_saved(model: nn.Module, state: dict) -> None:
    """A released model rebuilt in full precision, each module whose weights `state` (its
    model.pt, which keeps every tensor's dtype) holds in bf16 or fp16 kept and computed so
    again: its predictions are the run's own evaluation's."""
    trained = next(iter(model.parameters())).dtype
    for prefix, module in model.named_modules():
        names = [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=False)]
        dtypes = {state[n].dtype for n in names if n in state}
        if names and all(n in state for n in names) and len(dtypes) == 1 \
                and dtypes <= {torch.bfloat16, torch.float16}:
            _keep_in(module, dtypes.pop(), trained)


def _keep_in(module: nn.Module, dtype: torch.dtype, trained: torch.dtype) -> None:
    """The module's own parameters in `dtype`; its inputs cast to it, its outputs back."""
    for param in module.parameters(recurse=False):
        param.data = param.data.to(dtype)
    module.register_forward_pre_hook(_cast_inputs, with_kwargs=True)
    module.register_forward_hook(_cast_outputs(trained))


def _cast_inputs(module: nn.Module, args: tuple, kwargs: dict):
    """To the dtype its weights hold now (a LoRA layer merged for release holds fp32 ones)."""
    dtype = next(module.parameters(recurse=False)).dtype
    return tree_map(lambda x: _to(x, dtype), (args, kwargs))


def _cast_outputs(dtype: torch.dtype):
    def cast(module: nn.Module, args: tuple, output):
        return tree_map(lambda x: _to(x, dtype), output)
    return cast


def _to(x, dtype: torch.dtype):
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
