"""Randomized soundness, six families of models, each generated at random sizes and settings
and run through the product's own paths (PrivateStep with its default self-check, or the
engine):

  * mixing in training mode only (rolls, centring, batch norm by hand, permutations, from a
    random row on): stopped by the self-check before the first release;
  * adversarial cancellation in float32 (tokens nearly equal with alternating signs): every
    example's leave-one-out contribution to the engine's own sum <= C (1 + 1e-6);
  * overridden forwards (a subclass's forward or _conv_forward, an instance's forward):
    refused by name with `other_layers: refuse`, exact against the per-example loop on the
    per-example path (and a subclass that only constructs differently keeps its rule);
  * late unfreezing or freezing between steps: refused before anything is computed;
  * stacks of layers on the per-example path (LSTM, GRU, Bilinear, a learned gain, one shared
    with a Linear's bias) and layers with rules: exact against the loop;
  * stacks of the native rules (torch's attention in random settings, ConvTranspose1d, Conv3d,
    EmbeddingBag, PReLU, a slope shared with the per-example path): exact against the loop
    (tests/soundness_layers.py holds these two).

"Wrong" is anything else. `make test` runs 200 models; `pytest tests/test_soundness_families.py
--long` runs 5,000, `--long=N` N.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from oracles import leave_one_out, naive_clipped_sum
from soundness_layers import native_rules, per_example_path
from torch import nn

import raydp_train as rt
from raydp_train.privacy.clipping import (
    PerExampleClipper,
    TrainedSetChangedError,
    UnsupportedLayerError,
)
from raydp_train.privacy.self_check import SelfCheckError


def losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


# ------------------------------------------------------------------ mixing in training mode


class TrainingMix(nn.Module):
    def __init__(self, mix):
        super().__init__()
        self.mix = mix

    def forward(self, h):
        return self.mix(h) if self.training else h


def _mixes(rng: random.Random, batch: int):
    start, shift = rng.randint(1, max(1, batch // 2)), rng.randint(1, batch - 1)
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    permutation = torch.arange(batch)
    while torch.equal(permutation, torch.arange(batch)):  # the identity mixes nothing
        permutation = torch.randperm(batch, generator=generator)
    weight = rng.uniform(0.05, 0.95)
    return {
        "roll": lambda h: (1 - weight) * h + weight * h.roll(shift, 0),
        "centring": lambda h: h - weight * h.mean(0, keepdim=True),
        "batch norm": lambda h: F.batch_norm(h, None, None, training=True),
        "permutation": lambda h: (1 - weight) * h + weight * h[permutation],
        "from a row on": lambda h: torch.cat([h[:start],
                                              (1 - weight) * h[start:] + weight * h[start - 1:-1]]),
    }


def mixing(seed: int) -> str | None:
    rng = random.Random(seed)
    batch, width = rng.randint(4, 12), rng.randint(4, 24)
    name, mix = rng.choice(sorted(_mixes(rng, batch).items()))
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, width), nn.Tanh(), TrainingMix(mix),
                          nn.Linear(width, 3)).double().train()
    before = [p.detach().clone() for p in model.parameters()]
    private = rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=1.0),
                             clip_norm=rng.choice([1e-3, 0.05, 10.0]), noise_multiplier=1.0,
                             expected_batch_size=batch, num_examples=10 * batch, delta=1e-3,
                             seed=seed)
    x, y = torch.randn(batch, 6, dtype=torch.float64), torch.randint(0, 3, (batch,))
    try:
        private.step(x, y)
    except SelfCheckError:
        released = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
        return f"{name}: stopped, but after the parameters changed" if released else None
    return f"{name} (batch {batch}): the mixing model's step was released"


# ------------------------------------------------------------------ cancellation in float32


class Readout(nn.Module):
    def __init__(self, features: int, outputs: int):
        super().__init__()
        self.lin = nn.Linear(features, outputs, bias=False)
        self.register_buffer("u", 10 * torch.randn(outputs))

    def forward(self, tokens, signs):
        return (signs.unsqueeze(-1) * self.lin(tokens)).sum(1) @ self.u


def cancellation(seed: int) -> str | None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    features, outputs, tokens = rng.randint(8, 128), rng.randint(8, 128), 2 * rng.randint(2, 24)
    batch, clip_norm = rng.randint(2, 5), rng.choice([0.1, 1.0, 10.0])
    model = Readout(features, outputs)
    base = rng.uniform(1, 100) * torch.randn(features)
    x = base + rng.choice([1e-2, 1e-3, 1e-4]) * torch.randn(batch, tokens, features)
    signs = torch.ones(batch, tokens)
    signs[:, 1::2] = -1
    signs[:, -1] += torch.tensor([10.0 ** -rng.randint(1, 6) for _ in range(batch)])

    contributions = leave_one_out(model, lambda rows: model(x[rows], signs[rows]), batch,
                                  clip_norm)
    worst = max(contributions)
    return f"an example contributes {worst:.6g} C" if worst > 1 + 1e-6 else None


# ------------------------------------------------------------------ overridden forwards


def _overridden(rng: random.Random):
    """(the layer, its input shape, whether it must be refused)."""
    kind = rng.choice(["subclass forward", "conv _conv_forward", "instance forward",
                       "construction only"])
    factor = rng.uniform(0.5, 2.0)
    if kind == "conv _conv_forward":
        class Conv(nn.Conv1d):
            def _conv_forward(self, x, weight, bias):
                return super()._conv_forward(factor * x, weight, bias)
        return Conv(2, 3, 3, padding=1), (2, 5), True
    if kind == "subclass forward":
        class Scaled(nn.Linear):
            def forward(self, x):
                return super().forward(factor * x)
        return Scaled(5, 5), (5,), True
    if kind == "instance forward":
        layer = nn.Linear(5, 5)
        layer.forward = lambda x: F.linear(factor * x, layer.weight, layer.bias)
        return layer, (5,), True

    class Initialized(nn.Linear):
        def reset_parameters(self):
            nn.init.normal_(self.weight, std=factor)
            nn.init.zeros_(self.bias)
    return Initialized(5, 5), (5,), False


def overridden(seed: int) -> str | None:
    """Refused with privacy.other_layers: refuse; exact on the per-example path."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    layer, shape, computes_otherwise = _overridden(rng)
    model = nn.Sequential(layer, nn.Tanh(), nn.Flatten(), nn.LazyLinear(3)).double()
    batch = rng.randint(2, 6)
    x, y = torch.randn(batch, *shape, dtype=torch.float64), torch.randint(0, 3, (batch,))
    model(x)  # materializes the lazy head
    try:
        PerExampleClipper(model, 0.05, other_layers="refuse").close()
        if computes_otherwise:
            return f"{type(layer).__name__} computes something else and was not refused"
    except UnsupportedLayerError:
        if not computes_otherwise:
            return "a construction-only subclass was refused"
    clipper = PerExampleClipper(model, 0.05)
    stats = clipper.accumulate(losses, model, x, y)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    clipper.close()
    expected, norms, _ = naive_clipped_sum(model, losses, x, y, 0.05)
    if not torch.allclose(stats.norms, norms, rtol=1e-9) or not torch.allclose(got, expected,
                                                                               rtol=1e-9):
        return f"{type(layer).__name__}: differs from the per-example loop"
    return None


