"""Model patterns outside the shipped families, in float64 against one backward pass
per example: shared parameters of every kind, hooks that change a layer's input or output,
activation checkpointing, stray uses of a trained weight (a custom autograd.Function, control
flow some micro-batches take), re-parametrized and compiled models. Each is exact to 1e-9 or
refused by name before anything is summed."""

import pytest
import torch
import torch.nn.functional as F
from oracles import assert_exact_clipping_all_and_none, naive_clipped_sum
from torch import nn
from torch.utils.checkpoint import checkpoint

from raydp_train.privacy.clipping import (
    ParameterUseError,
    PerExampleClipper,
    UnsupportedLayerError,
)

pytestmark = pytest.mark.usefixtures("float64")


def example_losses(model, inputs, labels):
    return F.cross_entropy(model(inputs), labels % 3, reduction="none")


class Stack(nn.Module):
    """Linear layers a, b, c (5 -> 5) and a head; `share` names what b and c take from a."""

    def __init__(self, share: tuple[str, ...] = (), layers: int = 2):
        super().__init__()
        self.hidden = nn.ModuleList(nn.Linear(5, 5) for _ in range(layers))
        for layer in self.hidden[1:]:
            for name in share:
                setattr(layer, name, getattr(self.hidden[0], name))
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.head(x.mean(1) if x.dim() == 3 else x)


@pytest.mark.parametrize("share", [("bias",), ("weight", "bias"), ("weight",)])
@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("tokens", [None, 4])
def test_linear_layers_sharing_a_bias_or_weight_are_exact(share, layers, tokens):
    torch.manual_seed(layers)
    model = Stack(share, layers)
    shape = (6, 5) if tokens is None else (6, tokens, 5)
    assert_exact_clipping_all_and_none(model, example_losses, torch.randn(*shape))


def test_shared_bias_never_lets_an_example_exceed_the_clip_norm():
    """The reported case (1.53 C in a 3-layer model): every clipped contribution <= C."""
    torch.manual_seed(0)
    model, x = Stack(("bias",), 3), torch.randn(8, 5)
    params = [p for p in model.parameters() if p.requires_grad]
    clipper = PerExampleClipper(model, 0.05)
    for i in range(8):
        clipper.zero_grad()
        clipper.accumulate(example_losses, model, x[i : i + 1], torch.tensor([i]))
        contribution = torch.cat([p.grad.flatten() for p in params]).norm()
        assert contribution <= 0.05 * (1 + 1e-9)


class NormsAndKernels(nn.Module):
    """Shared norm scales, convolution kernels and a Linear bias used as a LayerNorm's shift."""

    def __init__(self):
        super().__init__()
        self.conv_a, self.conv_b = nn.Conv1d(3, 3, 2, padding=1), nn.Conv1d(3, 3, 2)
        self.conv_b.weight = self.conv_a.weight
        self.norm_a, self.norm_b = nn.LayerNorm(3), nn.LayerNorm(3)
        self.norm_b.weight = self.norm_a.weight
        self.linear = nn.Linear(3, 3)
        self.norm_c = nn.LayerNorm(3)
        self.norm_c.bias = self.linear.bias
        self.head = nn.Linear(3, 3)

    def forward(self, x):  # x [B, T, 3]
        h = self.conv_b(torch.tanh(self.conv_a(x.transpose(1, 2)))).transpose(1, 2)
        h = self.norm_b(torch.tanh(self.norm_a(h)))
        h = self.norm_c(self.linear(h))
        return self.head(h.mean(1))


def test_shared_norm_scales_kernels_and_a_bias_across_kinds_are_exact():
    torch.manual_seed(1)
    assert_exact_clipping_all_and_none(NormsAndKernels(), example_losses, torch.randn(5, 4, 3))


class Hooked(nn.Module):
    def __init__(self, hook: str):
        super().__init__()
        self.a, self.head = nn.Linear(5, 5), nn.Linear(5, 3)
        if hook == "output":
            self.a.register_forward_hook(lambda module, args, out: out * 3.0)
        elif hook == "output in place":
            self.a.register_forward_hook(lambda module, args, out: (out.mul_(-2.0), None)[1])
        else:
            self.a.register_forward_pre_hook(lambda module, args: (args[0] * 2.0,))

    def forward(self, x):
        return self.head(torch.tanh(self.a(x)))


@pytest.mark.parametrize("hook", ["output", "output in place", "input"])
def test_hooks_that_change_a_layer_input_or_output_are_exact(hook):
    torch.manual_seed(2)
    assert_exact_clipping_all_and_none(Hooked(hook), example_losses, torch.randn(6, 5))


