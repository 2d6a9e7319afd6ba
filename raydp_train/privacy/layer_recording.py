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

from raydp_train.privacy.rule_registry import LayerCalls


class LayerRecorder:
    """Forward hooks on the covered layers that record their inputs and output gradients."""

    _recording: bool
    _swapped: dict[nn.Module, dict[str, Tensor]]  # real parameters, during a forward
    _calls: dict[nn.Module, LayerCalls]
    _handles: dict[nn.Module, tuple]
    _ghost_leaf: Tensor
    parameters: list[Tensor]

    def _hook(self, module: nn.Module) -> None:
        """Our pre-hook runs last before the forward (after any pre-hook of the user's that
        may use the parameters) and our forward hook first after it (before any hook that
        changes the output: the rules need d loss / d(the layer's own output))."""
        self._handles[module] = (
            module.register_forward_pre_hook(self._on_forward_pre),
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

    def _on_forward_pre(self, module: nn.Module, args: tuple) -> None:
        """Inside its own forward a layer computes with detached parameters (ghost
        differentiation); everywhere else the parameters still require grad."""
        if not self._recording or not torch.is_grad_enabled():
            return
        own = self._swapped.setdefault(module, {})
        for name, param in module._parameters.items():
            if param is not None and param.requires_grad:
                own[name] = param
                module._parameters[name] = param.detach()

    def _restore_parameters(self, module: nn.Module) -> None:
        module._parameters.update(self._swapped.pop(module, {}))

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Tensor):
        self._restore_parameters(module)
        # Under no_grad (a reentrant checkpoint's first pass) a call adds no gradient; the
        # checkpoint's recomputation in the backward is recorded instead.
        recorded = self._recording and torch.is_grad_enabled()
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

    @contextmanager
    def _ghost_differentiation(self) -> Iterator[None]:
        for p in self.parameters:
            p.grad = None  # a stray use's gradient must not add into the flat buffer
        self._recording = True
        try:
            yield
        finally:
            self._recording = False
            for module in list(self._swapped):  # a forward that raised left them swapped
                self._restore_parameters(module)
            for p in self.parameters:
                p.grad = None
            self._ghost_leaf.grad = None
            self.bind_grads()


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
