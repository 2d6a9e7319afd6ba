"""Model builders: logistic regression, MLP and a small CNN, from the pipeline's `model`."""

from __future__ import annotations

import math

import torch
from torch import nn

from raydp_train.config.model import is_causal_lm
from raydp_train.errors import UserError

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}
# The most parameters a logistic, MLP or CNN model may have: 4 GiB of float32 weights.
MAX_PARAMETERS = 2**30


class ModelError(UserError, ValueError):
    """The model section does not fit the data; the message names the field."""


def build_model(config, feature_shape: tuple[int, ...], num_classes: int,
                weights: str = "pretrained", on_fix=None) -> nn.Module:
    """Every layer is one the per-example clipping engine supports (no BatchNorm).
    `weights` of an hf model: "pretrained", "random" or "meta" (hf.Weights; validate);
    `on_fix`: each line of a torch model's `model.fix` changes."""
    if config.kind == "hf":
        from raydp_train.models.hf import build_hf_model, check_positions
        from raydp_train.models.hf_causal import build_causal_lm

        if len(feature_shape) != 2 or feature_shape[0] != 2:
            raise ModelError("model.kind: 'hf' needs text data (data.text_column), got "
                             f"features of shape {list(feature_shape)}")
        if is_causal_lm(config):
            model = build_causal_lm(config, weights)
        else:
            model = build_hf_model(config, num_classes, weights)
        check_positions(model, feature_shape[1])
        return model
    if config.kind == "torch":
        from raydp_train.models.custom import custom_model

        return custom_model(config, feature_shape, num_classes, on_fix)
    with torch.device("meta"):  # shapes only: nothing allocated
        parameters = sum(p.numel() for p in _small_model(config, feature_shape,
                                                         num_classes).parameters())
    if parameters > MAX_PARAMETERS:
        raise ModelError(f"model: {parameters:,} parameters for {list(feature_shape)} features "
                         f"would need {4 * parameters / 2**30:,.0f} GiB of float32 weights "
                         f"alone; at most {MAX_PARAMETERS:,}: make the model smaller")
    return _small_model(config, feature_shape, num_classes)


def _small_model(config, feature_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if config.kind == "logistic":
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(feature_shape), num_classes))
    if config.kind == "mlp":
        return _mlp(config, math.prod(feature_shape), num_classes)
    return _cnn(config, feature_shape, num_classes)


def _mlp(config, in_features: int, num_classes: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    for width in config.hidden_sizes:
        layers += [nn.Linear(in_features, width), ACTIVATIONS[config.activation]()]
        in_features = width
    layers.append(nn.Linear(in_features, num_classes))
    return nn.Sequential(*layers)


def _cnn(config, feature_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Conv blocks (conv, GroupNorm, ReLU, 2x2 max-pool while the image allows), then an MLP head."""
    if len(feature_shape) != 3:
        raise ModelError(
            f"model.kind: 'cnn' needs image features of shape [channels, height, width], "
            f"got feature shape {list(feature_shape)}"
        )
    channels, height, width = feature_shape
    layers: list[nn.Module] = []
    for out_channels in config.channels:
        layers += [
            nn.Conv2d(channels, out_channels, config.kernel_size, padding=config.kernel_size // 2),
            nn.GroupNorm(math.gcd(out_channels, 4), out_channels),
            nn.ReLU(),
        ]
        if min(height, width) >= 2:
            layers.append(nn.MaxPool2d(2))
            height, width = height // 2, width // 2
        channels = out_channels
    layers += [
        nn.Flatten(),
        nn.Linear(channels * height * width, config.hidden_size),
        nn.ReLU(),
        nn.Linear(config.hidden_size, num_classes),
    ]
    return nn.Sequential(*layers)
