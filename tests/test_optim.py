"""training.param_groups and training.schedule: groups by name patterns (LSG's adapted weights
included), Hugging Face's schedules stepped once per logical step, and restored on resume.
In-process, no Ray."""

import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import get_scheduler

from raydp_train.config.pipeline import PipelineError, pipeline_from_dict
from raydp_train.data.sources import load_data
from raydp_train.models.builders import build_model
from raydp_train.privacy.mechanism import LowRankSparse
from raydp_train.train.context import LocalContext
from raydp_train.train.optim import TrainingSetupError, make_optimizer, make_schedule
from raydp_train.train.plan import make_plan
from raydp_train.train.step import cross_entropy_loss, private_step
from raydp_train.train.worker import train

# 200 synthetic rows -> N = 160; batch 32 -> q = 0.2: 5 steps per epoch.
BASE = {
    "name": "optim",
    "data": {"source": "synthetic", "n_samples": 200},
    "model": {"kind": "mlp", "hidden_sizes": [16]},  # Flatten, 1: Linear, ReLU, 3: Linear
    "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0},
    "training": {"epochs": 3, "batch_size": 32, "max_physical_batch": 8, "lr": 0.1},
    "run": {"seed": 3},
}


def pipeline(**training):
    return pipeline_from_dict({**BASE, "training": {**BASE["training"], **training}})


def model_of(p):
    data = load_data(p.data).to_torch()
    torch.manual_seed(0)
    return build_model(p.model, data.feature_shape, data.num_classes), data


def test_groups_take_their_own_lr_and_the_rest_takes_training_lr():
    p = pipeline(weight_decay=0.01, param_groups=[
        {"params": ["3.*"], "lr": 0.5}, {"params": ["1.weight", "3.bias"], "weight_decay": 0.2}])
    model, _ = model_of(p)
    groups = make_optimizer(model, p.training).param_groups
    layer1, layer3 = model[1], model[3]
    assert [(len(g["params"]), g["lr"], g["weight_decay"]) for g in groups] == [
        (2, 0.5, 0.01), (1, 0.1, 0.2), (1, 0.1, 0.01)]
    assert groups[0]["params"][0] is layer3.weight  # 3.bias stays in the first group matching it
    assert groups[1]["params"] == [layer1.weight] and groups[2]["params"] == [layer1.bias]


@pytest.mark.parametrize(("groups", "expected"), [
    ([{"params": ["1.*"]}, {"params": ["x*"], "lr": 1.0}],
     "training.param_groups[1].params: pattern 'x*' matches no trainable parameter"),
    ([{"params": ["1.*"]}, {"params": ["1.weight"], "lr": 1.0}],
     "training.param_groups[1].params: every parameter it matches is already in an earlier"),
])
def test_a_pattern_that_selects_nothing_names_its_entry(groups, expected):
    p = pipeline(param_groups=groups)
    model, _ = model_of(p)
    with pytest.raises(TrainingSetupError) as caught:
        make_optimizer(model, p.training)
    assert str(caught.value).startswith(expected)


