"""Hugging Face sequence classifiers for private fine-tuning.

`SequenceClassifier` wraps an `AutoModelForSequenceClassification` so that it takes one tensor
[B, 2, T] (token ids and attention mask stacked, as the data loader stores text) and always
passes position ids of shape [B, T]: a broadcast [1, T] would reach the position embedding
with a leading dimension that is not the example dimension, which the clipping engine refuses.
Where models load from: models/hf_files.py.
"""

from __future__ import annotations

import fnmatch
from typing import Literal

import torch
from torch import Tensor, nn

from raydp_train.models.hf_dropout import dropout_options, set_dropout_modules
from raydp_train.models.hf_files import HFModelError, resolve_name_or_path
from raydp_train.models.hf_heads import (
    MeanPoolingHead,
    classification_head,
    initialize_head,
    resolve_pooling,
    unused_by_mean_pooling,
)
from raydp_train.models.label_text_head import check_label_texts, start_from_label_texts

# Where a model's weights come from: the checkpoint, random initialization (the checkpoint's
# config.json only), or nowhere (modules on the meta device: names, shapes and types).
Weights = Literal["pretrained", "random", "meta"]


class SequenceClassifier(nn.Module):
    def __init__(self, model: nn.Module, pooling_head: MeanPoolingHead | None = None):
        super().__init__()
        self.model = model
        # None: the model's own head (pooling cls); else the mean-pooling head on its Linear.
        self.__dict__["pooling_head"] = pooling_head
        embeddings = getattr(model.base_model, "embeddings", None)
        # RoBERTa-style models count positions after their padding index, from the ids.
        self.padding_idx = getattr(embeddings, "padding_idx", None)

    @property
    def pooling(self) -> str:
        return "cls" if self.pooling_head is None else "mean"

    def forward(self, tokens: Tensor) -> Tensor:
        # int64 (the data stores int32) and contiguous: peers such as Opacus `.view` the ids
        input_ids, attention_mask = tokens[:, 0].long().contiguous(), tokens[:, 1].long().contiguous()
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
                  "position_ids": self.position_ids(input_ids)}
        if self.pooling_head is None:
            return self.model(**inputs).logits
        hidden = self.model.base_model(**inputs).last_hidden_state
        return self.pooling_head(hidden, attention_mask)

    def position_ids(self, input_ids: Tensor) -> Tensor:
        batch, length = input_ids.shape
        if self.padding_idx is None:
            return torch.arange(length, device=input_ids.device).repeat(batch, 1)
        not_padding = input_ids.ne(self.padding_idx).long()
        return torch.cumsum(not_padding, dim=1) * not_padding + self.padding_idx


def build_hf_model(config, num_labels: int, weights: Weights = "pretrained") -> SequenceClassifier:
    """The classifier of `config` (a pipeline `model` section of kind hf), trainable as asked,
    with the pooling and head initialization of `model.pooling` / `model.head_init`.

    `weights` "meta" (validate) builds the same modules on the meta device from the
    checkpoint's config alone: names, shapes and layer types, no weights read or allocated;
    "random" (validate's self-check) allocates them, randomly initialized, still unread."""
    folder = None if config.config is not None else resolve_name_or_path(config.name_or_path)
    model = transformers_model("AutoModelForSequenceClassification", config, folder,
                               weights, num_labels=num_labels)
    if model.config.pad_token_id is None:  # GPT-2 needs it to find each example's last token
        model.config.pad_token_id = 0
    pooling, normalize = resolve_pooling(config, folder)
    check_label_texts(config, pooling, num_labels)
    head_name, head = classification_head(model, num_labels) if (
        pooling == "mean" or config.head_init != "default") else (None, None)
    if head is not None:
        initialize_head(head, config.head_init)
    unused = unused_by_mean_pooling(model, head_name) if pooling == "mean" else set()
    set_trainable(model, config.trainable, unused)
    pooling_head = MeanPoolingHead(head, normalize) if pooling == "mean" else None
    classifier = SequenceClassifier(model, pooling_head)
    if config.head_init == "label_texts" and weights == "pretrained":
        start_from_label_texts(classifier, config)
    return classifier


