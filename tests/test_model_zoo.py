"""The zoo of real architectures (tests/zoo_models.py; its table: benchmarks/model_zoo.py): each
exact against the naive per-example loop over two micro-batches with every example clipped
(float64), or refused by name; never silently wrong. The engine's known shortfalls are strict
xfails, with their minimal reproductions below."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from oracles import assert_engine_is_the_per_example_loop
from torch import nn
from zoo_models import EXACT, KNOWN_BUGS, ZOO, check

import raydp_train as rt
from raydp_train.errors import UserError
from raydp_train.privacy.clipping import PerExampleClipper

pytest.importorskip("transformers", reason="transformers is a runtime dependency")

# The whole zoo runs in `make test`; `make test-fast` leaves it out (a minute or more).
pytestmark = [pytest.mark.usefixtures("float64"), pytest.mark.thorough]

# Refused, and why (the start of the refusal, as a pattern).
NOT_THE_EXAMPLES = r"BatchDimensionError: module '.*' \(.*\) is called with an input whose first axis"
REFUSED = {
    # get_rel_embedding reads rel_embeddings.weight outside the Embedding's own forward
    "DeBERTa-v2": r"ParameterUseError: trained parameter '.*rel_embeddings.weight' is used",
    "ResNet (BatchNorm)": r"UnsupportedLayerError: module '.*normalization' \(BatchNorm2d\)",
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

    def __init__(self, tokens: int, dropout: float = 0.0):
        super().__init__()
        self.tokens, self.bias, self.head = tokens, nn.Embedding(tokens, 1), nn.Linear(tokens, 3)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.head(self.dropout(x + self.bias(torch.arange(self.tokens)).squeeze(-1)))


def test_an_embedding_looked_up_without_an_example_dimension_is_exact():
    """A table shared by the batch, with B = T (the shape check alone once took its T rows for
    T examples: norms 1.6048 for 1.6208): each example's gradient by a backward of its own."""
    torch.manual_seed(0)
    model, x, y = SharedBias(4), torch.randn(4, 4), torch.arange(4) % 3  # T = B = 4
    assert_engine_is_the_per_example_loop(model, losses, x, y, 1e-3)


def test_a_shared_table_is_refused_where_other_layers_are():
    torch.manual_seed(0)
    model, x, y = SharedBias(4), torch.randn(4, 4), torch.arange(4) % 3
    clipper = PerExampleClipper(model, 1e-3, other_layers="refuse")
    with pytest.raises(UserError, match=r"module 'bias' \(Embedding\) is called with an input "
                                        r"whose first axis is not the examples"):
        clipper.accumulate(losses, model, x, y)


def test_a_shared_table_trains_under_the_self_check():
    """PrivateStep's self-check (leave-one-out, every example clipped, in training mode with
    dropout: each example's backward reads the batch's masks) passes, and the step is released."""
    torch.manual_seed(0)
    model = SharedBias(4, dropout=0.3).train()
    private = rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), clip_norm=1e-3,
                             noise_multiplier=0.5, expected_batch_size=4, num_examples=40,
                             delta=1e-3, seed=0)
    private.step(torch.randn(4, 4), torch.arange(4) % 3)
    assert private.steps_done == 1
    assert private.clipper.shared_calls == ["bias"]


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


def test_a_module_called_without_arguments_is_exact():
    """As Swin's relative position bias: no input at all, its output shared by the batch."""
    torch.manual_seed(0)
    assert_engine_is_the_per_example_loop(TableModel(), losses, torch.randn(5, 4),
                                          torch.arange(5) % 3, 0.5)
