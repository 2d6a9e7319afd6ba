"""Is a layer's first axis really the examples? (ARCHITECTURE.md §2.3)

Each pass checks that every covered layer's input has the batch's leading size. A lookup
whose ids have no example axis (a relative position bias looked up with [T, T] bucket ids)
passes that check whenever the micro-batch happens to hold T examples, and its T rows would be
taken for T examples: norms under-estimated, silently. So once per engine, on its first
micro-batch, the forward runs again without gradients on the batch grown by one row (its first
row repeated), and once more on the batch itself (a [T, T] lookup with T = B + 1 passes the
first), and every covered layer's input must have grown with it, in one of three ways:

- by one row: the examples are its first axis;
- by k rows, the last k repeating the first k: the examples are folded into the first axis,
  k rows each, example after example (tokens flattened to [B*T, d], windows to [B*W, N, d]).
  Its rule must take whole examples as [B, k, ...] (`Rule.folds_examples`);
- not at all, from one row: a table shared by every example ([1, N] position ids), broadcast
  against the examples later. Such a call is expanded to one row per example, and kept so only
  if the expanded forward gives the model's very losses: each example then reads its own copy.

Any other call (a relative position bias looked up with [T, T] bucket ids, or computed from no
input at all) is shared by the examples: its module takes the per-example path with each
example's output gradient from a backward of its own (shared_calls.py), or, under
`privacy.other_layers: refuse`, is refused by name. The self-check (self_check.py) tests what
this probe establishes, leave-one-out, on the passes that follow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from raydp_train.privacy.covered_layers import BatchDimensionError
from raydp_train.privacy.random_state import random_state, restore_random_state


class ExampleAxes(NamedTuple):
    """What the probe found beyond plain per-example layers."""

    folded: frozenset  # modules whose calls hold k rows per example, example after example
    expanded: frozenset  # modules called with a shared [1, ...] input, expanded to the batch
    shared: frozenset  # modules whose calls are shared by the examples (shared_calls.py)


NO_CHANGE = ExampleAxes(frozenset(), frozenset(), frozenset())


def check_example_axis(layers: list, compute_losses: Callable[..., Tensor], args: tuple,
                       share: bool = True) -> ExampleAxes:
    """How each covered layer's input follows the batch from B to B + 1 (see above); with
    `share` False, a shared call is refused by name. Nothing happens without tensor arguments
    (a closure over its data), or when the model cannot take the grown batch."""
    size = leading_size(args)
    if size is None:
        return NO_CHANGE
    grown, batch = _grown(args), size + 1
    seen: dict[nn.Module, list[tuple]] = {}
    losses = _probe(layers, compute_losses, grown,
                    {m: _recorder(seen, m, rule, batch) for _, m, rule in layers})
    if losses is None:
        return NO_CHANGE
    # The same at the batch's own size: a [T, T] lookup with T = B + 1 passes the grown one.
    before: dict[nn.Module, list[tuple]] = {}
    _probe(layers, compute_losses, args,
           {m: _recorder(before, m, rule, size) for _, m, rule in layers})
    folded, one_row, shared = set(), [], {}
    for name, module, rule in layers:
        sizes = [rows for rows, _, _ in before.get(module, ())]
        for j, (rows, first, last) in enumerate(seen.get(module, ())):
            small = sizes[j] if j < len(sizes) else None  # None: calls differ in number
            k = rows // batch
            followed = rows and not rows % batch and small in (k * size, None)
            if rows == 1 and small in (1, None):
                one_row.append((name, module))
            elif not followed or (k > 1 and not (rule.folds_examples and _same_rows(first, last))):
                shared[module] = (name, rows)
            elif k > 1:
                folded.add(module)
    for name, module in _not_expandable(layers, compute_losses, grown, batch, losses, one_row):
        shared[module] = (name, 1)
    if shared and not share:
        module, (name, rows) = next(iter(shared.items()))
        raise _not_the_examples(name, module, rows, batch)
    expanded = {module for _, module in one_row} - set(shared)
    return ExampleAxes(frozenset(folded - set(shared)), frozenset(expanded), frozenset(shared))


def expanded_call(args: tuple, kwargs: dict, batch: int) -> tuple[tuple, dict]:
    """The call's tensor arguments with one leading row, expanded to `batch` rows."""
    def expand(x):
        if isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == 1:
            return x.expand(batch, *x.shape[1:])
        return x
    return tree_map(expand, (args, kwargs))


