"""The engine's soundness cases, each against the naive per-example loop.

Shared inputs with different token views, parameters used outside their layer, outputs
changed in place, batch-second modules, keyword calls, empty micro-batches and the Gram
shortcut's cancellation: each is exact (< 1e-9 relative in float64, every example clipped
and none clipped) or refused with an error that names the parameter or module.
"""

import pytest
import torch
import torch.nn.functional as F
from test_clipping import cross_entropy, engine_clipped_sum, naive_clipped_sum
from torch import nn

from raydp_train.privacy.clipping import (
    BatchDimensionError,
    ParameterUseError,
    PerExampleClipper,
    UnsupportedLayerError,
)

pytestmark = pytest.mark.usefixtures("float64")


def assert_exact(model, x, y, loss_fn=cross_entropy):
    _, norms = naive_clipped_sum(model, x, y, loss_fn, float("inf"))
    for clip_norm in (0.5 * norms.min().item(), 2 * norms.max().item()):  # all / none clipped
        expected, expected_norms = naive_clipped_sum(model, x, y, loss_fn, clip_norm)
        got, got_norms = engine_clipped_sum(model, x, y, loss_fn, clip_norm)
        assert torch.linalg.norm(got - expected) <= 1e-9 * torch.linalg.norm(expected)
        torch.testing.assert_close(got_norms, expected_norms, rtol=1e-9, atol=1e-12)


class SharedInput(nn.Module):
    """Two layers read the same tensor (a ResNet block and its downsample); a head reads both."""

    def __init__(self, first, second, head_width):
        super().__init__()
        self.first, self.second = first, second
        self.head = nn.Linear(head_width, 3)

    def forward(self, x):
        return self.head(torch.cat([self.first(x).flatten(1), self.second(x).flatten(1)], 1))


SHARED_INPUT_PAIRS = {
    "resnet downsample": (lambda: nn.Conv2d(8, 8, 3, stride=2, padding=1),
                          lambda: nn.Conv2d(8, 8, 1, stride=2), (5, 8, 4, 4), 64),
    "3x3 and 1x1": (lambda: nn.Conv2d(8, 8, 3, padding=1), lambda: nn.Conv2d(8, 8, 1),
                    (5, 8, 2, 2), 64),
    "dilated": (lambda: nn.Conv2d(8, 8, 3, padding=1),
                lambda: nn.Conv2d(8, 8, 3, padding=2, dilation=2), (5, 8, 3, 3), 144),
    "conv1d": (lambda: nn.Conv1d(8, 8, 3, padding=1), lambda: nn.Conv1d(8, 8, 1), (5, 8, 3), 48),
    "conv1d and linear": (lambda: nn.Conv1d(4, 16, 1), lambda: nn.Linear(4, 16), (5, 4, 4), 128),
}


@pytest.mark.parametrize("order", ["as listed", "reversed"])
@pytest.mark.parametrize("pair", sorted(SHARED_INPUT_PAIRS))
def test_layers_reading_one_input_through_different_token_views(pair, order):
    """The input Gram of one layer must never be reused for another whose token view
    (unfolded patches, or features on another axis) differs; with the downsample first in
    module order this once under-estimated norms and let clipped examples exceed C."""
    make_first, make_second, shape, head_width = SHARED_INPUT_PAIRS[pair]
    torch.manual_seed(0)
    first, second = make_first(), make_second()
    if order == "reversed":
        first, second = second, first
    model = SharedInput(first, second, head_width)
    assert_exact(model, torch.randn(*shape), torch.randint(0, 3, (shape[0],)))


def test_a_clipped_contribution_never_exceeds_the_clip_norm_on_a_downsample_block():
    torch.manual_seed(1)
    model = SharedInput(nn.Conv2d(8, 8, 1, stride=2), nn.Conv2d(8, 8, 3, stride=2, padding=1), 64)
    x, y = torch.randn(5, 8, 4, 4), torch.randint(0, 3, (5,))
    clipper = PerExampleClipper(model, clip_norm=1e-3)
    for i in range(5):
        clipper.zero_grad()
        clipper.accumulate(lambda a, b: cross_entropy(model(a), b), x[i : i + 1], y[i : i + 1])
        assert torch.linalg.norm(clipper.flat_grad) == pytest.approx(1e-3, rel=1e-9)


