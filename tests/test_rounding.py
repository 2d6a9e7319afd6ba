"""Gram-form norms never round towards "unclipped" (privacy/rounding.py): an example whose
token gradients cancel, crafted in float32, contributes at most C; the rounding bound holds
against float64 on random and adversarial inputs; and on ordinary inputs it costs little."""

from __future__ import annotations

import pytest
import torch
from oracles import leave_one_out
from torch import nn

from raydp_train.privacy.rounding import gamma, gram_product, unit_roundoff


class Readout(nn.Module):
    """Float32; tokens nearly equal with alternating signs: the ghost norm cancels."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 256, bias=False)
        self.register_buffer("u", 10 * torch.randn(256))

    def forward(self, tokens, signs):
        return (signs.unsqueeze(-1) * self.lin(tokens)).sum(1) @ self.u


def _cancelling_batch():
    torch.manual_seed(0)
    model = Readout()
    a = 10 * torch.randn(256)
    tokens = a + 1e-3 * torch.randn(4, 64, 256)
    signs = torch.ones(4, 64)
    signs[:, 1::2] = -1
    signs[:, -1] += torch.tensor([1e-1, 1e-2, 1e-3, 1e-4])
    return model, tokens, signs


def test_a_cancelling_example_contributes_at_most_c():
    """Before: the ghost norm rounded to 0 and examples 2 and 3 were added unclipped (30 C and
    22 C). Leave-one-out on the engine's own float32 sum: every example <= C (1 + 1e-6)."""
    model, tokens, signs = _cancelling_batch()
    true_norms = []
    for i in range(4):
        exact = model.lin.weight.detach().double().requires_grad_(True)
        out = (signs[i].double().unsqueeze(-1) * (tokens[i].double() @ exact.t())).sum(0)
        true_norms.append(torch.autograd.grad(out @ model.u.double(), exact)[0].norm().item())
    assert min(true_norms) > 20  # every example needs clipping at C = 1
    contributions = leave_one_out(model, lambda rows: model(tokens[rows], signs[rows]), 4, 1.0)
    assert max(contributions) <= 1 + 1e-6, contributions


def _tokens(batch, tokens, features, cancel: bool, generator):
    base = torch.randn(batch, 1, features, generator=generator)
    noise = torch.randn(batch, tokens, features, generator=generator)
    return base + 1e-3 * noise if cancel else noise


@pytest.mark.parametrize("cancel", [False, True])
def test_the_bound_covers_the_float32_error_against_float64(cancel):
    """For random and nearly-cancelling inputs: |fl32 value - exact| <= bound, every example."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        a = _tokens(8, 12, 40, cancel, generator)
        g = _tokens(8, 12, 30, cancel, generator)
        if cancel:
            g = g * torch.tensor([1.0, -1.0]).repeat(6).view(1, 12, 1)
        value, bound = gram_product(torch.bmm(a, a.transpose(1, 2)),
                                    torch.bmm(g, g.transpose(1, 2)),
                                    (a.norm(dim=2), a.norm(dim=2)),
                                    (g.norm(dim=2), g.norm(dim=2)), 40, 30)
        exact = torch.bmm(g.double().transpose(1, 2), a.double()).square().sum((1, 2))
        assert ((value - exact).abs() <= bound).all()


def test_the_bound_is_small_next_to_ordinary_norms():
    """Tokens in general position: the bound is a small fraction of the squared norm, so
    clipping by norm^2 + bound costs ~1e-4 of a clipped example's length, not more."""
    generator = torch.Generator().manual_seed(2)
    a = torch.randn(16, 32, 128, generator=generator)
    g = torch.randn(16, 32, 128, generator=generator)
    value, bound = gram_product(torch.bmm(a, a.transpose(1, 2)), torch.bmm(g, g.transpose(1, 2)),
                                (a.norm(dim=2), a.norm(dim=2)), (g.norm(dim=2), g.norm(dim=2)),
                                128, 128)
    assert (bound / value).max() < 1e-3


def test_gamma_and_unit_roundoff():
    assert unit_roundoff(torch.float32) == 2.0**-24
    assert unit_roundoff(torch.float64) == 2.0**-53
    assert gamma(100, torch.float32) == pytest.approx(100 * 2.0**-24, rel=1e-5)
    assert gamma(2**25, torch.float32) == float("inf")
