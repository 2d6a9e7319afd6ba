"""What the clipping engine records of one pass (ARCHITECTURE.md §2.3): each covered layer's
input, and the gradient of the loss with respect to its own output, through forward hooks
that stay innermost. Inside its own forward a layer computes with detached parameters (ghost
differentiation), so the backward forms activation gradients only; a trained parameter that
still gets a `.grad` was used outside its layer.

`LayerRecorder` is the part of `clipping.PerExampleClipper` that hooks; it uses the
clipper's `parameters`, `bind_grads` and per-pass `_calls`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from raydp_train.privacy.covered_layers import BatchDimensionError
from raydp_train.privacy.example_axis import ExampleAxes, expanded_call
from raydp_train.privacy.owned_parameters import owned_parameters
from raydp_train.privacy.rule_registry import LayerCalls, Rule, UnsupportedLayerError, fold
from raydp_train.privacy.shared_calls import SharedOutputs


class LayerRecorder:
    """Forward hooks on the covered layers that record their inputs and output gradients."""

    _recording: bool
    _swapped: dict[nn.Module, dict[str, Tensor]]  # real parameters, during a forward
    _contexts: list  # (module, the context its rule entered for its forward), innermost last
    _calls: dict[nn.Module, LayerCalls]
    _handles: dict[nn.Module, tuple]
    _ghost_leaf: Tensor
    _records_call: dict[nn.Module, Rule]  # modules whose rule keeps every argument and output
    _axes: ExampleAxes  # folded and shared-table layers (example_axis.py)
    _pass_batch: int | None  # the examples of the pass being recorded
    _shared_outputs: SharedOutputs  # the outputs of the pass's shared calls
    parameters: list[Tensor]
    layers: list  # (name, module, rule) of every covered layer

    def _hook(self, module: nn.Module) -> None:
        """Our pre-hook runs last before the forward (after any pre-hook of the user's that
        may use the parameters) and our forward hook first after it (before any hook that
        changes the output: the rules need d loss / d(the layer's own output))."""
        self._handles[module] = (
            module.register_forward_pre_hook(self._on_forward_pre, with_kwargs=True),
            module.register_forward_hook(self._on_forward, with_kwargs=True, prepend=True),
        )

    def _keep_hooks_innermost(self) -> None:
        """Hooks registered on a layer after this engine would wrap ours: hook again."""
        for module, (pre, post) in self._handles.items():
            if (next(reversed(module._forward_pre_hooks)) != pre.id
                    or next(iter(module._forward_hooks)) != post.id):
                pre.remove()
                post.remove()
                self._hook(module)

    def _on_forward_pre(self, module: nn.Module, args: tuple, kwargs: dict):
        """Inside its own forward a layer computes with detached parameters (ghost
        differentiation); everywhere else the parameters still require grad. A shared
        table's call reads one copy per example."""
        if not self._recording:
            return None
        if torch.is_grad_enabled():
            self._detach_own(module)
        if module in self._axes.expanded and (self._pass_batch or 1) > 1:
            return expanded_call(args, kwargs, self._pass_batch)
        return None

    def _detach_own(self, module: nn.Module) -> None:
        own = self._swapped.setdefault(module, {})
        for name, param in owned_parameters(module).items():
            owner, leaf = _owner(module, name)
            own[name] = param
            owner._parameters[leaf] = param.detach()
        rule = self._records_call.get(module)
        context = rule and rule.during_forward(module, self._calls.setdefault(module, LayerCalls()),
                                               self._ghost_leaf)
        if context is not None:  # the rule's own view of the forward (attention_rule.py)
            context.__enter__()
            self._contexts.append((module, context))

    def _leave_context(self, module: nn.Module) -> None:
        while self._contexts and any(m is module for m, _ in self._contexts):
            self._contexts.pop()[1].__exit__(None, None, None)

    def _restore_parameters(self, module: nn.Module) -> None:
        for name, param in self._swapped.pop(module, {}).items():
            owner, leaf = _owner(module, name)
            owner._parameters[leaf] = param

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Tensor):
        self._leave_context(module)
        self._restore_parameters(module)
        # Under no_grad (a reentrant checkpoint's first pass) a call adds no gradient; the
        # checkpoint's recomputation in the backward is recorded instead.
        recorded = self._recording and torch.is_grad_enabled()
        if recorded and module in self._records_call:
            return self._record_whole_call(module, args, kwargs, output)
        if not recorded or not isinstance(output, Tensor):
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

    def _record_whole_call(self, module: nn.Module, args: tuple, kwargs: dict, output):
        """Every argument, and the gradient of every floating-point tensor of the output (for
        a call shared by the examples: each example's, shared_calls.py)."""
        shared = module in self._axes.shared
        layer_input = self._records_call[module].examples_in(module, args, kwargs)
        if shared:
            layer_input = torch.empty(self._pass_batch or 0, 0)
        if layer_input is None:
            label = next(name for name, layer, _ in self.layers if layer is module)
            raise UnsupportedLayerError(
                f"module '{label}' ({type(module).__name__}) is called without the examples "
                "(no tensor argument with the example axis first), so its parameters are "
                "shared by every example of the batch (a relative position bias table), which "
                "per-example clipping cannot attribute to one example; freeze it")
        calls = self._calls.setdefault(module, LayerCalls())
        calls.inputs.append(layer_input.detach())
        calls.input_versions.append(layer_input._version)
        calls.arguments.append(tree_map(
            lambda x: x.detach() if isinstance(x, Tensor) else x, (args, kwargs)))
        leaves, spec = tree_flatten(output)
        floating = [i for i, x in enumerate(leaves)
                    if isinstance(x, Tensor) and x.is_floating_point()]
        grads: list[Tensor | None] = [None] * len(floating)
        calls.output_grads.append(grads)
        if shared:
            for i in floating:
                leaves[i] = leaves[i] if leaves[i].requires_grad else leaves[i] + self._ghost_leaf
            self._shared_outputs.add(calls, len(calls.output_grads) - 1,
                                     [leaves[i] for i in floating])
            return tree_unflatten(leaves, spec)
        for k, i in enumerate(floating):
            tensor = leaves[i] if leaves[i].requires_grad else leaves[i] + self._ghost_leaf

            def keep_grad(grad: Tensor, k: int = k, shape=tensor.shape) -> None:
                grads[k] = grad.detach().reshape(shape)

            leaves[i] = _hooked_output(tensor, keep_grad)
        return tree_unflatten(leaves, spec)

    def _used_layers(self, batch_size: int) -> list:
        """Layers that took part in the loss, after checking their example dimension."""
        self._check_inputs_unchanged()
        used = []
        for name, module, rule in self.layers:
            calls = self._calls.get(module)
            if calls is None:
                continue
            self._fold_examples(name, module, calls, batch_size)
            # A call whose output did not reach the loss contributes a zero gradient.
            kept = [k for k, g in enumerate(calls.output_grads) if _reached_the_loss(g)]
            if kept:
                calls.inputs = [calls.inputs[k] for k in kept]
                calls.output_grads = [calls.output_grads[k] for k in kept]
                calls.arguments = [calls.arguments[k] for k in kept] if calls.arguments else []
                if "folds" in calls.state:
                    calls.state["folds"] = [calls.state["folds"][k] for k in kept]
                used.append((name, module, rule))
        return used

    def _fold_examples(self, name: str, module: nn.Module, calls: LayerCalls,
                       batch_size: int) -> None:
        """Each call's input, and output gradient, as [B, ...], or as [B, k, ...] where the
        probe found k rows an example (example_axis.py); a per-example-path call keeps its
        arguments as they were and learns each call's k."""
        if module in self._axes.shared:
            calls.state["folds"] = [0] * len(calls.inputs)  # no argument is by example
            return
        folds = []
        for x in calls.inputs:
            rows = x.shape[0]
            if rows != batch_size and not (module in self._axes.folded and batch_size
                                           and rows % batch_size == 0):
                raise BatchDimensionError(
                    f"module '{name}' ({type(module).__name__}) was called with leading "
                    f"dimension {rows} but the batch has {batch_size} examples; "
                    "per-example clipping needs the example dimension first (e.g. pass "
                    "position_ids of shape [B, T], not [1, T])"
                )
            folds.append(rows // batch_size if batch_size else 1)
        if module not in self._axes.folded:
            return
        calls.state["folds"] = folds
        calls.inputs = [fold(x, batch_size) for x in calls.inputs]
        if module not in self._records_call:
            calls.output_grads = [None if g is None else fold(g, batch_size)
                                  for g in calls.output_grads]

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

    @contextmanager
    def _ghost_differentiation(self) -> Iterator[None]:
        for p in self.parameters:
            p.grad = None  # a stray use's gradient must not add into the flat buffer
        self._recording = True
        try:
            yield
        finally:
            self._recording = False
            while self._contexts:  # a forward that raised left them entered
                self._contexts.pop()[1].__exit__(None, None, None)
            for module in list(self._swapped):  # a forward that raised left them swapped
                self._restore_parameters(module)
            for p in self.parameters:
                p.grad = None
            self._ghost_leaf.grad = None
            self.bind_grads()


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module that holds the (dotted) parameter `name` of `module`, and its own name."""
    prefix, _, leaf = name.rpartition(".")
    return (module.get_submodule(prefix) if prefix else module), leaf


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


def _reached_the_loss(output_grads) -> bool:
    """A call's output gradient arrived (for a whole recorded call: any of its tensors')."""
    if isinstance(output_grads, list):
        return any(g is not None for g in output_grads)
    return output_grads is not None
