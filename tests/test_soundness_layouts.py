"""Randomized soundness of layers that do not see the examples first (ARCHITECTURE.md §2.3):
random stacks in which each trained layer reads its input in a random layout -- the examples
first, tokens folded into the first axis example after example ([B T, d]) or token after token
([T B, d]), a [1, T] position table, a bias table looked up with [T, T] bucket ids, a table
computed from no input -- at random sizes (the micro-batch sometimes as large as T), each
exact against the per-example loop (float64, every example clipped, and none clipped) through
the engine, whose first pass probes the layouts. "Wrong" is anything else. `make test` runs 60
models; `pytest tests/test_soundness_layouts.py --long=N` runs N.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from oracles import engine_is_the_loop
from torch import nn

LAYOUTS = ("examples first", "folded", "token after token", "position table", "bucket bias",
           "table from nothing")


def losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


class Table(nn.Module):
    """A learned [T, d] table, called with no input."""

    def __init__(self, tokens: int, width: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(tokens, width))

    def forward(self):
        return self.table


class Layout(nn.Module):
    """One trained layer reading [B, T, d] in the given layout; its output back as [B, T, d]."""

    def __init__(self, layout: str, tokens: int, width: int, buckets: int):
        super().__init__()
        self.layout, self.tokens = layout, tokens
        self.linear = nn.Linear(width, width)
        self.positions = nn.Embedding(tokens, width) if layout == "position table" else None
        self.bias = nn.Embedding(buckets, 1) if layout == "bucket bias" else None
        self.table = Table(tokens, width) if layout == "table from nothing" else None
        # [T, T] bucket ids, no example axis (as T5's relative positions)
        where = torch.arange(tokens)
        self.register_buffer("buckets", (where[None] - where[:, None]).abs().clamp(max=buckets - 1))

    def forward(self, x):
        batch, tokens, width = x.shape
        if self.layout == "folded":
            return self.linear(x.reshape(batch * tokens, width)).reshape(batch, tokens, width)
        if self.layout == "token after token":
            rows = x.transpose(0, 1).reshape(tokens * batch, width)
            return self.linear(rows).reshape(tokens, batch, width).transpose(0, 1)
        h = self.linear(x)
        if self.positions is not None:
            h = h + self.positions(torch.arange(tokens).unsqueeze(0))
        if self.table is not None:
            h = h + self.table()
        if self.bias is not None:  # attention within each example, a shared bias on its scores
            scores = h @ h.transpose(1, 2) / width + self.bias(self.buckets).squeeze(-1)
            h = scores.softmax(-1) @ h
        return h


def layouts(seed: int) -> str | None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    width, tokens = rng.randint(2, 5), rng.randint(2, 5)
    batch = tokens if rng.random() < 0.3 else rng.randint(2, 6)
    stack = [Layout(rng.choice(LAYOUTS), tokens, width, rng.randint(2, 4))
             for _ in range(rng.randint(1, 3))]
    model = nn.Sequential(*[m for layer in stack for m in (layer, nn.Tanh())], nn.Flatten(),
                          nn.Linear(width * tokens, 3)).double()
    x, y = torch.randn(batch, tokens, width, dtype=torch.float64), torch.randint(0, 3, (batch,))
    if not engine_is_the_loop(model, losses, x, y):
        return f"{[layer.layout for layer in stack]}, batch {batch}: differs from the loop"
    return None


@pytest.mark.thorough
@pytest.mark.filterwarnings("ignore:modules .* are called without the examples")
def test_every_layout_is_exact(request):
    count = request.config.getoption("--long") or 60
    failures = [f"seed {seed}: {reason}" for seed in range(count)
                if (reason := layouts(seed)) is not None]
    print(f"\n{count} models with random layouts: {len(failures)} wrong")
    assert not failures, "\n".join(failures[:5])