def test_tied_lm_head_used_functionally_is_refused_by_name():
    class TiedHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding, self.mix = nn.Embedding(7, 4), nn.Linear(4, 4)

        def forward(self, ids):
            return F.linear(self.mix(self.embedding(ids)), self.embedding.weight).mean(1)

    model = TiedHead()
    clipper = PerExampleClipper(model, 1.0)
    ids, y = torch.randint(0, 7, (3, 5)), torch.randint(0, 7, (3,))
    with pytest.raises(ParameterUseError, match=r"'embedding.weight' is used by module '<root>'"):
        clipper.accumulate(lambda: cross_entropy(model(ids), y))
    assert clipper.flat_grad.abs().sum() == 0  # refused before anything was summed
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("other_layers", ["per_example", "refuse"])
def test_multihead_attention_out_proj_trained_without_in_proj_is_exact(other_layers):
    """nn.MultiheadAttention uses out_proj.weight without calling out_proj: its rule owns
    out_proj (a Linear rule of out_proj's own would miss that use)."""
    attention = nn.MultiheadAttention(4, 2, batch_first=True)
    model = nn.ModuleDict({"before": nn.Linear(4, 4), "attention": attention})
    attention.in_proj_weight.requires_grad_(False)
    attention.in_proj_bias.requires_grad_(False)

    def losses(x):
        h = model["before"](x)
        return model["attention"](h, h, h, need_weights=False)[0].square().sum((1, 2))

    x = torch.randn(3, 5, 4)
    per_example = torch.stack([
        torch.cat([g.flatten() for g in torch.autograd.grad(
            losses(x[i:i + 1]).sum(), [p for p in model.parameters() if p.requires_grad])])
        for i in range(3)])
    clipper = PerExampleClipper(model, 1.0, other_layers=other_layers)
    norms = clipper.accumulate(losses, x).norms
    torch.testing.assert_close(norms, per_example.norm(dim=1), rtol=1e-9, atol=0)


def test_a_layer_called_through_forward_directly_is_refused():
    class Bypass(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.head = nn.Linear(3, 3), nn.Linear(3, 2)

        def forward(self, x):
            return self.head(self.inner.forward(x))  # no hooks run for `inner`

    model = Bypass()
    with pytest.raises(ParameterUseError, match="'inner.weight'"):
        PerExampleClipper(model, 1.0).accumulate(
            lambda: cross_entropy(model(torch.randn(4, 3)), torch.randint(0, 2, (4,)))
        )


def test_the_audit_runs_again_when_the_layer_calls_change():
    """A model that uses a weight functionally only in some forwards is caught when it does."""

    class Sometimes(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding, self.extra, self.head = nn.Embedding(5, 3), nn.Linear(3, 3), nn.Linear(3, 2)
            self.tie = False

        def forward(self, ids):
            h = self.embedding(ids).mean(1)
            if self.tie:
                h = self.extra(h) + F.linear(h, self.embedding.weight)[:, :3]
            return self.head(h)

    model = Sometimes()
    clipper = PerExampleClipper(model, 1.0)
    ids, y = torch.randint(0, 5, (4, 3)), torch.randint(0, 2, (4,))
    clipper.accumulate(lambda: cross_entropy(model(ids), y))
    model.tie = True
    with pytest.raises(ParameterUseError, match="'embedding.weight'"):
        clipper.accumulate(lambda: cross_entropy(model(ids), y))


def test_layer_output_changed_in_place_is_still_counted():
    """F.linear returns a view for a biased Linear on [B, T, m]; relu_() on it once hid the
    gradient from the output hook and the layer came back with a zero .grad."""
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2))

    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return net[2](net[1](net[0](x)).relu_())

    x, y = torch.randn(4, 5, 3), torch.randn(4, 5, 2)

    def squared(out, target):
        return (out - target).square().sum((1, 2))

    assert_exact(InPlace(), x, y, squared)


@pytest.mark.parametrize("change", ["relu_", "residual", "mul_"])
def test_gpt2_conv1d_output_changed_in_place(change):
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(3)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.proj, self.head = conv1d(6, 6), conv1d(4, 6), nn.Linear(4, 2)

        def forward(self, x):
            h = self.fc(x)
            if change == "relu_":
                h.relu_()
            elif change == "residual":
                h += x
            else:
                h.mul_(x)
            return self.head(self.proj(h).mean(1))

    assert_exact(Block(), torch.randn(4, 5, 6), torch.randint(0, 2, (4,)))


