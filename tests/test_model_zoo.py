"""The zoo of real architectures (tests/zoo_models.py; its table: benchmarks/model_zoo.py): each
exact against the naive per-example loop over two micro-batches with every example clipped
(float64), or refused by name; never silently wrong. The engine's known shortfalls are strict
xfails, with their minimal reproductions below."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from oracles import engine_sum_in_parameter_order, naive_clipped_sum
from torch import nn
from zoo_models import EXACT, KNOWN_BUGS, SHARED_LOOKUP, ZOO, check

import raydp_train as rt
from raydp_train.errors import UserError
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.self_check import SelfCheckError

pytest.importorskip("transformers", reason="transformers is a runtime dependency")

pytestmark = pytest.mark.usefixtures("float64")

# Refused, and why (the start of the refusal, as a pattern).
REFUSED = {
    "DeBERTa-v2": r"ParameterUseError: trained parameter '.*rel_embeddings.weight' is used by "
                  r"module '.*pos_dropout'",
    "OPT": r"BatchDimensionError: module '.*fc1' \(Linear\) was called with leading dimension 15",
    "T5 encoder": r"BatchDimensionError: module '.*relative_attention_bias' \(Embedding\)",
    "MPNet": r"BatchDimensionError: module '.*relative_attention_bias' \(Embedding\)",
    "CLIP vision": r"BatchDimensionError: module '.*position_embedding' \(Embedding\) was "
                   r"called with leading dimension 1",
    "SigLIP vision": r"BatchDimensionError: module '.*position_embedding' \(Embedding\) was "
                     r"called with leading dimension 1",
    "ResNet (BatchNorm)": r"UnsupportedLayerError: module '.*normalization' \(BatchNorm2d\)",
    "Swin": r"UnsupportedLayerError: module '.*relative_position_bias' "
            r"\(SwinRelativePositionBias\) is called without the examples",
    "BEiT": r"UnsupportedLayerError: module '.*relative_position_bias' "
            r"\(BeitRelativePositionBias\) is called without the examples",
}


def zoo_params():
    return [pytest.param(name, marks=pytest.mark.xfail(strict=True, raises=AssertionError,
                                                       reason=KNOWN_BUGS[name]))
            if name in KNOWN_BUGS else name for name in ZOO]


@pytest.mark.parametrize("name", zoo_params())
def test_each_architecture_is_exact_or_refused_by_name(name):
    outcome = check(name)
    if name in REFUSED:
        assert outcome.outcome == "refused", outcome
        assert re.match(REFUSED[name], outcome.detail), outcome.detail
    else:
        allowed = {"exact"} if ZOO[name].tolerance == EXACT else {"exact", "exact to float32"}
        assert outcome.outcome in allowed, outcome


def test_modules_without_a_rule_take_the_per_example_path():
    """ViT's cls token and position embeddings, DINOv2's layer scales, torch's attention and
    recurrent layers: on the path, named in the run record."""
    assert check("ViT").per_example_path == ["vit.embeddings"]
    assert check("DINOv2").per_example_path == [
        "dinov2.embeddings", "dinov2.encoder.layer.0.layer_scale1",
        "dinov2.encoder.layer.0.layer_scale2"]
    assert check("LSTM classifier").per_example_path == ["sequence"]
    assert check("nn.TransformerEncoder").per_example_path == [
        "sequence.layers.0.self_attn", "sequence.layers.1.self_attn"]


def losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


class SharedBias(nn.Module):
    """As T5's and MPNet's relative attention bias: an Embedding looked up with ids without an example
    dimension ([T]), its output broadcast over the batch."""

    def __init__(self, tokens: int):
        super().__init__()
        self.tokens, self.bias, self.head = tokens, nn.Embedding(tokens, 1), nn.Linear(tokens, 3)

    def forward(self, x):
        return self.head(x + self.bias(torch.arange(self.tokens)).squeeze(-1))


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=SHARED_LOOKUP)
def test_an_embedding_looked_up_without_an_example_dimension_is_never_silently_wrong():
    torch.manual_seed(0)
    model, x, y = SharedBias(4), torch.randn(4, 4), torch.arange(4) % 3  # T = B = 4
    expected, norms, _ = naive_clipped_sum(model, losses, x, y, 1e-3)
    clipper = PerExampleClipper(model, 1e-3)
    try:
        stats = clipper.accumulate(losses, model, x, y)
    except UserError:
        return  # refused by name: fine
    got = engine_sum_in_parameter_order(model, clipper)
    torch.testing.assert_close(stats.norms, norms, rtol=1e-9, atol=0)  # 1.6048 for 1.6208
    assert torch.linalg.norm(got - expected) / torch.linalg.norm(expected) < 1e-9


def test_the_self_check_catches_the_embedding_looked_up_without_an_example_dimension():
    """Where the engine alone is wrong (above), PrivateStep's self-check refuses before the
    first noisy gradient is released."""
    torch.manual_seed(0)
    model = SharedBias(4)
    private = rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), clip_norm=1e-3,
                             noise_multiplier=0.5, expected_batch_size=4, num_examples=40,
                             delta=1e-3, seed=0)
    with pytest.raises(SelfCheckError, match="'bias.weight'"):
        private.step(torch.randn(4, 4), torch.arange(4) % 3)
    assert private.steps_done == 0


class Table(nn.Module):
    """As Swin's relative position bias: a module whose forward takes no argument."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(4))

    def forward(self):
        return self.table


class TableModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias, self.head = Table(), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(x + self.bias())


def test_a_module_called_without_arguments_is_refused_by_name():
    torch.manual_seed(0)
    model = TableModel()
    clipper = PerExampleClipper(model, 1.0)
    with pytest.raises(UserError, match="'bias'"):
        clipper.accumulate(losses, model, torch.randn(5, 4), torch.arange(5) % 3)