def test_a_hook_added_after_the_engine_is_differentiated_through():
    torch.manual_seed(2)
    model = Hooked("input")
    x, y = torch.randn(6, 5), torch.arange(6)
    clipper = PerExampleClipper(model, 1e9)
    model.a.register_forward_hook(lambda module, args, out: out * 3.0)  # after the engine
    clipper.accumulate(example_losses, model, x, y)
    engine = model.a.weight.grad.clone()
    clipper.close()
    model.a.weight.grad = None
    example_losses(model, x, y).sum().backward()
    torch.testing.assert_close(engine, model.a.weight.grad, rtol=1e-9, atol=1e-12)


class Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x


class CustomFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(Matmul.apply(self.a(x), self.a.weight)))


def test_a_weight_used_inside_a_custom_autograd_function_is_refused_by_name():
    model = CustomFunction()
    with pytest.raises(ParameterUseError, match=r"'a.weight' reached the loss outside"):
        PerExampleClipper(model, 1.0).accumulate(example_losses, model, torch.randn(4, 5),
                                                 torch.arange(4))


class SomeMicroBatches(nn.Module):
    """Uses its layer's weight functionally when the micro-batch holds an example whose first
    feature is positive: the same numbers otherwise, without the weight's gradient."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        weight = self.a.weight if bool((x[:, 0] > 0).any()) else self.a.weight.detach()
        return self.head(h + F.linear(h, weight))


def test_a_stray_use_in_some_micro_batches_only_is_refused_where_it_happens():
    model = SomeMicroBatches()
    x = torch.randn(6, 5)
    x[:3, 0], x[3:, 0] = -1.0, 1.0
    clipper = PerExampleClipper(model, 1.0)
    clipper.accumulate(example_losses, model, x[:3], torch.arange(3))  # no use: exact
    with pytest.raises(ParameterUseError,
                       match=r"'a.weight' is used by module '<root>' \(SomeMicroBatches\)"):
        clipper.accumulate(example_losses, model, x[3:], torch.arange(3))


@pytest.mark.parametrize("wrap, names", [
    (torch.nn.utils.weight_norm, "'weight_g', 'weight_v'"),
    (torch.nn.utils.spectral_norm, "'weight_orig'"),
])
def test_hook_style_reparametrizations_are_refused_by_name(wrap, names):
    model = nn.Sequential(wrap(nn.Linear(5, 5)), nn.Tanh(), nn.Linear(5, 3))
    with pytest.raises(UnsupportedLayerError,
                       match=rf"module '0' \(Linear\) has trainable parameter\(s\) {names}"):
        PerExampleClipper(model, 1.0)


def test_parametrization_style_weight_norm_is_refused_by_name():
    model = nn.Sequential(torch.nn.utils.parametrizations.weight_norm(nn.Linear(5, 5)),
                          nn.Linear(5, 3))
    with pytest.raises(UnsupportedLayerError, match=r"module '0.parametrizations.weight'"):
        PerExampleClipper(model, 1.0)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 3)
        self.reentrant = reentrant

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=self.reentrant)
        return self.head(h)


def backward_oracle(model, x, y, clip_norm):
    """(clipped sum, norms): the oracle (tests/oracles.py) by one .backward() per example
    (reentrant checkpoints refuse autograd.grad)."""
    expected, norms, _ = naive_clipped_sum(model, example_losses, x, y, clip_norm,
                                           use_backward=True)
    return expected, norms


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_is_exact(reentrant):
    torch.manual_seed(3)
    model, x, y = Checkpointed(reentrant), torch.randn(6, 5), torch.arange(6)
    for clip_norm in (0.01, 1e9):
        expected, norms = backward_oracle(model, x, y, clip_norm)
        for p in model.parameters():
            p.grad = None
        clipper = PerExampleClipper(model, clip_norm)
        stats = clipper.accumulate(example_losses, model, x, y)
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        clipper.close()
        torch.testing.assert_close(stats.norms, norms, rtol=1e-9, atol=1e-12)
        assert (got - expected).norm() <= 1e-9 * expected.norm()


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_hugging_face_gradient_checkpointing_is_exact(use_reentrant):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(4)
    config = transformers.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=16,
                                     max_position_embeddings=16, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    bert = transformers.BertForSequenceClassification(config).double()
    bert.gradient_checkpointing_enable({"use_reentrant": use_reentrant})
    bert.train()

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids):
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            return self.bert(input_ids=ids, position_ids=positions).logits

    model, ids, y = Classifier(), torch.randint(1, 30, (4, 6)), torch.arange(4)
    expected, norms = backward_oracle(model, ids, y, 0.01)
    for p in model.parameters():
        p.grad = None
    clipper = PerExampleClipper(model, 0.01)
    stats = clipper.accumulate(example_losses, model, ids, y)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    clipper.close()
    torch.testing.assert_close(stats.norms, norms, rtol=1e-9, atol=1e-12)
    assert (got - expected).norm() <= 1e-9 * expected.norm()


def test_a_compiled_model_is_refused_by_name():
    model = torch.compile(nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 3)))
    with pytest.raises(UnsupportedLayerError, match=r"'<root>' \(OptimizedModule\) is compiled"):
        PerExampleClipper(model, 1.0)
