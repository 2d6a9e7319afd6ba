"""`model.kind: torch`: a model from the user's own code.

`model.factory` is "file.py:function" (a path, made absolute against the pipeline's folder by
config/paths.py) or "package.module:function" (importable on the driver and every worker: an
installed package, or the job's working directory). The function gets `model.kwargs`, plus
`feature_shape` and `num_classes` where its signature takes them, and returns an nn.Module
mapping [B, *feature_shape] to [B, num_classes] outputs (num_classes: the classes, or the
width of `data.label_kind` real or multi_hot labels). `model.loss`, named the same way, is
the per-example training loss (outputs, labels) -> [B] (default: the label kind's, e.g.
cross-entropy); each call is checked to give one loss per example. The clipping engine's checks apply as
to every model: an unsupported layer or a parameter used outside its module is refused by
name, before anything is spent.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from raydp_train.errors import UserError
from raydp_train.privacy.fixes import fix


class CustomModelError(UserError, ValueError):
    """model.factory cannot be imported, called, or does not give a fitting nn.Module."""


def custom_model(config, feature_shape: tuple[int, ...], num_classes: int,
                 on_fix: Callable[[str], None] | None = None) -> nn.Module:
    """The factory's model, with `model.fix`'s changes (each line to `on_fix`)."""
    factory = load_function(config.factory)
    offered = {"feature_shape": tuple(feature_shape), "num_classes": num_classes}
    takes = inspect.signature(factory).parameters
    extra = {k: v for k, v in offered.items() if k in takes and k not in config.kwargs}
    try:
        model = factory(**config.kwargs, **extra)
    except Exception as error:  # the user's code: say where, keep the cause
        raise CustomModelError(f"model.factory: {config.factory} raised {type(error).__name__}: "
                               f"{error} (model.kwargs: {config.kwargs})") from error
    if not isinstance(model, nn.Module):
        raise CustomModelError(f"model.factory: {config.factory} returned "
                               f"{type(model).__name__}, not a torch nn.Module")
    if config.fix:
        for line in fix(model):
            (on_fix or _silent)(line)
    _check_output(model, config.factory, feature_shape, num_classes)
    return model


def _silent(line: str) -> None:
    """Workers build the model too: the driver's preflight says what was fixed, once."""


def load_function(spec: str, field: str = "model.factory") -> Callable:
    """The function `spec` ("file.py:function" or "package.module:function") names."""
    target, _, name = spec.rpartition(":")
    module = _from_file(Path(target), field) if target.endswith(".py") else _imported(target,
                                                                                       field)
    function = getattr(module, name, None)
    if not callable(function):
        raise CustomModelError(f"{field}: {target} has no function {name!r}")
    return function


def training_loss(config, kind) -> Callable[[nn.Module, Tensor, Tensor], Tensor]:
    """The per-example training loss: `model.loss` of a torch model, else the label kind's
    (data/targets.py: cross-entropy for class ids). Each call checks that the user's function gave
    one loss per example."""
    spec = getattr(config, "loss", None)
    function = kind.loss if spec is None else load_function(spec, "model.loss")

    def losses(model: nn.Module, features: Tensor, labels: Tensor) -> Tensor:
        values = function(model(features), labels)
        if spec is not None and (not isinstance(values, Tensor)
                                 or tuple(values.shape) != (labels.shape[0],)):
            shape = list(values.shape) if isinstance(values, Tensor) else type(values).__name__
            raise CustomModelError(
                f"model.loss: {spec} must return one loss per example, shape [B], got {shape} "
                f"for B={labels.shape[0]} (reduction='none', not a mean: each example's loss is "
                "clipped on its own)")
        return values

    return losses


def _from_file(path: Path, field: str):
    if not path.is_file():
        raise CustomModelError(f"{field}: file not found: {path}")
    # Its folder on the import path, as for a script run from it: the file imports the files
    # beside it (`from layers import Block`), at its top or inside its functions, on every
    # worker that loads it.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    # One module per file, under a name of its own: loading it twice gives the same classes.
    name = "raydp_train_user_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise CustomModelError(f"{field}: running {path} raised "
                               f"{type(error).__name__}: {error}") from error
    return module


def _imported(target: str, field: str):
    try:
        return importlib.import_module(target)
    except ImportError as error:
        raise CustomModelError(
            f"{field}: cannot import {target!r} ({error}); install its package on every "
            "node, ship it in the job's working directory, or name a file: "
            "\"path/to/models.py:function\"") from error


def _check_output(model: nn.Module, factory: str, feature_shape: tuple[int, ...],
                  num_classes: int) -> None:
    """One forward pass on two zero examples: [2, num_classes] outputs, or a clear refusal."""
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    try:
        with torch.no_grad():
            output = model(torch.zeros(2, *feature_shape, device=device))
    except Exception as error:
        raise CustomModelError(f"model.factory: the model of {factory} fails on input of shape "
                               f"[B, {', '.join(map(str, feature_shape))}]: "
                               f"{type(error).__name__}: {error}") from error
    if not isinstance(output, torch.Tensor) or tuple(output.shape) != (2, num_classes):
        shape = list(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise CustomModelError(f"model.factory: the model of {factory} must map [B, "
                               f"{', '.join(map(str, feature_shape))}] to [B, {num_classes}] "
                               f"outputs ({num_classes}: the classes, or the labels' width), got "
                               f"{shape} for B=2")
