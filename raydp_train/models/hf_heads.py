"""Sequence-classification heads that fit how a checkpoint was pretrained (ARCHITECTURE.md §5).

`model.pooling: cls` keeps the model's own head (BERT: the [CLS] token through the pooler;
GPT-2: the last token). `mean` averages the last hidden states over the tokens the attention
mask keeps, optionally L2-normalises the average (as sentence-transformers' `Normalize` does),
and feeds it to the model's final Linear (hidden -> num_labels): the head stays an nn.Linear,
so the clipping engine covers it with its Linear rule. The default is what the checkpoint was
trained with, read from a sentence-transformers `modules.json` / `1_Pooling/config.json`
beside the weights; else cls.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from raydp_train.models.hf_files import HFModelError

_SENTENCE_POOLING = "sentence_transformers.models.Pooling"
_SENTENCE_NORMALIZE = "sentence_transformers.models.Normalize"


def resolve_pooling(config, folder: str | None) -> tuple[str, bool]:
    """(pooling, normalize) of a `model` section: as set, else as the checkpoint in `folder`
    (None: a random model) was trained."""
    trained_pooling, trained_normalize = checkpoint_pooling(folder)
    pooling = config.pooling or trained_pooling
    if pooling not in ("cls", "mean"):
        raise HFModelError(f"model.pooling: the checkpoint in {folder} pools with {pooling}, "
                           "which raydp_train does not support; set model.pooling: cls or mean")
    if config.normalize and pooling != "mean":
        raise HFModelError("model.normalize: normalizes the mean-pooled vector, but this model "
                           f"pools with {pooling} (model.pooling: null follows the checkpoint); "
                           "set model.pooling: mean")
    normalize = trained_normalize if config.normalize is None else config.normalize
    return pooling, normalize and pooling == "mean"


def checkpoint_pooling(folder: str | None) -> tuple[str, bool]:
    """(pooling, normalize) the checkpoint in `folder` was trained with; ("cls", False) when it
    says nothing (not a sentence-transformers folder, a hub name, or a random model). A pooling
    raydp_train does not support is returned as the list of the checkpoint's modes."""
    if folder is None or not Path(folder).is_dir():
        return "cls", False
    root = Path(folder)
    modules = _read_json(root / "modules.json") or []
    pooling_dirs = [m.get("path", "") for m in modules if m.get("type") == _SENTENCE_POOLING]
    normalize = any(m.get("type") == _SENTENCE_NORMALIZE for m in modules)
    pooling_config = None
    for candidate in [*pooling_dirs, "1_Pooling"]:
        pooling_config = _read_json(root / candidate / "config.json")
        if pooling_config is not None:
            break
    if pooling_config is None:
        return "cls", normalize
    modes = [k for k, v in pooling_config.items() if k.startswith("pooling_mode_") and v is True]
    known = {("pooling_mode_mean_tokens",): "mean", ("pooling_mode_cls_token",): "cls"}
    return known.get(tuple(modes), str(modes)), normalize


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """sum_t m_t h_t / sum_t m_t: padded tokens get weight 0 (and an exactly zero gradient)."""
    weights = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def classification_head(model: nn.Module, num_labels: int) -> tuple[str, nn.Linear]:
    """The model's final Linear (hidden -> num_labels) outside the base model: BERT's and
    DistilBERT's `classifier`, RoBERTa's `classifier.out_proj`, GPT-2's `score`."""
    hidden = model.config.hidden_size
    base = model.base_model_prefix
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and not name.startswith(f"{base}.")
             and m.in_features == hidden and m.out_features == num_labels]
    if len(found) != 1:
        raise HFModelError(f"model.pooling: cannot find one Linear head ({hidden} -> {num_labels}) "
                        f"in {type(model).__name__}; use model.pooling: cls")
    return found[0]


def unused_by_mean_pooling(model: nn.Module, head_name: str) -> set[str]:
    """Parameters mean pooling bypasses: the base model's pooler and every head module other
    than the final Linear (e.g. BERT's pooler, DistilBERT's pre_classifier)."""
    base = model.base_model_prefix
    return {name for name, _ in model.named_parameters()
            if name.startswith(f"{base}.pooler.")
            or (not name.startswith(f"{base}.") and not name.startswith(f"{head_name}."))}


def initialize_head(head: nn.Linear, head_init: str) -> None:
    """`zeros`: W = 0 and b = 0, so the first logits are 0 (helpful under DP noise)."""
    if head_init == "zeros":
        with torch.no_grad():
            head.weight.zero_()
            if head.bias is not None:
                head.bias.zero_()


class MeanPoolingHead(nn.Module):
    """Masked mean of the last hidden states, optional L2 normalisation, then the Linear."""

    def __init__(self, head: nn.Linear, normalize: bool):
        super().__init__()
        # Not a submodule: the Linear stays registered (and named) where the checkpoint has it.
        self.__dict__["linear"] = head
        self.normalize = normalize

    def forward(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        return self.linear(self.pooled(hidden, attention_mask))

    def pooled(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        """The vector the final Linear reads: the masked mean, normalised if it was."""
        pooled = mean_pool(hidden, attention_mask)
        if self.normalize:
            pooled = nn.functional.normalize(pooled, dim=-1)
        return pooled
