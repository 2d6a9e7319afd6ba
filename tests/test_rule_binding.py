"""Rules bind to behaviour and the trained set is fixed when the engine is built: a subclass or
instance that computes something else is refused by name (it got the base class's rule and
a wrong sum), as are one Parameter under two names of a module and a parameter unfrozen or
frozen after the engine was built (its raw gradient reached the optimizer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracles import assert_engine_is_the_per_example_loop
from torch import nn

import raydp_train as rt
from raydp_train.errors import UserError
from raydp_train.privacy.clipping import (
    PerExampleClipper,
    TrainedSetChangedError,
    UnsupportedLayerError,
)
from raydp_train.privacy.rule_registry import rule_for

pytestmark = pytest.mark.usefixtures("float64")


class ScaledConv(nn.Conv2d):
    """Keeps Conv2d's forward, but computes another convolution in `_conv_forward`."""

    def _conv_forward(self, x, weight, bias):
        return super()._conv_forward(2 * x, weight, bias)


class InitOnlyLinear(nn.Linear):
    """Only construction differs: the Linear rule applies (like torch's own
    NonDynamicallyQuantizableLinear)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return "init only"


def _linear_with_own_forward():
    layer = nn.Linear(6, 4)
    layer.forward = lambda x: F.linear(x.square(), layer.weight, layer.bias)
    return layer


def losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


REFUSED = {
    "_conv_forward redefined": (
        lambda: nn.Sequential(ScaledConv(1, 2, 3), nn.Flatten(), nn.Linear(8, 3)),
        "class ScaledConv redefines Conv2d._conv_forward"),
    "instance forward": (
        lambda: nn.Sequential(_linear_with_own_forward(), nn.Tanh(), nn.Linear(4, 3)),
        "the instance's own `forward` replaces Linear.forward"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_layer_that_computes_something_else_is_refused_by_name(case):
    build, reason = REFUSED[case]
    model = build()
    with pytest.raises(UnsupportedLayerError, match=rf"module '0' .*\({reason}"):
        PerExampleClipper(model, 1.0, other_layers="refuse")


@pytest.mark.parametrize("case", list(REFUSED))
def test_on_the_per_example_path_the_same_layers_are_exact(case):
    """privacy.other_layers: per_example (the default): torch.func differentiates what the
    layer really computes."""
    torch.manual_seed(0)
    build, _ = REFUSED[case]
    model = build()
    shape = (5, 1, 4, 4) if case.startswith("_conv") else (5, 6)
    x, y = torch.randn(*shape), torch.arange(5) % 3
    assert_engine_is_the_per_example_loop(model, losses, x, y, 0.05)


def test_a_subclass_that_only_constructs_differently_keeps_the_rule_and_is_exact():
    torch.manual_seed(0)
    model = nn.Sequential(InitOnlyLinear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    assert rule_for(model[0]) is rule_for(nn.Linear(1, 1))
    x, y = torch.randn(7, 6), torch.arange(7) % 3
    assert_engine_is_the_per_example_loop(model, losses, x, y, 0.05)


def test_one_parameter_under_two_names_of_a_module_is_refused():
    norm = nn.LayerNorm(6)
    norm.bias = norm.weight  # weight and bias the same Parameter
    model = nn.Sequential(nn.Linear(4, 6), norm, nn.Linear(6, 3))
    with pytest.raises(UnsupportedLayerError, match="'weight' and 'bias'"):
        PerExampleClipper(model, 1.0)


def _own_loop():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    model[0].requires_grad_(False)
    private = rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=1.0), clip_norm=0.1,
                             noise_multiplier=1.0, expected_batch_size=8, num_examples=80,
                             delta=1e-3, seed=0)
    return model, private, torch.randn(8, 6), torch.arange(8) % 3


@pytest.mark.parametrize("change", ["unfrozen", "frozen"])
def test_a_parameter_whose_requires_grad_changes_stops_the_next_step(change):
    """Unfrozen between steps of the own loop, the first layer's raw summed gradient reached
    SGD unclipped and un-noised. Now the step stops with one line before anything runs."""
    model, private, x, y = _own_loop()
    private.step(x, y)
    if change == "unfrozen":
        model[0].requires_grad_(True)
        named = r"now trained: '0.bias', '0.weight'"
    else:
        model[2].requires_grad_(False)
        named = r"now frozen: '2.bias', '2.weight'"
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TrainedSetChangedError, match=named):
        private.step(x, y)
    assert isinstance(TrainedSetChangedError("x"), UserError)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert private.steps_done == 1


def test_a_position_lookup_of_one_row_is_exact():
    """A [1, T] index next to batched lookups: each example reads its own copy of the rows."""
    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(10, 4), nn.Embedding(5, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, ids):
            where = torch.arange(ids.shape[1]).unsqueeze(0)  # [1, T]
            return self.head((self.tokens(ids) + self.positions(where)).mean(1))

    torch.manual_seed(0)
    model = Positions().double()
    ids, y = torch.randint(0, 10, (4, 5)), torch.arange(4) % 3
    assert_engine_is_the_per_example_loop(model, losses, ids, y, 0.05)
