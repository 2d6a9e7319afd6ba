"""The rule registry: rules register themselves, lookups and refusals read the registry, and a
layer defined outside the package is clipped exactly once its rule is registered."""

import pytest
import torch
import torch.nn.functional as F
from oracles import engine_sum_in_parameter_order, naive_clipped_sum
from torch import nn

from raydp_train.privacy import rule_registry
from raydp_train.privacy.clipping import PerExampleClipper, UnsupportedLayerError
from raydp_train.privacy.layer_rules import LinearRule, TransposedLinearRule
from raydp_train.privacy.rule_registry import Rule, register_rule, rule_for


class ElementwiseScale(nn.Module):
    """y = x * weight, the weight [d] broadcast over every axis but the last."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width))

    def forward(self, x):
        return x * self.weight


class ElementwiseScaleRule(Rule):
    """grad_i = sum over the positions of example i (and over calls) of x_i * G_i."""

    def squared_norms(self, module, calls, slots, gram_cache):
        grads = sum((x * g).reshape(x.shape[0], -1, x.shape[-1]).sum(1)
                    for x, g in zip(calls.inputs, calls.output_grads))
        calls.state["grads"] = grads
        return grads.square().sum(1)

    def add_clipped_sum(self, module, calls, clip_factors, slots):
        slots["weight"].add_(clip_factors @ calls.state["grads"])


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry for one test: whatever the test registers is gone afterwards."""
    monkeypatch.setattr(rule_registry, "_RULES", dict(rule_registry._RULES))


@pytest.fixture
def toy_rule(registry):
    register_rule(ElementwiseScale)(ElementwiseScaleRule)


def test_built_in_rules_are_found_by_class_and_by_qualified_name():
    assert type(rule_for(nn.Linear(2, 2))) is LinearRule

    class Conv1D(nn.Linear):  # stands in for transformers' class, matched by name only
        pass

    Conv1D.__module__, Conv1D.__qualname__ = "transformers.pytorch_utils", "Conv1D"
    assert type(rule_for(Conv1D(2, 2))) is TransposedLinearRule


def test_the_decorator_registers_one_rule_by_class_and_by_name(registry):
    class Named(nn.Module):
        pass

    decorated = register_rule(ElementwiseScale, f"{__name__}.{Named.__qualname__}")(
        ElementwiseScaleRule)
    assert decorated is ElementwiseScaleRule
    assert type(rule_for(ElementwiseScale(3))) is ElementwiseScaleRule
    assert type(rule_for(Named())) is ElementwiseScaleRule


@pytest.mark.parametrize("layer", [nn.Linear, "torch.nn.modules.linear.Linear"])
def test_a_layer_registered_twice_is_refused(registry, layer):
    with pytest.raises(ValueError, match=r"torch\.nn\.modules\.linear\.Linear already has a "
                                         r"rule \(LinearRule\)"):
        register_rule(layer)(ElementwiseScaleRule)


def test_only_rules_can_be_registered(registry):
    with pytest.raises(TypeError, match="Rule subclasses"):
        register_rule(ElementwiseScale)(nn.Linear)


def test_a_rule_must_implement_the_norms_and_the_clipped_sum():
    with pytest.raises(NotImplementedError, match="Rule.squared_norms"):
        Rule().squared_norms(nn.Linear(2, 2), rule_registry.LayerCalls(), {}, {})


@pytest.mark.usefixtures("float64", "toy_rule")
def test_a_registered_user_layer_is_clipped_like_a_per_example_loop():
    torch.manual_seed(0)
    scale = ElementwiseScale(5)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), scale, nn.Tanh(), nn.Linear(5, 3))
    inputs, labels = torch.randn(8, 6, 4), torch.randint(0, 3, (8,))

    def example_losses(model, x, y):
        return nn.functional.cross_entropy(model(x).mean(1), y, reduction="none")

    expected, expected_norms, clip_norm = naive_clipped_sum(model, example_losses, inputs, labels)
    clipper = PerExampleClipper(model, clip_norm)
    norms = clipper.accumulate(example_losses, model, inputs, labels).norms
    got = engine_sum_in_parameter_order(model, clipper)
    assert torch.linalg.norm(got - expected) / torch.linalg.norm(expected) < 1e-6
    torch.testing.assert_close(norms, expected_norms, rtol=1e-9, atol=1e-12)


def test_the_refusal_lists_the_registered_layers(toy_rule):
    model = nn.Sequential(nn.Linear(4, 4), nn.GRU(4, 4, batch_first=True))
    with pytest.raises(UnsupportedLayerError) as refused:
        PerExampleClipper(model, 1.0, other_layers="refuse")
    message = str(refused.value)
    assert "module '1' (GRU) owns trainable parameter(s) 'weight_ih_l0'" in message
    listed = message.split("supported: ")[1].split(". Set privacy.other_layers")[0]
    assert listed == rule_registry.supported_layers()
    registered, *matched = listed.split("; ")
    assert sorted(m.split(" ")[0] for m in matched) == ["RMSNorm", "nn.EmbeddingBag", "nn.LSTM"]
    assert registered.split(", ") == sorted(
        ["Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ElementwiseScale",
         "Embedding", "GroupNorm", "LayerNorm", "Linear", "LoraLinear", "MultiheadAttention",
         "PReLU", "RMSNorm", "transformers.pytorch_utils.Conv1D"])


class ForgetsThePositions(ElementwiseScaleRule):
    """Wrong on sequences: the first position stands for the whole example."""

    def squared_norms(self, module, calls, slots, gram_cache):
        grads = sum((x * g).reshape(x.shape[0], -1, x.shape[-1])[:, 0]
                    for x, g in zip(calls.inputs, calls.output_grads))
        calls.state["grads"] = grads
        return grads.square().sum(1)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("rule, passes", [(ElementwiseScaleRule, True),
                                          (ForgetsThePositions, False)])
def test_check_rule_tells_a_right_rule_from_a_wrong_one(registry, rule, passes):
    import raydp_train as rt

    register_rule(ElementwiseScale)(rule)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), ElementwiseScale(6), nn.Linear(6, 3))
    x, y = torch.randn(5, 3, 4), torch.arange(5) % 3
    report = rt.check_rule(model, lambda m, x, y: F.cross_entropy(m(x).sum(1), y,
                                                                  reduction="none"), x, y, 0.1)
    assert report.passed is passes, report.message()
    if not passes:
        assert "'1.weight'" in report.message()

