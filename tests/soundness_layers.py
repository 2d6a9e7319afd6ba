"""Two families of tests/test_soundness_families.py: random stacks of layers, exact against the
per-example loop (float64, every example clipped, then none):

  * layers on the per-example path (LSTM with a projection, GRU, Bilinear, a learned gain,
    one shared with a Linear's bias) beside layers with rules;
  * the native rules of torch's attention (either layout, packed or separate weights, biases
    or none, bias_k/bias_v, a zero key, a padding mask, the weights in the loss, called
    twice), LSTM (one or two layers), ConvTranspose1d, Conv3d, EmbeddingBag and PReLU (a
    slope shared with a layer on the per-example path), beside Linear layers and the
    per-example path.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F
from oracles import engine_is_the_loop
from torch import nn


def losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


class Gain(nn.Module):
    """A learned gain (on the per-example path), sometimes another layer's Parameter."""

    def __init__(self, width: int, shared: nn.Parameter | None):
        super().__init__()
        self.gain = shared if shared is not None else nn.Parameter(torch.randn(width))

    def forward(self, x):
        return x * self.gain


class Recurrent(nn.Module):
    def __init__(self, recurrent: nn.Module):
        super().__init__()
        self.recurrent = recurrent

    def forward(self, x):
        return self.recurrent(x)[0]


class Pairwise(nn.Module):
    """nn.Bilinear of the input and its reverse."""

    def __init__(self, width: int):
        super().__init__()
        self.bilinear = nn.Bilinear(width, width, width)

    def forward(self, x):
        return self.bilinear(x, x.flip(-1))


def _path_layer(rng: random.Random, width: int, linear: nn.Linear) -> nn.Module:
    kind = rng.choice(["lstm", "gru", "gain", "shared gain", "bilinear"])
    if kind == "lstm":  # with a projection: no native rule
        return Recurrent(nn.LSTM(width, width + 1, proj_size=width, batch_first=True))
    if kind == "gru":
        return Recurrent(nn.GRU(width, width, batch_first=True))
    if kind == "bilinear":
        return Pairwise(width)
    return Gain(width, linear.bias if kind == "shared gain" else None)


def per_example_path(seed: int) -> str | None:
    """Random stacks of layers on the per-example path and layers with rules, shared
    parameters across both included: exact against the per-example loop."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    width, tokens, batch = rng.randint(2, 6), rng.randint(1, 4), rng.randint(2, 6)
    layers: list[nn.Module] = []
    for _ in range(rng.randint(1, 3)):
        linear = nn.Linear(width, width)
        layers += [linear, nn.Tanh(), _path_layer(rng, width, linear)]
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(width * tokens, 3)).double()
    x, y = torch.randn(batch, tokens, width, dtype=torch.float64), torch.randint(0, 3, (batch,))
    if not engine_is_the_loop(model, losses, x, y):
        return f"{[type(m).__name__ for m in layers]}: differs from the per-example loop"
    return None


class Attention(nn.Module):
    """Torch's attention over [B, T, d] in a random configuration."""

    def __init__(self, rng: random.Random, width: int):
        super().__init__()
        heads = rng.choice([h for h in (1, 2, 3) if width % h == 0])
        self.examples_first, self.twice = rng.random() < 0.5, rng.random() < 0.3
        self.cross, self.masked = rng.random() < 0.3, rng.random() < 0.3
        self.need_weights = rng.random() < 0.5
        separate = rng.random() < 0.3
        self.keys = nn.Linear(width, width + 1 if separate else width)
        self.attention = nn.MultiheadAttention(
            width, heads, bias=rng.random() < 0.7, add_bias_kv=rng.random() < 0.3,
            add_zero_attn=rng.random() < 0.3, batch_first=self.examples_first,
            kdim=width + 1 if separate else None, vdim=width + 1 if separate else None)
        self.cross |= separate

    def forward(self, x):
        k = self.keys(x) if self.cross else x
        out = self._attend(x, k, k, (x[..., 0] > 1.0) & (torch.arange(x.shape[1]) > 0))
        return self._attend(out, k, k, None) if self.twice else out

    def _attend(self, q, k, v, padding):
        if not self.examples_first:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        out, weights = self.attention(q, k, v, need_weights=self.need_weights,
                                      key_padding_mask=padding if self.masked else None)
        out = out if self.examples_first else out.transpose(0, 1)
        return out if weights is None else out * (1 + weights[..., :1])


class Transposed(nn.Module):
    """ConvTranspose1d over the tokens, cut back to T tokens."""

    def __init__(self, rng: random.Random, width: int):
        super().__init__()
        self.conv = nn.ConvTranspose1d(width, width, rng.randint(1, 3), stride=rng.randint(1, 2),
                                       bias=rng.random() < 0.7)

    def forward(self, x):
        return self.conv(x.transpose(1, 2))[:, :, : x.shape[1]].transpose(1, 2)


class Volume(nn.Module):
    """Conv3d over the tokens seen as a [T, 1, 1] volume."""

    def __init__(self, rng: random.Random, width: int):
        super().__init__()
        self.conv = nn.Conv3d(width, width, (rng.randint(1, 3), 1, 1), padding="same",
                              dilation=(rng.randint(1, 2), 1, 1))

    def forward(self, x):
        return self.conv(x.transpose(1, 2)[..., None, None])[..., 0, 0].transpose(1, 2)


class Bag(nn.Module):
    """An EmbeddingBag of ids read off the example, added to every token."""

    def __init__(self, rng: random.Random, width: int):
        super().__init__()
        mode = rng.choice(["sum", "mean"])
        self.bag = nn.EmbeddingBag(5, width, mode=mode, padding_idx=rng.choice([None, 0]))

    def forward(self, x):
        ids = (x[..., 0].detach().abs() * 2).floor().clamp(max=4).long()
        return x + self.bag(ids).unsqueeze(1)


def _native_layer(rng: random.Random, width: int, linear: nn.Linear,
                  slope: nn.Parameter) -> nn.Module:
    kind = rng.choice(["attention", "transposed", "volume", "bag", "prelu", "shared prelu",
                       "lstm"])
    if kind == "lstm":
        return Recurrent(nn.LSTM(width, width, num_layers=rng.randint(1, 2),
                                 bias=rng.random() < 0.7, batch_first=True))
    if kind == "prelu":
        return nn.PReLU()  # one slope: the channel axis of [B, T, d] is T
    if kind == "shared prelu":  # the slope of a Gain on the per-example path too
        prelu = nn.PReLU()
        prelu.weight = slope
        return nn.Sequential(prelu, Gain(1, slope))
    return {"attention": Attention, "transposed": Transposed, "volume": Volume,
            "bag": Bag}[kind](rng, width)


def native_rules(seed: int) -> str | None:
    """Random stacks of the native rules, Linear layers and the per-example path."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    width, tokens, batch = rng.randint(2, 6), rng.randint(1, 4), rng.randint(2, 6)
    slope = nn.Parameter(torch.rand(1))
    layers: list[nn.Module] = []
    for _ in range(rng.randint(1, 3)):
        linear = nn.Linear(width, width)
        layers += [linear, nn.Tanh(), _native_layer(rng, width, linear, slope)]
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(width * tokens, 3)).double()
    x, y = torch.randn(batch, tokens, width, dtype=torch.float64), torch.randint(0, 3, (batch,))
    if not engine_is_the_loop(model, losses, x, y):
        return f"{model}: differs from the per-example loop"
    return None