def test_layer_called_with_a_keyword_argument():
    torch.manual_seed(4)

    class Keyword(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

        def forward(self, x):
            return self.head(torch.tanh(self.inner(input=x)))

    assert_exact(Keyword(), torch.randn(5, 3), torch.randint(0, 2, (5,)))


@pytest.mark.parametrize("module", [
    nn.TransformerEncoderLayer(4, 2, dim_feedforward=8),  # batch_first=False by default
    nn.GRU(4, 4),
])
def test_batch_second_modules_with_trained_parameters_are_refused(module):
    model = nn.ModuleDict({"seq": module, "head": nn.Linear(4, 2)})
    with pytest.raises(BatchDimensionError, match=r"module 'seq' .* batch_first=False"):
        PerExampleClipper(model, 1.0)


def test_frozen_batch_second_module_is_accepted():
    model = nn.ModuleDict({"seq": nn.GRU(4, 4), "head": nn.Linear(4, 2)})
    model["seq"].requires_grad_(False)
    assert PerExampleClipper(model, 1.0).num_parameters == 10


def test_empty_micro_batch_adds_nothing():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 4), nn.LayerNorm(4), nn.Flatten(),
                          nn.Linear(12, 2))
    clipper = PerExampleClipper(model, 1.0)
    ids, y = torch.randint(0, 6, (4, 3)), torch.randint(0, 2, (4,))
    stats = clipper.accumulate(lambda a, b: cross_entropy(model(a), b), ids[:0], y[:0])
    assert stats.norms.shape == (0,) and clipper.flat_grad.abs().sum() == 0
    clipper.accumulate(lambda a, b: cross_entropy(model(a), b), ids, y)
    clipper.close()
    expected, _ = naive_clipped_sum(model, ids, y, cross_entropy, 1.0)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.linalg.norm(got - expected) <= 1e-9 * torch.linalg.norm(expected)


def test_gram_cancellation_never_gives_a_negative_or_nan_norm():
    """An example whose token gradients cancel (G^T a = 0 with a, G nonzero): the ghost norm
    <a a^T, G G^T> is a sum of large terms that cancel to 0 in exact arithmetic."""
    torch.manual_seed(6)
    layer = nn.Linear(8, 8, bias=False)
    clipper = PerExampleClipper(layer, 1.0)
    token = torch.randn(8) * 1e3
    a = torch.stack([token, token, token]).unsqueeze(0).repeat(4, 1, 1)  # identical tokens
    weights = torch.tensor([1.0, -0.7, -0.3])  # sum to 0: the gradients cancel
    target = torch.randn(8)

    def losses():
        out = layer(a)  # [4, 3, 8]
        return (out * target).sum(2) @ weights * 1e3

    norms = clipper.accumulate(losses).norms
    assert torch.isfinite(norms).all() and (norms >= 0).all()
    assert norms.max() < 1e-6 * torch.linalg.norm(token) * torch.linalg.norm(target) * 1e3


def test_unsupported_layer_error_is_the_parameter_use_error_base():
    assert issubclass(ParameterUseError, UnsupportedLayerError)


def test_a_stray_use_in_a_later_micro_batch_is_refused_and_adds_nothing():
    """Every pass is checked, not only the first (a stray use behind data-dependent control
    flow); a micro-batch runs one forward, and a refused one leaves the buffer as it was."""

    class Branching(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
            self.stray = False

        def forward(self, x):
            h = torch.tanh(self.first(x))
            return self.head(h + F.linear(h, self.first.weight) if self.stray else h)

    torch.manual_seed(7)
    model = Branching()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    clipper = PerExampleClipper(model, 1.0)
    clipper.accumulate(lambda: cross_entropy(model(x), y))
    clipper.accumulate(lambda: cross_entropy(model(x), y))
    assert len(forwards) == 2
    before = clipper.flat_grad.clone()
    model.stray = True
    with pytest.raises(ParameterUseError, match=r"'first.weight' is used by module '<root>'"):
        clipper.accumulate(lambda: cross_entropy(model(x), y))
    torch.testing.assert_close(clipper.flat_grad, before, rtol=0, atol=0)
    assert all(p.grad is view for p, view in clipper.bound)
