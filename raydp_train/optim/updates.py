"""SGD, Adam and AdamW: the update a worker applies to the released noisy gradient.

They are written here rather than taken from torch.optim because torch's optimizers import
torch._dynamo when first built and stepped: a second of CPU in every worker of every run
(benchmarks/RESULTS.md). Each update is torch's single-tensor one, operation for operation,
and the state dict is in torch's format, so checkpoints move between the two either way
(tests/test_optim.py holds both to torch, bit for bit). The optimizer only post-processes the
noisy gradient: nothing here touches clipping, noise or accounting.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor


class Optimizer:
    """Parameter groups (dicts with "params" and the hyperparameters), per-parameter state,
    and one `step()` over every parameter that has a `.grad`."""

    defaults: ClassVar[dict] = {}

    def __init__(self, groups: list[dict], **options):
        self.param_groups = [{**self.defaults, **options, **group} for group in groups]
        self.state: dict[Tensor, dict] = {}

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.update(param, param.grad, group)

    def update(self, param: Tensor, grad: Tensor, group: dict) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """torch's layout: parameters numbered in group order, state keyed by that number."""
        number = {}
        groups = []
        for group in self.param_groups:
            for param in group["params"]:
                number.setdefault(param, len(number))
            groups.append({**group, "params": [number[p] for p in group["params"]]})
        state = {number[param]: values for param, values in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, saved: dict) -> None:
        """Restore a state dict of this optimizer or of torch's same-named one; the saved
        hyperparameters replace the current ones, as torch's `load_state_dict` does."""
        saved_groups = saved["param_groups"]
        if _group_sizes(saved_groups) != _group_sizes(self.param_groups):
            raise ValueError("optimizer state: its parameter groups do not match this model's "
                             "(a checkpoint of another pipeline?)")
        params = {}
        for group, saved_group in zip(self.param_groups, saved_groups):
            params.update(zip(saved_group["params"], group["params"]))
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        self.state = {params[number]: {key: _placed(value, params[number], key)
                                       for key, value in values.items()}
                      for number, values in saved["state"].items()}


def _group_sizes(groups: list[dict]) -> list[int]:
    return [len(group["params"]) for group in groups]


def _placed(value, param: Tensor, key: str):
    """A copy of a saved state tensor on the parameter's device, in its dtype; the step
    count keeps its own dtype (as in torch)."""
    if not isinstance(value, Tensor):
        return value
    if key == "step":
        return value.clone()
    return value.to(device=param.device, dtype=param.dtype, copy=True)


class SGD(Optimizer):
    """p <- p - lr * v, v <- momentum * v + (1 - dampening) * (g + weight_decay * p), v
    starting at that first gradient (torch's SGD; Nesterov's variant steps along
    g + momentum * v instead)."""

    defaults: ClassVar[dict] = {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0,
                                "weight_decay": 0.0, "nesterov": False}

    def update(self, param: Tensor, grad: Tensor, group: dict) -> None:
        if group["weight_decay"] != 0:
            grad = grad.add(param, alpha=group["weight_decay"])
        momentum = group["momentum"]
        if momentum != 0:
            state = self.state.setdefault(param, {})
            velocity = state.get("momentum_buffer")
            if velocity is None:
                velocity = state["momentum_buffer"] = grad.detach().clone()
            else:
                velocity.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
            grad = grad.add(velocity, alpha=momentum) if group["nesterov"] else velocity
        param.add_(grad, alpha=-group["lr"])


class Adam(Optimizer):
    """Adam with bias-corrected moments; weight decay added to the gradient (Adam) or
    decoupled, shrinking the parameter by lr * weight_decay first (AdamW)."""

    defaults: ClassVar[dict] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    decoupled_weight_decay = False

    def update(self, param: Tensor, grad: Tensor, group: dict) -> None:
        state = self.state.setdefault(param, {})
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                         exp_avg_sq=torch.zeros_like(param))
        lr, weight_decay, (beta1, beta2) = group["lr"], group["weight_decay"], group["betas"]
        state["step"] += 1
        if weight_decay != 0 and self.decoupled_weight_decay:
            param.mul_(1 - lr * weight_decay)
        elif weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = state["step"].item()
        step_size = lr / (1 - beta1 ** step)
        second_moment_correction = (1 - beta2 ** step) ** 0.5
        denominator = (state["exp_avg_sq"].sqrt() / second_moment_correction).add_(group["eps"])
        param.addcdiv_(state["exp_avg"], denominator, value=-step_size)


class AdamW(Adam):
    defaults: ClassVar[dict] = {**Adam.defaults, "weight_decay": 1e-2}
    decoupled_weight_decay = True
