"""LSG against oracles: orthonormal carriers, per-example carrier gradients of an explicitly
reparametrized layer W0 + L R (naive loop), the projection formula, masks and exact zeros."""

import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from oracles import naive_clipped_sum
from torch import nn

from raydp_train.config.pipeline import LsgConfig, PipelineError, pipeline_from_dict
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.lsg import (
    LowRankSparseGradients,
    LsgConfigError,
    gradient_carriers,
    project_to_weight,
)
from raydp_train.privacy.mechanism import LowRankSparse
from raydp_train.train.context import LocalContext
from raydp_train.train.plan import make_plan
from raydp_train.train.step import cross_entropy_loss, private_step
from raydp_train.train.worker import train

pytestmark = pytest.mark.usefixtures("float64")


def lsg_for(model, **config):
    return LowRankSparseGradients(model, LsgConfig(**config), torch.Generator().manual_seed(0))


def lsg_attached(model, **config):
    """LSG attached to `model` as a worker attaches it: (mechanism, its clipper)."""
    privacy = SimpleNamespace(lsg=LsgConfig(**config))
    mechanism = LowRankSparse(privacy, torch.Generator().manual_seed(0))
    return mechanism, mechanism.attach(model, 1.0)


def test_carriers_are_orthonormal():
    weight = torch.randn(40, 30)
    left, right = gradient_carriers(weight, 5, torch.Generator().manual_seed(1))
    assert left.shape == (40, 5) and right.shape == (5, 30)
    torch.testing.assert_close(left.t() @ left, torch.eye(5), atol=1e-6, rtol=0)
    torch.testing.assert_close(right @ right.t(), torch.eye(5), atol=1e-6, rtol=0)


def test_projection_equals_the_projector_formula():
    torch.manual_seed(2)
    left, right = gradient_carriers(torch.randn(12, 9), 3, torch.Generator().manual_seed(2))
    grad = torch.randn(12, 9)
    projector_left, projector_right = left @ left.t(), right.t() @ right
    expected = projector_left @ grad + grad @ projector_right - projector_left @ grad @ projector_right
    got = project_to_weight(grad @ right.t(), left.t() @ grad, left, right)
    torch.testing.assert_close(got, expected)


class Reparametrized(nn.Module):
    """The oracle: the adapted layer as W0 + L R with L, R explicit parameters."""

    def __init__(self, layer, left, right):
        super().__init__()
        self.layer = layer
        self.left, self.right = nn.Parameter(left.clone()), nn.Parameter(right.clone())
        weight = layer.weight.detach().reshape(layer.weight.shape[0], -1)
        self.base = weight - left @ right

    def weight(self):
        return (self.base + self.left @ self.right).view_as(self.layer.weight)

    def forward(self, x):
        if isinstance(self.layer, nn.Conv2d):
            return F.conv2d(x, self.weight(), self.layer.bias, padding=self.layer.padding)
        return F.linear(x, self.weight(), self.layer.bias)


def oracle_and_engine(make_model, x, y):
    torch.manual_seed(3)
    model = make_model()
    lsg = lsg_for(model, rank=2, layers=["0"])
    carriers = lsg.carriers[model[0]]
    oracle = nn.Sequential(Reparametrized(model[0], carriers.left, carriers.right), *model[1:])
    params = [oracle[0].left, oracle[0].right, model[0].bias, *model[2:].parameters()]
    expected, norms, clip_norm = naive_clipped_sum(oracle, cross_entropy_loss, x, y,
                                                   params=params)

    clipper = PerExampleClipper(model, clip_norm, rules=lsg.rules)
    lsg.bind(clipper.slots, clipper.flat_grad)
    stats = clipper.accumulate(cross_entropy_loss, model, x, y)
    slots = clipper.slots
    got = torch.cat([
        slots[model[0]]["carrier_L"].flatten(), slots[model[0]]["carrier_R"].flatten(),
        slots[model[0]]["bias"].flatten(), *[p.grad.flatten() for p in model[2:].parameters()],
    ])
    torch.testing.assert_close(stats.norms, norms, rtol=1e-7, atol=1e-10)
    assert torch.linalg.norm(got - expected) / torch.linalg.norm(expected) < 1e-5


def test_carrier_gradients_match_a_reparametrized_linear_layer():
    y = torch.randint(0, 3, (9,))
    vectors = torch.randn(9, 7)
    oracle_and_engine(lambda: nn.Sequential(nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)), vectors, y)
    sequences = torch.randn(9, 4, 7)  # T = 4 tokens per example

    def sequence_model():
        return nn.Sequential(nn.Linear(7, 6), nn.Tanh(), nn.Flatten(), nn.Linear(24, 3))

    oracle_and_engine(sequence_model, sequences, y)


class FirstTokens(nn.Module):
    """Keeps the first k tokens: the others get an output gradient of exactly zero."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x[:, : self.k]


def test_carrier_gradients_match_with_gradient_free_trailing_tokens():
    def model():
        return nn.Sequential(nn.Linear(7, 6), nn.Tanh(), FirstTokens(2), nn.Flatten(),
                             nn.Linear(12, 3))

    oracle_and_engine(model, torch.randn(9, 5, 7), torch.randint(0, 3, (9,)))


def test_carrier_gradients_match_a_reparametrized_conv_layer():
    def model():
        return nn.Sequential(nn.Conv2d(3, 5, 3, padding=1), nn.ReLU(), nn.Flatten(),
                             nn.Linear(5 * 4 * 4, 2))

    oracle_and_engine(model, torch.randn(6, 3, 4, 4), torch.randint(0, 2, (6,)))


def linear_model():
    model = nn.Sequential(nn.Linear(10, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, torch.randn(5, 10), ((8, 10), (3, 8))


def conv_model():
    """Conv kernels flatten to n x (m k k): 8 x (3*3*3) and 3 x (8*3*3)."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Tanh(), nn.Conv2d(8, 3, 3),
                          nn.Flatten())
    return model, torch.randn(5, 3, 3, 3), ((8, 27), (3, 72))