# ------------------------------------------------------------------ late (un)freezing


def late_freezing(seed: int) -> str | None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    width = rng.randint(3, 12)
    model = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                          nn.Linear(width, 3)).double()
    layers = [model[0], model[2], model[4]]
    frozen = rng.choice(layers)
    frozen.requires_grad_(False)
    private = rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=1.0), clip_norm=0.1,
                             noise_multiplier=1.0, expected_batch_size=6, num_examples=60,
                             delta=1e-3, seed=seed)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    private.step(x, y)
    parameter = rng.choice(list(frozen.parameters()) if rng.random() < 0.5 else
                           [p for p in model.parameters() if p.requires_grad])
    parameter.requires_grad_(not parameter.requires_grad)
    before = [p.detach().clone() for p in model.parameters()]
    try:
        private.step(x, y)
    except TrainedSetChangedError:
        changed = any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
        return "refused after the parameters changed" if changed else None
    return "a step with a changed trained set was released"


FAMILIES = {"per-example path": per_example_path, "native rules": native_rules,
            "mixing in training mode": mixing, "float32 cancellation": cancellation,
            "overridden forwards": overridden, "late (un)freezing": late_freezing}


@pytest.mark.thorough
def test_every_family_is_refused_stopped_or_sound(request):
    count = request.config.getoption("--long") or 200
    outcomes, failures = Counter(), []
    names = sorted(FAMILIES)
    for seed in range(count):
        family = names[seed % len(names)]
        reason = FAMILIES[family](seed)
        outcomes[family] += 1
        if reason is not None:
            failures.append(f"{family}, seed {seed}: {reason}")
            if len(failures) >= 5:
                break
    print(f"\n{count} models in {len(FAMILIES)} families {dict(outcomes)}: {len(failures)} wrong")
    assert not failures, "\n".join(failures)
