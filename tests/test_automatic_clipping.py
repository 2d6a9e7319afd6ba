"""privacy.clipping: automatic (Bu et al. 2023): every example's gradient scaled by
C / (||g_i|| + stability), so each contributes just under C whatever its norm, with no C to
tune against the gradients' scale. Checked against the naive per-example loop (float64) and
by leave-one-out on the engine's own sum; the accounting is DP-SGD's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracles import leave_one_out, per_example_grads
from torch import nn

from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.mechanism import make_mechanism

pytestmark = pytest.mark.usefixtures("float64")


def losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))


@pytest.mark.parametrize("clip_norm", [1e-3, 1.0, 1e3])
def test_each_example_is_normalized_as_the_per_example_loop_says(clip_norm):
    model = _model()
    x, y = torch.randn(7, 5), torch.arange(7) % 3
    grads = per_example_grads(model, losses, x, y)
    stability = 0.01
    expected = (clip_norm * grads / (grads.norm(dim=1, keepdim=True) + stability)).sum(0)
    clipper = PerExampleClipper(model, clip_norm, stability=stability)
    clipper.accumulate(losses, model, x, y)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert ((got - expected).norm() / expected.norm()).item() < 1e-9


def test_every_example_contributes_under_c_whatever_its_scale():
    model = _model()
    x, y = torch.randn(6, 5) * torch.tensor([1e-3, 1, 1e3, 1, 1, 1]).unsqueeze(1), \
        torch.arange(6) % 3
    def losses_of(rows):
        return losses(model, x[rows], y[rows])
    contributions = leave_one_out(model, losses_of, 6, 0.5, stability=0.01)
    assert max(contributions) < 1.0 and min(contributions) > 0.0


def test_the_pipeline_field_reaches_the_engine_and_flat_is_the_default():
    raw = {"name": "t", "data": {"source": "synthetic"}, "model": {"kind": "logistic"},
           "privacy": {"noise_multiplier": 1.0}}
    assert pipeline_from_dict(raw).privacy.clipping == "flat"
    raw["privacy"]["clipping"] = "fixed"  # flat's name in pipelines saved before
    assert pipeline_from_dict(raw).privacy.clipping == "flat"
    raw["privacy"].update(clipping="automatic", stability=0.05)
    privacy = pipeline_from_dict(raw).privacy
    engine = make_mechanism(privacy, torch.Generator()).attach(_model(), 1.0)
    assert engine.stability == 0.05
    engine.close()


@pytest.mark.parametrize("mechanism", ["dpsgd", "lsg", "lora"])
def test_every_mechanism_and_the_own_loops_private_step_clip_automatically(mechanism):
    import raydp_train as rt

    raw = {"name": "t", "data": {"source": "synthetic"}, "model": {"kind": "logistic"},
           "privacy": {"mechanism": mechanism, "noise_multiplier": 1.0, "clipping": "automatic",
                       "stability": 0.05,
                       **({mechanism: {"rank": 2}} if mechanism != "dpsgd" else {})}}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    engine = make_mechanism(pipeline_from_dict(raw).privacy,
                            torch.Generator().manual_seed(0)).attach(model, 0.1)
    assert engine.stability == 0.05 and engine.quantile is None
    engine.close()
    small = nn.Sequential(nn.Linear(6, 3))
    private = rt.PrivateStep(small, torch.optim.SGD(small.parameters(), lr=0.1),
                             noise_multiplier=1.0,
                             clip_norm=1.0, expected_batch_size=20, num_examples=40,
                             delta=1e-3, clipping="automatic", mechanism=mechanism, seed=0,
                             **({mechanism: {"rank": 2}} if mechanism != "dpsgd" else {}))
    assert private.clipper.stability == 0.01  # privacy.stability's default
