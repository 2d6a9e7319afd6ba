"""`model.head_init: label_texts`: the new head starts as a zero-shot classifier. Row k of the
final Linear is the pretrained encoder's pooled embedding of label k's text ("a negative
review", ...), so the first logits are the sentence's similarity to each label, and the
encoder gets useful gradients from the first step instead of a random head's. The texts are
public, written by the user; no training example is read, so nothing is spent.
"""

from __future__ import annotations

import torch
from torch import nn

from raydp_train.models.hf_files import HFModelError, load_tokenizer

# logits = SCALE x cosine similarity: the scale sentence-transformers' contrastive losses
# train their embeddings with, so similarities a few hundredths apart give logits apart by ~1.
SIMILARITY_SCALE = 20.0


def check_label_texts(config, pooling: str, num_labels: int) -> None:
    """One text per label and mean pooling, checked on validate's meta model too."""
    if config.head_init != "label_texts":
        return
    if len(config.label_texts) != num_labels:
        raise HFModelError(f"model.label_texts: {len(config.label_texts)} texts for "
                           f"{num_labels} labels; give one per label, in label order")
    if pooling != "mean":
        raise HFModelError(f"model.head_init: label_texts compares mean-pooled sentence "
                           f"vectors, but this model pools with {pooling}; set model.pooling: "
                           "mean")


def start_from_label_texts(classifier: nn.Module, config) -> None:
    """W = SCALE x E / mean ||e_k||^2 (E: the texts' pooled embeddings, normalised as the
    model normalises; unit vectors when it does) and b = 0."""
    tokenizer = load_tokenizer(config)
    encoded = tokenizer(list(config.label_texts), padding=True, return_tensors="pt")
    ids, mask = encoded["input_ids"], encoded["attention_mask"]
    head = classifier.pooling_head.linear
    model = classifier.model
    was_training = model.training
    model.eval()  # no dropout: every worker computes the same head
    try:
        with torch.no_grad():
            hidden = model.base_model(input_ids=ids, attention_mask=mask,
                                      position_ids=classifier.position_ids(ids)).last_hidden_state
            embeddings = classifier.pooling_head.pooled(hidden.to(head.weight.dtype), mask)
            scale = SIMILARITY_SCALE / embeddings.pow(2).sum(1).mean().clamp(min=1e-12)
            head.weight.copy_(scale * embeddings)
            if head.bias is not None:
                head.bias.zero_()
    finally:
        model.train(was_training)

