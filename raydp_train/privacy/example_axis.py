"""Is a layer's first axis really the examples? (ARCHITECTURE.md §2.3)

Each pass checks that every covered layer's input has the batch's leading size. A lookup
whose ids have no example axis (a relative position bias looked up with [T, T] bucket ids)
passes that check whenever the micro-batch happens to hold T examples, and its T rows would be
taken for T examples: norms under-estimated, silently. So once per engine, on its first
micro-batch, the forward runs again without gradients on the batch grown by one row (its first
row repeated), and every covered layer's input must have grown with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from raydp_train.privacy.covered_layers import BatchDimensionError
from raydp_train.privacy.random_state import random_state, restore_random_state


def check_example_axis(layers: list, compute_losses: Callable[..., Tensor], args: tuple) -> None:
    """Refuse, by name, a covered layer whose input's leading size did not follow the batch
    from B to B + 1. Nothing happens without tensor arguments (a closure over its data), or
    when the model cannot take the grown batch."""
    sizes = _leading_size(args)
    if sizes is None:
        return
    seen: dict[nn.Module, set[int]] = {}
    handles = [module.register_forward_pre_hook(_recorder(seen, module, rule), with_kwargs=True)
               for _, module, rule in layers]
    state = random_state()
    try:
        with torch.no_grad():
            compute_losses(*_grown(args))
    except Exception:  # noqa: BLE001 -- a model that takes only its own batch size
        return
    finally:
        for handle in handles:
            handle.remove()
        restore_random_state(state)
    for name, module, _ in layers:
        stayed = seen.get(module, set()) - {sizes + 1}
        if stayed:
            raise BatchDimensionError(
                f"module '{name}' ({type(module).__name__}) is called with an input whose "
                f"first axis is not the examples: {min(stayed)} rows for a batch of "
                f"{sizes + 1} (ids or positions without an example axis, e.g. a relative "
                "position bias looked up with [T, T] bucket ids, or tokens flattened to "
                "[B*T, d]); per-example clipping needs the examples first: pass per-example "
                "inputs, or freeze it")


def _recorder(seen: dict, module: nn.Module, rule):
    def record(layer: nn.Module, args: tuple, kwargs: dict) -> None:
        first = rule.examples_in(layer, args, kwargs)
        if first is not None:
            seen.setdefault(module, set()).add(first.shape[0])
    return record


def _leading_size(args: tuple) -> int | None:
    tensors = [x for x in tree_flatten(args)[0] if isinstance(x, Tensor) and x.dim() > 0]
    return tensors[0].shape[0] if tensors and tensors[0].shape[0] > 0 else None


def _grown(args: tuple) -> tuple:
    """Every tensor of `args` with its first row repeated once more at the end."""
    leaves, spec = tree_flatten(args)
    grown = [torch.cat([x, x[:1]]) if isinstance(x, Tensor) and x.dim() > 0 else x
             for x in leaves]
    return tree_unflatten(grown, spec)
