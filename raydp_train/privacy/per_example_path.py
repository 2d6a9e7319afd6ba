"""The per-example path: a module without a rule, its own parameters' per-example gradients
by `torch.func` (ARCHITECTURE.md §2.3, `privacy.other_layers: per_example`).

For each call the hooks recorded (every argument and the gradient of the loss with respect to
every tensor of the output), example i's gradient of the module's own trained parameters is

    grad_i = VJP of  p -> functional_call(module, p, args_i)  at the output gradients of row i

with args_i the call's arguments at row i (a batch of one), vmapped over i (`torch.func.vmap`;
a module whose operators vmap cannot batch is looped over, example by example). Calls add up.
The gradients are materialized [B, *parameter] for this module's own parameters only, and
feed the same joint norm, clip factor and clipped sum as every other rule. A forward that draws
random numbers (dropout) is refused: the recomputation would draw other ones.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch import Tensor, nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from raydp_train.privacy.owned_parameters import owned_parameters
from raydp_train.privacy.random_state import random_state
from raydp_train.privacy.rule_registry import LayerCalls, Rule, UnsupportedLayerError, fold

# The most memory one module's per-example gradients may take ([B, *parameters]): beyond it,
# the module is refused by name (freeze it, register a rule, or lower the micro-batch).
MEMORY_LIMIT_BYTES = 2 * 2**30


class PerExamplePathRule(Rule):
    """Any module's own trained parameters, per example, by torch.func."""

    records_call = True  # the hooks keep every argument and every output tensor's gradient
    folds_examples = True  # example i's call is its k rows (per_example_gradients)

    def __init__(self):
        self.labels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def check(self, module: nn.Module, name: str) -> None:
        self.labels[module] = name

    def parameter_names(self, module: nn.Module) -> tuple[str, ...]:
        return tuple(owned_parameters(module))

    def squared_norms(self, module, calls: LayerCalls, slots: dict, gram_cache: dict) -> Tensor:
        label = self.labels.get(module, type(module).__name__)
        _check_memory(label, module, calls.inputs[0].shape[0], slots)
        try:
            grads = per_example_gradients(module, calls, tuple(slots))
        except RandomForwardError:
            raise UnsupportedLayerError(
                f"module '{label}' ({type(module).__name__}) takes the per-example path "
                "(privacy.other_layers: per_example) but its forward draws random numbers "
                "(dropout in training mode), which the per-example recomputation would draw "
                "again, differently; set its dropout to 0, or freeze its parameters") from None
        except NotPerExampleError as error:
            raise UnsupportedLayerError(
                f"module '{label}' ({type(module).__name__}) takes the per-example path, but "
                f"its examples' gradients do not add up to the batch's ({error}): its forward "
                "mixes the examples of a call, or takes an argument whose first axis is not "
                "the examples (a [T, T] mask with T equal to the batch size); give it "
                "per-example arguments, or freeze it") from None
        calls.state["grads"] = grads
        return sum(g.reshape(g.shape[0], -1).square().sum(1) for g in grads.values())

    def add_clipped_sum(self, module, calls: LayerCalls, clip_factors: Tensor, slots) -> None:
        for name, grads in calls.state["grads"].items():
            slots[name].add_(torch.einsum("b,b...->...", clip_factors.to(grads.dtype), grads))

    def per_example_gradient(self, module, calls: LayerCalls, slot: str) -> Tensor | None:
        return calls.state["grads"][slot]


PER_EXAMPLE_PATH = PerExamplePathRule()


def per_example_gradients(module: nn.Module, calls: LayerCalls,
                          names: tuple[str, ...]) -> dict[str, Tensor]:
    """{parameter name: [B, *shape]} summed over the recorded calls."""
    owned = owned_parameters(module)
    params = {name: owned[name].detach() for name in names}
    total: dict[str, Tensor] = {}
    batch = calls.inputs[0].shape[0]
    folds = calls.state.get("folds") or [1] * len(calls.arguments)
    for (args, kwargs), output_grads, k in zip(calls.arguments, calls.output_grads, folds):
        if output_grads is None:
            continue
        # torch.func differentiates inside; no_grad keeps the outer autograd from recording
        # the other layers' (trained) parameters along. oneDNN's float32 LSTM kernel keeps no
        # workspace under no_grad, and its backward then fails: the native kernels run here.
        with torch.no_grad(), torch.backends.mkldnn.flags(enabled=False):
            grads = _one_call(module, params, (args, kwargs), output_grads, batch, k)
            summed = output_grads if k else [None if g is None else g.sum(0)
                                              for g in output_grads]
            _check_the_sum(module, params, args, kwargs, summed, grads)
        grads = {n: g.detach() for n, g in grads.items()}
        total = {n: total[n] + g for n, g in grads.items()} if total else grads
    return total