def transformers_model(auto_class: str, config, folder: str | None, weights: Weights,
                       **options):
    """`auto_class` (a transformers Auto* name) random from `model.config`, pretrained from
    `folder`, or from the checkpoint's config.json with random weights or none (on the meta
    device); `options` (num_labels) and `model.dropout` go to its config."""
    import transformers

    model_class = getattr(transformers, auto_class)
    if config.config is not None:  # random initialization, e.g. tiny models in tests
        hf_config = transformers.AutoConfig.for_model(**{**config.config, **options})
    else:
        try:
            hf_config = transformers.AutoConfig.from_pretrained(folder, **options)
        except (OSError, ValueError) as error:
            raise HFModelError(f"model.name_or_path: cannot read the config of {folder!r}: "
                               f"{error}") from error
    hf_config.update(dropout_options(hf_config, config.dropout))
    if config.config is None and weights == "pretrained":
        try:
            model, loading = model_class.from_pretrained(folder, config=hf_config,
                                                         output_loading_info=True)
        except (OSError, ValueError) as error:
            raise HFModelError(f"model.name_or_path: cannot load {folder!r}: {error}") from error
        # Not in the checkpoint, so initialized here (e.g. a new head or pooler): what an
        # adapter must carry for the checkpoint plus the adapter to be this model (lora.py).
        model.newly_initialized = sorted(loading["missing_keys"])
    elif weights != "meta":
        model = model_class.from_config(hf_config)
    else:
        with torch.device("meta"):
            model = model_class.from_config(hf_config)
    set_dropout_modules(model, config.dropout)
    return model


def check_positions(model: nn.Module, max_length: int) -> None:
    """A model with a table of absolute positions (BERT, GPT-2) has a row for each of the
    `max_length` positions (RoBERTa-style models count from after their padding index), or
    its first forward would fail inside a run; rotary models (Llama) have no such table."""
    limit = getattr(model.model.config, "max_position_embeddings", None)
    tokens = model.model.get_input_embeddings()
    if limit is None or not any(isinstance(m, nn.Embedding) and m.num_embeddings == limit
                                and m is not tokens for m in model.model.base_model.modules()):
        return
    padding_idx = getattr(model, "padding_idx", None)
    positions = limit - (0 if padding_idx is None else padding_idx + 1)
    if max_length > positions:
        raise HFModelError(f"data.max_length: the model has position embeddings for "
                           f"{positions} tokens, got {max_length}")


def set_trainable(model: nn.Module, trainable, unused: set[str]) -> None:
    """`all`, `{last_k_layers: k}` (the head plus the last k encoder layers), or patterns.
    Parameters in `unused` (bypassed by the pooling) are frozen: trained, they would only
    collect noise."""
    names = [name for name, _ in model.named_parameters()]
    if trainable == "all":
        keep = set(names)
    elif isinstance(trainable, list):
        keep = {n for n in names if any(fnmatch.fnmatch(n, p) for p in trainable)}
        unmatched = [p for p in trainable if not any(fnmatch.fnmatch(n, p) for n in names)]
        if unmatched:
            raise HFModelError(f"model.trainable: patterns {unmatched} match no parameter; "
                               f"names look like {names[-1]!r}")
        bypassed = [p for p in trainable
                    if all(n in unused for n in names if fnmatch.fnmatch(n, p))]
        if bypassed:
            raise HFModelError(f"model.trainable: patterns {bypassed} match only parameters "
                               "that model.pooling mean does not use (the pooler and head "
                               "layers before the final Linear); drop them")
    else:
        keep = set(_head_and_last_layers(model, trainable.last_k_layers))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in keep and name not in unused)


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
    return list(encoder_layer_list(model)[2])


def encoder_layer_list(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """(owner, attribute, list) of the transformer blocks: the longest nn.ModuleList."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise HFModelError("model.trainable.last_k_layers: no layer list found in this model")
    name, layers = max(lists, key=lambda item: len(item[1]))
    owner_name, _, attribute = name.rpartition(".")
    return model.get_submodule(owner_name), attribute, layers
