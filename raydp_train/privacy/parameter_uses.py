"""Naming a stray use: the module and function that used a trained parameter outside its own
layer's forward.

The layer rules (layer_rules.py) see a parameter only through its module's forward: the input
the forward hook keeps and the gradient of that call's output. A parameter used anywhere else
adds a gradient path the rules never see -- e.g. a tied LM head written as
`F.linear(h, embedding.weight)`, or `nn.MultiheadAttention`, which uses `out_proj.weight`
without calling `out_proj`. The engine detects such a use in every pass by autograd itself
(clipping.py: the parameter gets a `.grad`); it then re-runs the forward under this audit,
where every torch function that takes a trained parameter and returns a tensor that requires
grad is checked against the module whose forward is running, to name the caller.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from raydp_train.privacy.owned_parameters import owned_parameters
from raydp_train.privacy.rule_registry import UnsupportedLayerError


class ParameterUseError(UnsupportedLayerError):
    """A trained parameter is used outside its own layer's forward."""


class ParameterUseAudit:
    """Watches one forward pass for uses of trained parameters outside their owner's forward."""

    def __init__(self, model: nn.Module, owned: dict[nn.Module, str]):
        """`owned`: each covered module and its name; their trained parameters are watched."""
        self.module_names = {id(m): name or "<root>" for name, m in model.named_modules()}
        # Each trained parameter's owners (several for tied weights) and first name.
        self.owner_of: dict[int, tuple[list[nn.Module], str]] = {}
        for module, name in owned.items():
            for param_name, p in owned_parameters(module).items():
                if p.requires_grad:
                    qualified = f"{name}.{param_name}" if name != "<root>" else param_name
                    self.owner_of.setdefault(id(p), ([], qualified))[0].append(module)

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Raise ParameterUseError at the end of the block if a parameter was used elsewhere."""
        running: list[nn.Module] = []  # modules whose forward is running, innermost last

        def entered(module: nn.Module, args: tuple) -> None:
            running.append(module)

        def left(module: nn.Module, args: tuple, output) -> None:
            running.pop()  # returns None: the output stays as it is

        pre = module_hooks.register_module_forward_pre_hook(entered)
        post = module_hooks.register_module_forward_hook(left, always_call=True)
        mode = _UseRecorder(self.owner_of, running)
        try:
            with mode:
                yield
        finally:
            pre.remove()
            post.remove()
        if mode.stray_uses:
            raise ParameterUseError(self._message(*mode.stray_uses[0]))

    def refuse(self, stray: list[Tensor], rerun) -> None:
        """Run the pass again (`rerun()`, with the same random draws) under the audit, which
        names the module and function of a stray use; a use it cannot see (inside a custom
        autograd.Function, a hook) is refused by the parameter's name."""
        with self.watching():
            rerun()
        names = ", ".join(f"'{self.owner_of[id(p)][1]}'" for p in stray)
        raise ParameterUseError(
            f"trained parameter(s) {names} reached the loss outside their own layer's forward "
            "(e.g. through a custom torch.autograd.Function, a hook, or a functional use of "
            "the weight); per-example clipping sees a parameter only where its layer is "
            "called, so this share would be missing from the clipped gradient. Call the layer "
            "itself, untie or freeze the parameter"
        )

    def _message(self, parameter_name: str, caller: nn.Module | None, function: str) -> str:
        where = (
            f"module '{self.module_names.get(id(caller), '?')}' ({type(caller).__name__})"
            if caller is not None else "code outside any module"
        )
        return (
            f"trained parameter '{parameter_name}' is used by {where} through {function}, "
            "outside its own layer's forward; per-example clipping sees a parameter only "
            "where its layer is called, so this use would be missing from the clipped "
            "gradient. Call the layer itself, untie or freeze the parameter"
        )


class _UseRecorder(TorchFunctionMode):
    def __init__(self, owner_of: dict, running: list[nn.Module]):
        super().__init__()
        self.owner_of, self.running = owner_of, running
        self.stray_uses: list[tuple[str, nn.Module | None, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled() and _any_requires_grad(result):
            caller = self.running[-1] if self.running else None
            for value in tree_leaves((args, kwargs)):
                owner = self.owner_of.get(id(value)) if isinstance(value, Tensor) else None
                if owner is not None and caller not in owner[0]:
                    self.stray_uses.append((owner[1], caller, _function_name(func)))
        return result


def _any_requires_grad(result) -> bool:
    return any(isinstance(v, Tensor) and v.requires_grad for v in tree_leaves(result))


def _function_name(func) -> str:
    module = getattr(func, "__module__", None) or ""
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
    return f"{module}.{name}" if module else name