def _one_call(module, params: dict, call: tuple, output_grads: list, batch: int,
              k: int) -> dict[str, Tensor]:
    """Example i's call: the rows i k .. i k + k - 1 of every argument with k * batch rows
    (k = 1 but for examples folded into the first axis, example_axis.py); k = 0: the whole
    call, shared by the examples, at example i's output gradients (shared_calls.py)."""
    leaves, spec = tree_flatten(call)
    batched = [k > 0 and isinstance(x, Tensor) and x.dim() > 0 and x.shape[0] == batch * k
               for x in leaves]
    dtype = next(iter(params.values())).dtype
    rows = [fold(x.to(dtype) if x.is_floating_point() else x, batch)
            for x, b in zip(leaves, batched) if b]
    cotangents = [fold(g, batch) if k and g is not None else g for g in output_grads]

    def example(example_rows: list, example_cotangents: list) -> dict[str, Tensor]:
        filled = iter(example_rows)
        call_leaves = [next(filled) if b else x for x, b in zip(leaves, batched)]
        call_args, call_kwargs = tree_unflatten(call_leaves, spec)

        def outputs(p):
            return tuple(_tensors(functional_call(module, p, call_args, call_kwargs)))

        values, pull_back = vjp(outputs, params)
        seeds = tuple(torch.zeros_like(v) if g is None else g.to(v.dtype)
                      for v, g in zip(values, example_cotangents))
        return pull_back(seeds)[0]

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*performance drop.*")
        try:
            return vmap(example, randomness="error")(rows, cotangents)
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as error:
            if "random" in str(error).lower():
                raise _draws_random_numbers(module) from None
        try:
            return _loop(module, example, rows, cotangents, batch)
        except RandomForwardError:
            raise
        except (RuntimeError, NotImplementedError, ValueError, TypeError,
                IndexError) as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            raise NotPerExampleError(f"one example alone fails: {first_line[:200]}") from None


class NotPerExampleError(ValueError):
    """The examples' gradients of a call do not add up to the call's batch gradient."""


def _check_the_sum(module, params: dict, args: tuple, kwargs: dict, output_grads: list,
                   grads: dict[str, Tensor]) -> None:
    """sum_i grad_i must be the VJP of the whole call: it is not when the forward mixes
    examples, or when an argument was sliced by example that is not one (a [T, T] mask with
    T = B). One more forward and backward of this module, on the whole batch."""
    dtype = next(iter(params.values())).dtype
    call_args, call_kwargs = tree_map(
        lambda x: x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x,
        (args, kwargs))

    def outputs(p):
        return tuple(_tensors(functional_call(module, p, call_args, call_kwargs)))

    values, pull_back = vjp(outputs, params)
    seeds = tuple(torch.zeros_like(v) if g is None else g.to(v.dtype)
                  for v, g in zip(values, output_grads))
    whole = pull_back(seeds)[0]
    # Modules that compute in float32 inside a float64 model (transformers' norms) round so.
    tolerance = torch.finfo(torch.float32).eps ** 0.5
    for name, batch_grad in whole.items():
        summed = grads[name].sum(0)
        scale = max(float(grads[name].reshape(grads[name].shape[0], -1).norm(dim=1).sum()),
                    1e-30)
        error = float((summed - batch_grad).norm()) / scale
        if error > tolerance:
            raise NotPerExampleError(f"'{name}' off by {error:.2g} of its examples' norms")


def _loop(module, example, rows: list, cotangents: list, batch: int) -> dict[str, Tensor]:
    """One example at a time, for operators vmap cannot batch (GRU); refuses randomness."""
    per_example = []
    for i in range(batch):
        before = random_state()[0]
        per_example.append(example([x[i] for x in rows],
                                   [None if g is None else g[i] for g in cotangents]))
        if not torch.equal(before, random_state()[0]):
            raise _draws_random_numbers(module)
    return {name: torch.stack([grads[name] for grads in per_example]) for name in per_example[0]}


def _tensors(output) -> list[Tensor]:
    """The floating-point tensors of a module's output, in `tree_flatten` order."""
    leaves, _ = tree_flatten(output)
    return [x for x in leaves if isinstance(x, Tensor) and x.is_floating_point()]


class RandomForwardError(RuntimeError):
    """The module's forward drew random numbers during the per-example recomputation."""


def _draws_random_numbers(module: nn.Module) -> RandomForwardError:
    return RandomForwardError(type(module).__name__)


def _check_memory(label: str, module: nn.Module, batch: int, slots: dict) -> None:
    size = batch * sum(view.numel() * view.element_size() for view in slots.values())
    if size > MEMORY_LIMIT_BYTES:
        raise UnsupportedLayerError(
            f"module '{label}' ({type(module).__name__}) takes the per-example path, whose "
            f"per-example gradients would take {size / 2**30:.1f} GiB for {batch} examples "
            f"(more than {MEMORY_LIMIT_BYTES / 2**30:.0f} GiB); lower "
            "training.max_physical_batch, freeze the module, or register a rule for it "
            "(raydp_train.register_rule)")
