"""A mean-pooled sequence classifier as transformers custom code.

A run with `model.pooling: mean` saves its `model/` folder with this file beside the weights
and a config.json whose `model_type` transformers does not know and whose `auto_map` names the
classes here. So `pipeline("text-classification", model=RUN/model, trust_remote_code=True)`
and `AutoModelForSequenceClassification.from_pretrained(..., trust_remote_code=True)` give the
trained model, mean pooling included; without trust_remote_code transformers refuses, where
loading the plain checkpoint would silently pool the [CLS] token instead.

This file is copied into every such folder, so it imports torch and transformers only.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_outputs import SequenceClassifierOutput


class MeanPooledConfig(PretrainedConfig):
    """`encoder`: the trained checkpoint's own config (a dict with its model_type); `head`:
    the name of its final Linear (hidden -> labels); `normalize`: L2 before the head."""

    model_type = "raydp_mean_pooled"

    def __init__(self, encoder: dict | None = None, head: str = "classifier",
                 normalize: bool = False, **kwargs):
        self.encoder = dict(encoder or {})
        self.head = head
        self.normalize = normalize
        super().__init__(**kwargs)


class MeanPooledForSequenceClassification(PreTrainedModel):
    """The checkpoint's sequence classifier (`model`) with the [CLS] pooler bypassed: the
    masked mean of the last hidden states (optionally normalised) goes to its final Linear."""

    config_class = MeanPooledConfig
    base_model_prefix = "model"

    def __init__(self, config: MeanPooledConfig):
        super().__init__(config)
        self.model = AutoModelForSequenceClassification.from_config(
            AutoConfig.for_model(**config.encoder))
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None,
                position_ids=None, labels=None, **kwargs) -> SequenceClassifierOutput:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            inputs["token_type_ids"] = token_type_ids
        if position_ids is not None:
            inputs["position_ids"] = position_ids
        hidden = self.model.base_model(**inputs).last_hidden_state
        weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        if self.config.normalize:
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        logits = self.model.get_submodule(self.config.head)(pooled)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)


def mean_pooled(model, head: str, normalize: bool) -> MeanPooledForSequenceClassification:
    """The trained Hugging Face classifier `model`, wrapped without copying its weights."""
    config = MeanPooledConfig(encoder=model.config.to_dict(), head=head, normalize=normalize,
                              id2label=model.config.id2label, label2id=model.config.label2id)
    with torch.device("meta"):
        wrapper = MeanPooledForSequenceClassification(config)
    wrapper.model = model
    return wrapper
