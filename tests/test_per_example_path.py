"""The per-example path (privacy/per_example_path.py): a module without a rule gets its own
parameters' per-example gradients by torch.func, inside the same forward and backward, exact
against the naive per-example loop (float64): a learned scale, a cls token, Bilinear,
EmbeddingBag in mode max, LSTM, GRU (looped: vmap cannot batch it), a subclass of
nn.MultiheadAttention with its own forward (owning its out_proj). Dropout inside such a module
is refused by name; `other_layers: refuse` refuses the module; PrivateStep trains it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracles import assert_engine_is_the_per_example_loop
from soundness_layers import Pairwise
from torch import nn

import raydp_train as rt
from raydp_train.privacy.clipping import PerExampleClipper, UnsupportedLayerError

pytestmark = pytest.mark.usefixtures("float64")


def losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


class FirstOutput(nn.Module):
    """The first tensor of a module that returns a tuple (LSTM, GRU, attention)."""

    def __init__(self, inner: nn.Module, last_token: bool = True):
        super().__init__()
        self.inner, self.last_token = inner, last_token

    def forward(self, x):
        out = self.inner(x, x, x)[0] if isinstance(self.inner, nn.MultiheadAttention) \
            else self.inner(x)
        out = out[0] if isinstance(out, tuple) else out
        return out[:, -1] if self.last_token else out


class VisionStyle(nn.Module):
    """A ViT-style model of its own: a cls token and a learned scale owned by the root,
    torch's attention, an LSTM over the tokens, PReLU."""

    def __init__(self):
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, 6))
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.attention = nn.MultiheadAttention(6, 2, batch_first=True)
        self.act = nn.PReLU()
        self.lstm = nn.LSTM(6, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) * self.scale
        attended, _ = self.attention(x, x, x)
        hidden, _ = self.lstm(self.act(attended))
        return self.head(hidden[:, 0])


class OwnAttention(nn.MultiheadAttention):
    """Torch's attention with a forward of its own: its rule no longer applies."""

    def forward(self, query, key, value, **settings):
        return super().forward(query, key, value, need_weights=False, **settings)


MODELS = {
    "vision-style (cls token, scale, attention, LSTM, PReLU)": (VisionStyle, (5, 4, 6)),
    "Bilinear": (lambda: nn.Sequential(FirstOutput(Pairwise(4), last_token=False),
                                       nn.Linear(4, 3)), (5, 4)),
    "GRU": (lambda: nn.Sequential(FirstOutput(nn.GRU(4, 5, batch_first=True)),
                                  nn.Linear(5, 3)), (5, 6, 4)),
    "attention with a forward of its own": (
        lambda: nn.Sequential(FirstOutput(OwnAttention(8, 2, batch_first=True)),
                              nn.Linear(8, 3)), (5, 4, 8)),
}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("clip_norm", [1e-3, 1e3])  # every example clipped; none
def test_modules_without_a_rule_are_exact_against_the_per_example_loop(name, clip_norm):
    build, shape = MODELS[name]
    torch.manual_seed(0)
    model = build().train()
    x, y = torch.randn(*shape), torch.arange(shape[0]) % 3
    assert_engine_is_the_per_example_loop(model, losses, x, y, clip_norm)
    clipper = PerExampleClipper(model, clip_norm)
    assert clipper.per_example_path  # the run record lists these
    clipper.close()


def test_an_embedding_bag_in_mode_max_is_exact():
    torch.manual_seed(1)
    model = nn.Sequential(nn.EmbeddingBag(20, 4, mode="max"), nn.Linear(4, 3))
    ids, y = torch.randint(0, 20, (6, 5)), torch.arange(6) % 3
    assert_engine_is_the_per_example_loop(model, losses, ids, y, 0.05)


def test_attention_owns_its_out_projection_on_the_path():
    """nn.MultiheadAttention reads `out_proj.weight` without calling out_proj: on the path (a
    subclass with a forward of its own) it owns it (one module, one slot each), instead of a
    stray use refused."""
    model = VisionStyle()
    model.attention = OwnAttention(6, 2, batch_first=True)
    clipper = PerExampleClipper(model, 1.0)
    assert "attention" in clipper.per_example_path
    assert "attention.out_proj" not in [name for name, _, _ in clipper.layers]
    assert sorted(clipper.slots[clipper.model.attention]) == [
        "in_proj_bias", "in_proj_weight", "out_proj.bias", "out_proj.weight"]