@pytest.mark.parametrize("build", [linear_model, conv_model])
@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.75])
def test_kept_count_and_frozen_entries_exactly_zero_after_noise(sparsity, build):
    torch.manual_seed(4)
    model, x, shapes = build()
    rank = 2
    mechanism, clipper = lsg_attached(model, rank=rank, sparsity=sparsity, layers=["0", "2"])
    lsg = mechanism.lsg
    carrier_entries = sum(
        int(lsg.kept[view.storage_offset(): view.storage_offset() + view.numel()].sum())
        for module in lsg.adapted.values()
        for name, view in clipper.slots[module].items() if name.startswith("carrier")
    )
    expected = sum((n - math.floor(sparsity * n)) * rank + (m - math.floor(sparsity * m)) * rank
                   for n, m in shapes)
    assert carrier_entries == expected
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    y = torch.randint(0, 3, (5,))
    private_step(model, clipper, optimizer, [(x, y)], cross_entropy_loss, 3.0, 5.0,
                 torch.Generator().manual_seed(5), mechanism=mechanism)
    for module, carriers in lsg.carriers.items():
        grad_left, grad_right = clipper.slots[module]["carrier_L"], clipper.slots[module]["carrier_R"]
        assert torch.all(grad_left[~carriers.kept_rows] == 0)
        assert torch.all(grad_right[:, ~carriers.kept_columns] == 0)
        assert torch.all(grad_left[carriers.kept_rows] != 0)  # kept entries did get noise


def test_bad_lsg_settings_are_refused_before_training():
    model = nn.Sequential(nn.Linear(10, 4), nn.Tanh(), nn.Linear(4, 3))
    with pytest.raises(LsgConfigError, match=r"privacy.lsg.rank: must be < min\(n, m\) = 3"):
        lsg_for(model, rank=3, layers=["2"])
    with pytest.raises(LsgConfigError, match="pattern 'encoder.*' matches no"):
        lsg_for(model, rank=2, layers=["encoder.*"])
    with pytest.raises(LsgConfigError, match="no trainable Linear/Conv layer"):
        lsg_for(model, rank=5)
    raw = {"name": "x", "data": {"source": "synthetic"}, "model": {"kind": "mlp"},
           "privacy": {"noise_multiplier": 1.0, "lsg": {"rank": 2}}}
    with pytest.raises(PipelineError, match="privacy.lsg: only allowed with mechanism: lsg"):
        pipeline_from_dict(raw)
    raw["privacy"].update(mechanism="lsg", lsg={"sparsity": 1.0})
    with pytest.raises(PipelineError, match=r"privacy.lsg.sparsity: must be < 1, got 1"):
        pipeline_from_dict(raw)


def digits_pipeline(mechanism, **lsg):
    privacy = {"noise_multiplier": 1.0, "clip_norm": 1.0, "mechanism": mechanism}
    if lsg:
        privacy["lsg"] = lsg
    return pipeline_from_dict({
        "name": "digits", "data": {"source": "sklearn_digits"},
        "model": {"kind": "mlp", "hidden_sizes": [64]}, "privacy": privacy,
        "training": {"epochs": 4, "batch_size": 128, "optimizer": "adam", "lr": 0.01},
        "run": {"seed": 0},
    })


def test_lsg_accounting_equals_dpsgd_and_it_learns():
    dpsgd, lsg = digits_pipeline("dpsgd"), digits_pipeline("lsg", rank=4, sparsity=0.5)
    # The same plan but for the mechanism's name, and the same dp_event.
    assert replace(make_plan(dpsgd, 1438), mechanism=LowRankSparse) == make_plan(lsg, 1438)
    assert (make_plan(dpsgd, 1438).spend(10, 0).dp_event()
            == make_plan(lsg, 1438).spend(10, 0).dp_event())
    plan = make_plan(lsg, 1438)
    torch.set_default_dtype(torch.float32)
    result = train(lsg, plan, LocalContext(on_epoch=lambda row: None))
    assert result.metrics[-1]["epsilon"] == pytest.approx(make_plan(dpsgd, 1438).epsilon())
    assert result.metrics[-1]["test_accuracy"] > 0.5
    # Both Linear layers are adapted (min(n, m) > 4): kept carrier entries plus biases are far
    # fewer numbers than the model's 4,810 parameters.
    assert result.trained_per_step < result.model_parameters / 3


@pytest.mark.parametrize("optimizer, low_rank", [("sgd", True), ("adam", False)])
def test_only_sgd_keeps_the_reconstructed_weight_update_low_rank(optimizer, low_rank):
    """dW = dL R + L dR - L (L^T dL) R has rank <= 2r; SGD moves W by -lr dW (rank <= 2r), Adam
    by about lr * sign(dW) per coordinate: a full-rank update (why the SST-2 recipe uses SGD)."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(12, 10), nn.Tanh(), nn.Linear(10, 3))
    mechanism, clipper = lsg_attached(model, rank=2, layers=["0"])
    before = model[0].weight.detach().clone()
    optimizers = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}
    x, y = torch.randn(6, 12), torch.randint(0, 3, (6,))
    private_step(model, clipper, optimizers[optimizer](model.parameters(), lr=0.01), [(x, y)],
                 cross_entropy_loss, 1.0, 6.0, torch.Generator().manual_seed(7),
                 mechanism=mechanism)
    update_rank = torch.linalg.matrix_rank(model[0].weight.detach() - before, rtol=1e-8)
    assert (update_rank <= 2 * 2) == low_rank
