"""What `training.optimizer` may name, and `training.optimizer_options` pass: this package's
own single-tensor loops (sgd, adam, adamw: optim/updates.py, which spare each worker torch's
optimizer import) or any `torch.optim` class by its name (AdamW, RAdam, ...), with that
class's keyword arguments (`foreach`, `fused`, `betas`, ...). Checked when the pipeline is
read, each problem one line naming the field; torch is imported only to check a torch name.
"""

from __future__ import annotations

import inspect
from typing import Any

# Keywords of the package's own optimizers besides lr and weight_decay (training.momentum is
# SGD's momentum); their meaning is torch's.
OWN_OPTIMIZERS: dict[str, tuple[str, ...]] = {
    "sgd": ("dampening", "nesterov"),
    "adam": ("betas", "eps"),
    "adamw": ("betas", "eps"),
}
# Keywords the training section sets itself.
SET_ELSEWHERE = {"params": "training.param_groups", "lr": "training.lr and param_groups[].lr",
                 "weight_decay": "training.weight_decay and param_groups[].weight_decay"}
# torch.optim classes a private step cannot drive.
REFUSED = {
    "LBFGS": "its step() re-evaluates the loss through a closure, which would release more "
             "than the one noisy gradient a step is accounted for",
    "SparseAdam": "it needs sparse gradients, and a private step's noisy gradient is dense",
}


def torch_optimizer_names() -> list[str]:
    import torch.optim

    return sorted(name for name, value in vars(torch.optim).items()
                  if isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
                  and value is not torch.optim.Optimizer)


def keywords_of(name: str) -> tuple[str, ...]:
    """The keyword arguments the named optimizer takes besides those the section sets."""
    if name in OWN_OPTIMIZERS:
        return ("momentum", *OWN_OPTIMIZERS[name]) if name == "sgd" else OWN_OPTIMIZERS[name]
    import torch.optim

    parameters = inspect.signature(getattr(torch.optim, name).__init__).parameters
    return tuple(key for key, parameter in parameters.items()
                 if key not in ("self", *SET_ELSEWHERE)
                 and parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD))


def optimizer_problem(name: str, options: dict[str, Any],
                      momentum: float) -> tuple[str, str] | None:
    """(field, message) of the first problem of an optimizer and its options, or None."""
    if name not in OWN_OPTIMIZERS:
        known = torch_optimizer_names()
        if name not in known:
            return ("optimizer", (f"{name!r} is neither one of this package's "
                    f"({', '.join(OWN_OPTIMIZERS)}) nor a torch.optim class; torch.optim has "
                    f"{', '.join(known)}"))
        if name in REFUSED:
            return "optimizer", f"torch.optim.{name} cannot drive a private step: {REFUSED[name]}"
    allowed = keywords_of(name)
    for key in options:
        if key in SET_ELSEWHERE:
            return f"optimizer_options.{key}", f"set by {SET_ELSEWHERE[key]}, not here"
        if key == "momentum" or key not in allowed:
            where = "training.momentum" if key == "momentum" and "momentum" in allowed else None
            return (f"optimizer_options.{key}", f"set by {where}, not here" if where else
                    f"not a keyword of {_shown(name)}; it takes {', '.join(allowed) or 'none'}")
    if momentum and "momentum" not in allowed:
        return "momentum", f"{_shown(name)} takes no momentum; remove training.momentum"
    return None


def _shown(name: str) -> str:
    return name if name in OWN_OPTIMIZERS else f"torch.optim.{name}"
