"""`training.trim_padding`: a step's sample ordered by token count before it is cut into
micro-batches, and each micro-batch cut to the columns its longest text uses. The step clips
and sums the same examples (a sum does not depend on their order or grouping), over fewer
positions: padding is masked out of attention and pooling, so it changes no real token's
output, only the time spent on it."""

from __future__ import annotations

import torch
from torch import Tensor


def token_counts(features: Tensor) -> Tensor:
    """[N] each text's width: its attention mask's last nonzero column + 1 (features
    [N, 2, T]: token ids, mask). Counting to the last real token, not the mask's sum, keeps
    left-padded texts whole."""
    mask = features[:, 1] != 0
    columns = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return (mask * columns).amax(dim=1)


def ordered_by_length(rows: Tensor, counts: Tensor) -> Tensor:
    """`rows` (indices into `counts`) shortest first; ties keep their order."""
    return rows[torch.argsort(counts[rows], stable=True)]


def trimmed(features, width: int):
    """`features` (tokens [b, 2, T], or (tokens, cached prefix outputs [b, T, H])) cut to
    their first `width` columns (at least one: an all-padding batch still runs)."""
    width = max(1, width)
    if isinstance(features, tuple):
        tokens, hidden = features
        return tokens[..., :width], hidden[:, :width]
    return features[..., :width]
