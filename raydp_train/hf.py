"""Hugging Face sequence classifiers for private fine-tuning.

`SequenceClassifier` wraps an `AutoModelForSequenceClassification` so that it takes one tensor
[B, 2, T] (token ids and attention mask stacked, as the data loader stores text) and always
passes position ids of shape [B, T]: a broadcast [1, T] would reach the position embedding
with a leading dimension that is not the example dimension, which the clipping engine refuses.
Models load from a local directory, a hub name (offline with HF_HUB_OFFLINE=1), or
`package:<python package>/<folder>` for a checkpoint shipped inside an installed package.
"""

from __future__ import annotations

import fnmatch
import importlib.util
from pathlib import Path

import torch
from torch import Tensor, nn


class HFModelError(ValueError):
    """The `model` section names a model that cannot be loaded; the message says which field."""


def resolve_name_or_path(name_or_path: str) -> str:
    """`package:pkg/sub/dir` -> the installed folder; other values are returned as given."""
    if not name_or_path.startswith("package:"):
        return name_or_path
    package, _, inside = name_or_path.removeprefix("package:").partition("/")
    spec = importlib.util.find_spec(package) if package else None
    if spec is None or not spec.submodule_search_locations:
        raise HFModelError(
            f"model.name_or_path: package {package!r} is not installed (from {name_or_path!r}); "
            "pip install it, or give a directory"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / inside
    if not folder.is_dir():
        raise HFModelError(f"model.name_or_path: {folder} (from {name_or_path!r}) is not a folder")
    return str(folder)


class SequenceClassifier(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        embeddings = getattr(model.base_model, "embeddings", None)
        # RoBERTa-style models count positions after their padding index, from the ids.
        self.padding_idx = getattr(embeddings, "padding_idx", None)

    def forward(self, tokens: Tensor) -> Tensor:
        # contiguous copies: peers such as Opacus `.view` the ids of an embedding
        input_ids, attention_mask = tokens[:, 0].contiguous(), tokens[:, 1].contiguous()
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=self.position_ids(input_ids)).logits

    def position_ids(self, input_ids: Tensor) -> Tensor:
        batch, length = input_ids.shape
        if self.padding_idx is None:
            return torch.arange(length, device=input_ids.device).repeat(batch, 1)
        not_padding = input_ids.ne(self.padding_idx).long()
        return torch.cumsum(not_padding, dim=1) * not_padding + self.padding_idx


def build_hf_model(config, num_labels: int) -> SequenceClassifier:
    """The classifier of `config` (a pipeline `model` section of kind hf), trainable as asked."""
    import transformers

    if config.config is not None:  # random initialization, e.g. tiny models in tests
        hf_config = transformers.AutoConfig.for_model(**{**config.config, "num_labels": num_labels})
        model = transformers.AutoModelForSequenceClassification.from_config(hf_config)
    else:
        path = resolve_name_or_path(config.name_or_path)
        try:
            model = transformers.AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=num_labels)
        except (OSError, ValueError) as error:
            raise HFModelError(f"model.name_or_path: cannot load {path!r}: {error}") from error
    if model.config.pad_token_id is None:  # GPT-2 needs it to find each example's last token
        model.config.pad_token_id = 0
    _set_trainable(model, config.trainable)
    return SequenceClassifier(model)


def load_tokenizer(config):
    import transformers

    path = resolve_name_or_path(config.name_or_path)
    # A hub name is `name` or `org/name`; anything else is a folder, and must be one.
    if path.startswith((".", "/")) or path.count("/") > 1:
        if not Path(path).is_dir():
            raise HFModelError(f"model.name_or_path: folder not found: {path}")
        if not any((Path(path) / f).is_file() for f in ("config.json", "tokenizer_config.json")):
            raise HFModelError(f"model.name_or_path: {path} holds no Hugging Face model or "
                               "tokenizer (no config.json or tokenizer_config.json)")
    try:
        return transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise HFModelError(f"model.name_or_path: no tokenizer in {path!r}: {error}") from error


def _set_trainable(model: nn.Module, trainable) -> None:
    """`all`, `{last_k_layers: k}` (the head plus the last k encoder layers), or patterns."""
    if trainable == "all":
        return
    names = [name for name, _ in model.named_parameters()]
    if isinstance(trainable, list):
        keep = {n for n in names if any(fnmatch.fnmatch(n, p) for p in trainable)}
        unmatched = [p for p in trainable if not any(fnmatch.fnmatch(n, p) for n in names)]
        if unmatched:
            raise HFModelError(f"model.trainable: patterns {unmatched} match no parameter; "
                               f"names look like {names[-1]!r}")
    else:
        keep = set(_head_and_last_layers(model, trainable.last_k_layers))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in keep)


def _head_and_last_layers(model: nn.Module, k: int) -> list[str]:
    layers = _encoder_layers(model)
    if k > len(layers):
        raise HFModelError(f"model.trainable.last_k_layers: the model has {len(layers)} layers, "
                           f"got {k}")
    base = model.base_model_prefix
    chosen = {id(p) for layer in layers[len(layers) - k:] for p in layer.parameters()}
    return [name for name, p in model.named_parameters()
            if id(p) in chosen or not name.startswith(f"{base}.") or ".pooler." in name]


def _encoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the longest nn.ModuleList in the model."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise HFModelError("model.trainable.last_k_layers: no layer list found in this model")
    return list(max(lists, key=len))