def test_hf_groups_use_the_names_of_model_trainable():
    from raydp_train.config.pipeline import HFModel
    from raydp_train.models.hf import build_hf_model

    tiny = {"model_type": "bert", "vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 16}
    model = build_hf_model(HFModel(kind="hf", config=tiny, num_labels=2), num_labels=2)
    p = pipeline(param_groups=[{"params": ["classifier.*"], "lr": 0.5}])
    groups = make_optimizer(model, p.training).param_groups
    assert groups[0]["params"] == [model.model.classifier.weight, model.model.classifier.bias]


def test_param_group_lr_applies_to_lsg_adapted_weights():
    """The adapted weight's .grad comes from the carriers (write_weight_grads); its group's
    lr is what moves it: W' = W - lr_group * W.grad (plain SGD)."""
    p = pipeline(param_groups=[{"params": ["1.weight"], "lr": 0.7}])
    model, data = model_of(p)
    lsg_config = pipeline_from_dict({**BASE, "privacy": {
        **BASE["privacy"], "mechanism": "lsg", "lsg": {"rank": 2, "layers": ["1"]}}}).privacy.lsg
    mechanism = LowRankSparse(SimpleNamespace(lsg=lsg_config), torch.Generator().manual_seed(0))
    clipper = mechanism.attach(model, 1.0)
    optimizer = make_optimizer(model, p.training)
    before = {name: t.detach().clone() for name, t in model.named_parameters()}
    batch = [(data.train_features[:8], data.train_labels[:8])]
    private_step(model, clipper, optimizer, batch, cross_entropy_loss, 0.0, 8.0,
                 torch.Generator(), mechanism=mechanism)
    weight = model[1].weight
    assert weight.grad.abs().sum() > 0
    torch.testing.assert_close(weight.detach(), before["1.weight"] - 0.7 * weight.grad)
    torch.testing.assert_close(model[3].weight.detach(),
                               before["3.weight"] - 0.1 * model[3].weight.grad)


def reference_lrs(name: str, warmup: int, total: int, lr: float, steps: list[int]) -> list:
    """get_scheduler's learning rate after each number of steps in `steps`."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    schedule = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total)
    values, done = [], 0
    for k in steps:
        for _ in range(k - done):
            optimizer.step()
            schedule.step()
        done = k
        values.append(schedule.get_last_lr()[0])
    return values


@pytest.mark.parametrize(("schedule", "warmup", "hf_name"), [
    ({"schedule": "linear", "warmup_fraction": 0.2}, 3, "linear"),  # ceil(0.2 * 15)
    ({"schedule": "cosine", "warmup_steps": 4}, 4, "cosine"),
    ({"schedule": "constant", "warmup_steps": 7}, 7, "constant_with_warmup"),
])
def test_schedule_counts_logical_steps_as_get_scheduler_does(schedule, warmup, hf_name):
    p = pipeline(**schedule)  # 5 steps per epoch, each of about 4 micro-batches of <= 8
    plan = make_plan(p, 160)
    result = train(p, plan, LocalContext(on_epoch=lambda row: None))
    steps = [row["steps"] for row in result.metrics]
    assert steps == [5, 10, 15] and plan.steps == 15
    expected = reference_lrs(hf_name, warmup, 15, 0.1, steps)
    assert [row["lr"] for row in result.metrics] == pytest.approx(expected, rel=1e-12)
    assert len({round(lr, 12) for lr in expected}) > 1  # the schedule really moved


def test_the_constant_schedule_is_get_schedulers_and_needs_no_transformers(monkeypatch):
    p = pipeline()  # schedule: constant, no warmup
    plan = make_plan(p, 160)
    result = train(p, plan, LocalContext(on_epoch=lambda row: None))
    expected = reference_lrs("constant", 0, 15, 0.1, [5, 10, 15])
    assert [row["lr"] for row in result.metrics] == pytest.approx(expected, rel=1e-12)
    # A checkpoint's schedule state loads into HF's constant schedule and back.
    model, _ = model_of(p)
    ours = make_schedule(make_optimizer(model, p.training), p.training, 15)
    theirs = get_scheduler("constant", make_optimizer(model, p.training))
    theirs.load_state_dict(ours.state_dict())
    ours.load_state_dict(theirs.state_dict())
    # Without transformers (an import of it fails): the constant schedule never asks for it.
    monkeypatch.setitem(sys.modules, "transformers", None)
    make_schedule(make_optimizer(model, p.training), p.training, 15)
    with pytest.raises(ImportError):
        make_schedule(make_optimizer(model, p.training), pipeline(schedule="linear").training, 15)


class ResumingContext(LocalContext):
    """Keeps every epoch's checkpoint; restores the one it is given, as Ray Train would."""

    def __init__(self, restore_from=None):
        super().__init__(on_epoch=lambda row: None)
        self.states, self.restore_from = [], restore_from

    def restore(self):
        return self.restore_from

    def report(self, row, state):
        self.states.append(state)


def test_schedule_state_survives_resume():
    p = pipeline(schedule="linear", warmup_steps=2,
                 param_groups=[{"params": ["1.*"], "lr": 0.3}])
    plan = make_plan(p, 160)
    whole = ResumingContext()
    uninterrupted = train(p, plan, whole)
    resumed = train(p, plan, ResumingContext(restore_from=whole.states[0]))  # after epoch 1
    assert [r["lr"] for r in resumed.metrics] == pytest.approx(
        [r["lr"] for r in uninterrupted.metrics], rel=1e-12)
    end = reference_lrs("linear", 2, 15, 0.3, [15])[0]
    last = whole.states[-1]["optimizer"]["param_groups"]
    assert last[0]["lr"] == pytest.approx(end, abs=1e-15)
    assert "schedule" in whole.states[0] and whole.states[0]["schedule"]["last_epoch"] == 5


def test_warmup_settings_are_checked():
    with pytest.raises(PipelineError, match="training.warmup_steps: set warmup_steps or"):
        pipeline(warmup_steps=2, warmup_fraction=0.1)
    p = pipeline(warmup_steps=16)
    model, _ = model_of(p)
    with pytest.raises(TrainingSetupError, match="training.warmup_steps: must be <= the run's 15"):
        make_schedule(make_optimizer(model, p.training), p.training, 15)