def leading_size(args: tuple) -> int | None:
    tensors = [x for x in tree_flatten(args)[0] if isinstance(x, Tensor) and x.dim() > 0]
    return tensors[0].shape[0] if tensors and tensors[0].shape[0] > 0 else None


def _not_expandable(layers: list, compute_losses, grown: tuple, batch: int, losses: Tensor,
                    one_row: list) -> list:
    """The one-row calls whose expansion changes the losses (the model does more than
    broadcast what they return against the examples): all of them, unless expanding them
    together keeps the losses; else those that change them alone (at least one)."""
    def keeps_losses(modules: set) -> bool:
        expanded = _probe(layers, compute_losses, grown, {}, _expander(modules, batch))
        return expanded is not None and _same(expanded, losses)

    if not one_row or keeps_losses({module for _, module in one_row}):
        return []
    return [(n, m) for n, m in one_row if not keeps_losses({m})] or one_row


def _probe(layers: list, compute_losses, args: tuple, recorders: dict,
           pre_hooks: dict | None = None) -> Tensor | None:
    """The losses of one forward without gradients (None if the model fails on it), with
    `recorders` and `pre_hooks` on their modules; the random state as before."""
    handles = [module.register_forward_pre_hook(hook, with_kwargs=True)
               for module, hook in {**recorders, **(pre_hooks or {})}.items()]
    state = random_state()
    try:
        with torch.no_grad():
            return compute_losses(*args)
    except Exception:  # noqa: BLE001 -- a model that takes only its own batch size
        return None
    finally:
        for handle in handles:
            handle.remove()
        restore_random_state(state)


def _expander(modules: set, batch: int) -> dict:
    def expand(module: nn.Module, args: tuple, kwargs: dict):
        return expanded_call(args, kwargs, batch)
    return {module: expand for module in modules}


def _same(a: Tensor, b: Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-7, equal_nan=True)


def _same_rows(first: Tensor, last: Tensor) -> bool:
    """The grown batch repeats its first example last: so do the rows, if folded."""
    if not first.is_floating_point():
        return torch.equal(first, last)
    scale = float(first.abs().max()) if first.numel() else 0.0
    return torch.allclose(last, first, rtol=1e-5, atol=1e-6 * max(scale, 1e-30))


def _not_the_examples(name: str, module: nn.Module, rows: int, batch: int):
    return BatchDimensionError(
        f"module '{name}' ({type(module).__name__}) is called with an input whose first axis "
        f"is not the examples: {rows} rows for a batch of {batch} (ids or positions without "
        "an example axis, e.g. a relative position bias looked up with [T, T] bucket ids, or "
        "rows that are not grouped example by example); per-example clipping needs the "
        "examples first: pass per-example inputs, freeze it, or set privacy.other_layers: "
        "per_example (one backward per example for its gradients)")


def _recorder(seen: dict, module: nn.Module, rule, batch: int):
    """Keeps, for each call, its leading size and, if folded k rows an example, its first
    and last k rows (of the argument its rule reads the examples from)."""
    def record(layer: nn.Module, args: tuple, kwargs: dict) -> None:
        x = rule.examples_in(layer, args, kwargs)
        if x is None:  # computed from no input at all: shared by the examples
            seen.setdefault(module, []).append((0, None, None))
        else:
            k = max(x.shape[0] // batch, 1)
            seen.setdefault(module, []).append((x.shape[0], x[:k].clone(), x[-k:].clone()))
    return record


def _grown(args: tuple) -> tuple:
    """Every tensor of `args` with its first row repeated once more at the end."""
    leaves, spec = tree_flatten(args)
    grown = [torch.cat([x, x[:1]]) if isinstance(x, Tensor) and x.dim() > 0 else x
             for x in leaves]
    return tree_unflatten(grown, spec)
