"""Hugging Face causal language models for private fine-tuning (`model.task: causal_lm`).

`CausalLM` wraps an `AutoModelForCausalLM` as `SequenceClassifier` (models/hf.py) wraps a classifier:
it takes one tensor [B, 2, T] (token ids and attention mask stacked, right padded, as the data
loader stores text), passes position ids of shape [B, T] (a broadcast [1, T] would reach the
position embedding with a leading dimension that is not the example dimension) and returns the
logits [B, T, V]. An example's targets are its own next tokens: no labels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from raydp_train.models.hf import Weights, set_trainable, transformers_model
from raydp_train.models.hf_files import resolve_name_or_path

IGNORED = -100  # cross_entropy's ignore_index: a position whose next token is padding


class CausalLM(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor) -> Tensor:
        # int64 and contiguous: the data stores int32
        input_ids, attention_mask = tokens[:, 0].long().contiguous(), tokens[:, 1].long().contiguous()
        batch, length = input_ids.shape
        position_ids = torch.arange(length, device=input_ids.device).repeat(batch, 1)
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=False).logits


def build_causal_lm(config, weights: Weights = "pretrained") -> CausalLM:
    """The causal LM of `config` (a pipeline `model` section, task causal_lm), trainable as
    asked. `weights` as in hf.build_hf_model ("meta": modules on the meta device)."""
    folder = None if config.config is not None else resolve_name_or_path(config.name_or_path)
    model = transformers_model("AutoModelForCausalLM", config, folder, weights)
    set_trainable(model, config.trainable, set())
    return CausalLM(model)


def next_token_targets(tokens: Tensor) -> Tensor:
    """[B, T-1]: the id of token t+1 at position t, IGNORED where token t+1 is padding."""
    ids, mask = tokens[:, 0].long(), tokens[:, 1]
    return ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORED)


def token_losses(logits: Tensor, tokens: Tensor) -> Tensor:
    """[B, T-1] next-token cross-entropies, 0 at ignored positions. The log-softmax runs over
    the contiguous [B, T, V] logits as they are: cross_entropy over a [B, V, T-1] view of them
    copied the logits (V wide) and took twice as long, forward and backward."""
    targets = next_token_targets(tokens)
    log_probs = logits.log_softmax(-1)[:, :-1]
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -picked.masked_fill(targets == IGNORED, 0.0)


def causal_lm_loss(reduction: str) -> Callable[[nn.Module, Tensor, Tensor], Tensor]:
    """The per-example loss (model, tokens, labels) -> [B]: an example's next-token
    cross-entropies over its real tokens, summed (`sum`) or averaged (`mean`); `labels` are
    placeholders (the targets are the tokens)."""

    def per_example_loss(model: nn.Module, tokens: Tensor, labels: Tensor) -> Tensor:
        losses = token_losses(model(tokens), tokens).sum(1)
        if reduction == "sum":
            return losses
        return losses / real_targets(tokens).clamp(min=1)

    return per_example_loss


def real_targets(tokens: Tensor) -> Tensor:
    """[B]: how many next tokens each example predicts (its real tokens after the first)."""
    return (next_token_targets(tokens) != IGNORED).sum(1)


@torch.no_grad()
def token_loss_sum(model: nn.Module, tokens: Tensor, rows: int = 256) -> tuple[float, int]:
    """(sum of next-token cross-entropies over every real target of `tokens`, their number):
    the held-out loss per token is their ratio, its perplexity exp(ratio)."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(tokens), rows):
        batch = tokens[start:start + rows].to(device)
        total += token_losses(model(batch), batch).sum().item()
        count += real_targets(batch).sum().item()
    return total, count
