"""Models that mix the examples of a batch, in training mode only: the self-check tests the
leave-one-out invariant in the model's own mode, on rows drawn at random, and stops them
before anything is released -- in the check itself, in `private_step`, in `PrivateStep` and in
a pipeline run's preflight. Sound models with dropout pass (every pass draws the same masks).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from oracles import leave_one_out
from torch import nn

import raydp_train as rt
from raydp_train.config.privacy import SelfCheckConfig
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.self_check import SelfCheckError, compare_with_per_example
from raydp_train.train.engine_checks import EngineChecks
from raydp_train.train.step import private_step

pytestmark = pytest.mark.usefixtures("float64")


class Mixing(nn.Module):
    """A two-layer net whose hidden rows mix only in training mode, as `how` says."""

    def __init__(self, how: str, width: int = 16):
        super().__init__()
        self.how = how
        self.l1, self.l2 = nn.Linear(8, width), nn.Linear(width, 3)

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        if self.training:
            h = MIXES[self.how](h)
        return self.l2(h)


def _from_row_2(h):
    """Rows from the third on read the row before them; rows 0 and 1 stay their own."""
    return torch.cat([h[:2], 0.5 * h[2:] + 0.5 * h[1:-1]])


MIXES = {
    "mixup roll": lambda h: 0.5 * h + 0.5 * h.roll(1, 0),
    "batch-centred": lambda h: h - h.mean(0, keepdim=True),
    "hand-written batch norm": lambda h: F.batch_norm(h, None, None, training=True),
    "from row 2 on": _from_row_2,
}


def losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _batch(rows: int = 6, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=generator), torch.randint(0, 3, (rows,),
                                                                    generator=generator)


@pytest.mark.parametrize("how", list(MIXES))
def test_the_mixing_models_release_more_than_c_without_the_check(how):
    """The threat is real: the engine's own sum moves by more than C when one example goes."""
    torch.manual_seed(0)
    model = Mixing(how).train()
    x, y = _batch()
    contributions = leave_one_out(model, lambda rows: losses(model, x[rows], y[rows]), 6, 0.05)
    assert max(contributions) > 1.05


@pytest.mark.parametrize("how", list(MIXES))
def test_the_check_stops_every_mixing_model_in_training_mode(how):
    """Rows drawn at random, 20 draws: every one stops the model (the eval-mode check on the
    first two rows passed all four)."""
    torch.manual_seed(0)
    model = Mixing(how).train()
    for draw, report in enumerate(_checks(model, *_batch(), draws=20)):
        assert not report.passed, f"draw {draw}: {report}"
        assert report.message().startswith("privacy.self_check: removing one example")


def _checks(model, x, y, draws: int):
    """The self-check's report on (x, y) for `draws` different draws of its rows."""
    for draw in range(draws):
        clipper = PerExampleClipper(model, 0.05)
        try:
            yield compare_with_per_example(clipper, losses, (model, x, y),
                                           chooser=random.Random(draw))
        finally:
            clipper.close()


def test_in_eval_mode_the_same_models_are_sound_and_pass():
    for how in MIXES:
        torch.manual_seed(0)
        model = Mixing(how).eval()
        x, y = _batch()
        clipper = PerExampleClipper(model, 0.05)
        report = compare_with_per_example(clipper, losses, (model, x, y))
        assert report.passed, report.message()
        assert report.sensitivity <= 1 + 1e-12


def test_dropout_in_training_mode_is_no_false_alarm_and_the_release_is_the_checked_pass():
    """Every pass draws the same dropout masks: a sound model with dropout passes, and the
    check's full pass is exactly what the step releases (the per-example loop under the
    same random state)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 3)).train()
    x, y = _batch(rows=9)
    clipper = PerExampleClipper(model, 0.05)
    state = torch.get_rng_state()
    report = compare_with_per_example(clipper, losses, (model, x, y), examples=3,
                                      keep_pass=True)
    assert report.passed, report.message()
    after_check = torch.get_rng_state()
    checked = clipper.flat_grad.clone()
    torch.set_rng_state(state)
    clipper.zero_grad()
    clipper.accumulate(losses, model, x, y)
    assert torch.equal(clipper.flat_grad, checked)
    assert torch.equal(torch.get_rng_state(), after_check)
    clipper.close()


def _optimizer_step_model():
    torch.manual_seed(0)
    return Mixing("mixup roll").train()


def test_private_step_refuses_before_the_noisy_gradient_reaches_the_model():
    model = _optimizer_step_model()
    before = [p.detach().clone() for p in model.parameters()]
    clipper = PerExampleClipper(model, 0.05)
    checks = EngineChecks(SelfCheckConfig(), 0, lambda verdict: [verdict])
    x, y = _batch()
    with pytest.raises(SelfCheckError, match="removing one example"):
        private_step(model, clipper, torch.optim.SGD(model.parameters(), lr=1.0), [(x, y)],
                     losses, 1.0, 6, torch.Generator().manual_seed(0), engine_checks=checks)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_private_step_class_refuses_the_mixing_model_on_its_first_step():
    model = _optimizer_step_model()
    before = [p.detach().clone() for p in model.parameters()]
    private = rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=1.0), clip_norm=0.05,
                             noise_multiplier=1.0, expected_batch_size=6, num_examples=60,
                             delta=1e-3, loss=lambda m, x, y: losses(m, x, y), seed=0)
    x, y = _batch()
    with pytest.raises(SelfCheckError, match="removing one example"):
        private.step(x, y)
    assert private.steps_done == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def _one_pair(h):
    """Only rows 3 and 4 of the batch mix; every other row is its own."""
    mixed = h.clone()
    mixed[3], mixed[4] = 0.5 * (h[3] + h[4]), 0.5 * (h[4] + h[3])
    return mixed


def test_a_model_that_mixes_one_pair_of_rows_is_stopped_on_every_draw():
    """Sampled removals catch a single mixing pair only sometimes; the pass that weighs each
    row's loss by its own random weight catches any gradient crossing between rows."""
    MIXES["one pair"] = _one_pair
    try:
        torch.manual_seed(0)
        model = Mixing("one pair").train()
        for draw, report in enumerate(_checks(model, *_batch(rows=8), draws=20)):
            assert not report.passed and report.mixing_error > report.tolerance, draw
    finally:
        del MIXES["one pair"]