def test_dropout_inside_a_module_on_the_path_is_refused_by_name():
    torch.manual_seed(2)
    model = nn.Sequential(FirstOutput(OwnAttention(6, 2, dropout=0.5, batch_first=True)),
                          nn.Linear(6, 3)).train()
    clipper = PerExampleClipper(model, 1.0)
    with pytest.raises(UnsupportedLayerError, match=r"module '0.inner' \(OwnAttention\)"
                                                    r".*draws random numbers"):
        clipper.accumulate(losses, model, torch.randn(4, 3, 6), torch.arange(4) % 3)


def test_other_layers_refuse_refuses_by_name():
    with pytest.raises(UnsupportedLayerError, match=r"module '<root>' \(VisionStyle\) owns "
                                                    r"trainable parameter\(s\) 'cls_token', "
                                                    r"'scale' .*privacy.other_layers"):
        PerExampleClipper(VisionStyle(), 1.0, other_layers="refuse")


@pytest.mark.thorough
def test_private_step_trains_the_model_with_the_self_check_on():
    torch.manual_seed(3)
    model = VisionStyle()
    before = [p.detach().clone() for p in model.parameters()]
    private = rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=0.5), clip_norm=0.1,
                             noise_multiplier=0.5, expected_batch_size=6, num_examples=60,
                             delta=1e-3, seed=0, self_check={"step_fraction": 1.0})
    for _ in range(2):
        private.step(torch.randn(6, 4, 6), torch.arange(6) % 3)
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert private.steps_done == 2


class SharedWithALinear(nn.Module):
    """A layer with no rule whose weight is a Linear's weight too (one tied parameter)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return torch.tanh(x @ self.weight.t()) * 1.3


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(5, 5)
        self.custom = SharedWithALinear(self.linear.weight)
        self.lstm = nn.LSTM(5, 5, batch_first=True)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        hidden, _ = self.lstm(self.custom(self.linear(x)))
        return self.head(hidden[:, -1])


@pytest.mark.parametrize("clip_norm", [1e-3, 1e3])
def test_a_parameter_shared_by_a_rule_and_the_path_is_exact(clip_norm):
    torch.manual_seed(4)
    model = Tied()
    x, y = torch.randn(6, 4, 5), torch.arange(6) % 3
    assert_engine_is_the_per_example_loop(model, losses, x, y, clip_norm)



class CentredScale(nn.Module):
    """A learned gain on rows centred over the batch: mixes the examples of its call."""

    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return (x - x.mean(0, keepdim=True)) * self.gain


class MaskedMix(nn.Module):
    """Attention-like: a [T, T] mask (not per example) beside [B, T, d] inputs."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width))

    def forward(self, x, mask):
        return (mask @ x) @ self.weight


def test_a_module_on_the_path_that_mixes_its_call_is_refused_on_every_step():
    """The examples' gradients must add up to the call's batch gradient: a module that mixes
    rows fails it in the step itself, not only on the steps the self-check samples."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 6), CentredScale(6), nn.Linear(6, 3))
    clipper = PerExampleClipper(model, 1.0)
    with pytest.raises(UnsupportedLayerError, match=r"module '1' \(CentredScale\).*do not add "
                                                    r"up to the batch's"):
        clipper.accumulate(losses, model, torch.randn(5, 4), torch.arange(5) % 3)


def test_an_argument_whose_first_axis_is_not_the_examples_is_refused():
    torch.manual_seed(6)
    mix = MaskedMix(3)
    mask = torch.tril(torch.ones(4, 4)) / 4  # T = 4 = B: looks like a batched argument

    def masked_losses(x, y):
        return F.cross_entropy(mix(x, mask).sum(1), y, reduction="none")

    clipper = PerExampleClipper(mix, 1.0)
    with pytest.raises(UnsupportedLayerError, match="first axis is not the examples"):
        clipper.accumulate(masked_losses, torch.randn(4, 4, 3), torch.arange(4) % 3)


def test_an_lstm_in_float32_is_exact():
    """In float32 torch runs the LSTM with oneDNN, whose kernel under no_grad keeps no
    workspace for its backward; the per-example path computes without it."""
    assert PerExampleClipper(nn.LSTM(4, 6, batch_first=True, proj_size=5), 1.0).per_example_path
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(7)
    lstm = nn.LSTM(4, 6, batch_first=True, proj_size=5)  # a projection: no native rule
    model = nn.Sequential(FirstOutput(lstm), nn.Linear(5, 3))
    x, y = torch.randn(4, 6, 4), torch.arange(4) % 3
    clipper = PerExampleClipper(model, 1e9)  # none clipped: the sum is the batch gradient
    clipper.accumulate(losses, model, x, y)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    clipper.close()
    expected = torch.autograd.grad(losses(model, x, y).sum(), list(model.parameters()))
    expected = torch.cat([g.flatten() for g in expected])
    assert (got - expected).norm() / expected.norm() < 1e-5

