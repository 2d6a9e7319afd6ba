"""The zoo of real architectures (tests/zoo_models.py; its table: benchmarks/model_zoo.py): each
exact against the naive per-example loop over two micro-batches with every example clipped
(float64), or refused by name; never silently wrong. The engine's known shortfalls are strict
xfails, with their minimal reproductions below."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from oracles import naive_clipped_sum
from torch import nn
from zoo_models import EXACT, KNOWN_BUGS, ZOO, check

import raydp_train as rt
from raydp_train.errors import UserError
from raydp_train.privacy.clipping import PerExampleClipper

pytest.importorskip("transformers", reason="transformers is a runtime dependency")

pytestmark = pytest.mark.usefixtures("float64")

# Refused, and why (the start of the refusal, as a pattern).
NOT_THE_EXAMPLES = r"BatchDimensionError: module '.*' \(.*\) is called with an input whose first axis"
REFUSED = {
    "DeBERTa-v2": NOT_THE_EXAMPLES,  # its relative embeddings, projected without the batch
    "OPT": NOT_THE_EXAMPLES,  # fc1 gets the tokens flattened to [B T, d]
    "T5 encoder": NOT_THE_EXAMPLES,  # relative_attention_bias: [T, T] bucket ids
    "MPNet": NOT_THE_EXAMPLES,
    "T5 encoder, one micro-batch of T examples": NOT_THE_EXAMPLES,
    "MPNet, one micro-batch of T examples": NOT_THE_EXAMPLES,
    "CLIP vision": NOT_THE_EXAMPLES,  # position_embedding looked up with a [1, N] buffer
    "SigLIP vision": NOT_THE_EXAMPLES,
    "ResNet (BatchNorm)": r"UnsupportedLayerError: module '.*normalization' \(BatchNorm2d\)",
    "Swin": r"UnsupportedLayerError: module '.*relative_position_bias' "
            r"\(SwinRelativePositionBias\) is called without the examples|" + NOT_THE_EXAMPLES,
    "BEiT": r"UnsupportedLayerError: module '.*relative_position_bias' "
            r"\(BeitRelativePositionBias\) is called without the examples|" + NOT_THE_EXAMPLES,
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
    """ViT's cls token and position embeddings, DINOv2's layer scales, torch's GRU: on the
    path, named in the run record; torch's attention and LSTM have their own rules."""
    assert check("ViT").per_example_path == ["vit.embeddings"]
    assert check("DINOv2").per_example_path == [
        "dinov2.embeddings", "dinov2.encoder.layer.0.layer_scale1",
        "dinov2.encoder.layer.0.layer_scale2"]
    assert check("GRU classifier").per_example_path == ["sequence"]
    assert check("LSTM classifier").per_example_path == []  # its own rule
    assert check("nn.TransformerEncoder").per_example_path == []


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


def test_an_embedding_looked_up_without_an_example_dimension_is_never_silently_wrong():
    """Before the example-axis check, B = T passed the shape check and the engine took the
    table's T rows for T examples (norms 1.6048 for 1.6208): now refused on the first pass."""
    torch.manual_seed(0)
    model, x, y = SharedBias(4), torch.randn(4, 4), torch.arange(4) % 3  # T = B = 4
    expected, norms, _ = naive_clipped_sum(model, losses, x, y, 1e-3)
    clipper = PerExampleClipper(model, 1e-3)
    with pytest.raises(UserError, match=r"module 'bias' \(Embedding\) is called with an input "
                                        r"whose first axis is not the examples"):
        clipper.accumulate(losses, model, x, y)
    assert expected.norm() > 0 and norms.min() > 1e-3  # every example would be clipped


def test_the_self_check_catches_the_embedding_looked_up_without_an_example_dimension():
    """Where the engine alone is wrong (above), PrivateStep's self-check refuses before the
    first noisy gradient is released."""
    torch.manual_seed(0)
    model = SharedBias(4)
    private = rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), clip_norm=1e-3,
                             noise_multiplier=0.5, expected_batch_size=4, num_examples=40,
                             delta=1e-3, seed=0)
    with pytest.raises(UserError, match="module 'bias'"):
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
