"""training.param_groups and training.schedule: groups by name patterns (LSG's adapted weights
included), Hugging Face's schedules stepped once per logical step, and restored on resume.
In-process, no Ray."""

import io
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from resuming import ResumingContext
from transformers import get_scheduler

from raydp_train.config.pipeline import PipelineError, pipeline_from_dict
from raydp_train.data.sources import load_data
from raydp_train.models.builders import build_model
from raydp_train.optim.optimizer import (
    OPTIMIZERS,
    TrainingSetupError,
    make_optimizer,
    make_schedule,
    with_settings,
)
from raydp_train.optim.schedules import Schedule
from raydp_train.optim.updates import SGD
from raydp_train.privacy.mechanism import LowRankSparse
from raydp_train.train.context import LocalContext
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


def test_a_continued_checkpoint_takes_the_new_settings_where_its_schedule_stands():
    """PBT: a trial continues another's checkpoint with its own (mutated) learning rates and
    weight decays; the schedule's place (warmup half done) carries over; the same optimizer
    and schedule built from the new settings, stepped as far, agree with it."""
    groups = [{"params": ["3.*"], "lr": 0.5}]
    before, after = (pipeline(param_groups=[{**groups[0], "lr": lr}], lr=base, warmup_steps=4,
                              weight_decay=decay)
                     for lr, base, decay in ((0.5, 0.1, 0.0), (0.2, 0.03, 0.01)))
    states = []
    for p in (before, after):
        model, _ = model_of(p)
        optimizer = make_optimizer(model, p.training)
        schedule = make_schedule(optimizer, p.training, total_steps=8)
        schedule.step(), schedule.step()
        states.append({"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()})
    continued = with_settings(states[0], after.training)
    assert continued["optimizer"]["param_groups"] == states[1]["optimizer"]["param_groups"]
    assert continued["schedule"] == states[1]["schedule"]


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


@pytest.mark.thorough
def test_the_constant_schedule_without_warmup_is_get_schedulers():
    p = pipeline()  # schedule: constant, no warmup
    plan = make_plan(p, 160)
    result = train(p, plan, LocalContext(on_epoch=lambda row: None))
    expected = reference_lrs("constant", 0, 15, 0.1, [5, 10, 15])
    assert [row["lr"] for row in result.metrics] == pytest.approx(expected, rel=1e-12)


HF_NAMES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


@pytest.mark.parametrize("name", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(("warmup", "total"), [(0, 1), (0, 15), (1, 7), (3, 15), (7, 7),
                                               (10, 301)])
def test_every_schedule_is_get_schedulers_at_every_step(name, warmup, total):
    """Our multipliers against Hugging Face's, exactly, past the last step too; the state
    dicts load into each other's schedules."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3)
    theirs = get_scheduler(HF_NAMES[name], optimizer, num_warmup_steps=warmup,
                           num_training_steps=total)
    ours = Schedule(SGD([{"params": [torch.zeros(1)], "lr": 0.3}]), name, warmup, total)
    for _ in range(total + 3):
        assert ours.get_last_lr() == theirs.get_last_lr()
        optimizer.step()
        theirs.step()
        ours.step()
    again = Schedule(SGD([{"params": [torch.zeros(1)], "lr": 0.3}]), name, warmup, total)
    again.load_state_dict(theirs.state_dict())
    assert again.last_epoch == theirs.last_epoch and again.base_lrs == theirs.base_lrs
    theirs.load_state_dict(ours.state_dict())
    assert theirs.last_epoch == ours.last_epoch == total + 3


def gradients(shapes, steps: int, seed: int) -> list[list]:
    """Random gradients of each parameter at each step; one parameter has none at step 2, as
    a parameter outside the sampled layers would."""
    generator = torch.Generator().manual_seed(seed)
    grads = [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(steps)]
    grads[2][1] = None
    return grads


def take_steps(optimizer, params, grads) -> None:
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = None if grad is None else grad.clone()
        optimizer.step()


SHAPES = [(3, 4), (4,), (2, 3, 5)]
CASES = [
    ("sgd", {}, [{"weight_decay": 0.0}, {"weight_decay": 0.0}]),
    ("sgd", {"momentum": 0.9}, [{"weight_decay": 0.01}, {"weight_decay": 0.0}]),
    ("sgd", {"momentum": 0.5, "dampening": 0.3}, [{"nesterov": False}, {"weight_decay": 0.1}]),
    ("sgd", {"momentum": 0.8, "nesterov": True}, [{"weight_decay": 0.0}, {"weight_decay": 0.02}]),
    ("adam", {}, [{"weight_decay": 0.0}, {"weight_decay": 0.05}]),
    ("adamw", {}, [{"weight_decay": 0.01}, {"weight_decay": 0.0}]),
]
TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def twin_optimizers(name, options, settings):
    """torch's optimizer and ours over equal copies of the same parameters, two groups."""
    torch.manual_seed(1)
    start = [torch.randn(shape) for shape in SHAPES]
    twins = []
    for maker in (TORCH[name], OPTIMIZERS[name]):
        params = [t.clone() for t in start]
        groups = [{"params": params[:2], "lr": 0.05, **settings[0]},
                  {"params": params[2:], "lr": 0.2, **settings[1]}]
        twins.append((maker(groups, **options), params))
    return twins


@pytest.mark.parametrize(("name", "options", "settings"), CASES)
def test_our_updates_are_torchs_bit_for_bit(name, options, settings):
    (theirs, their_params), (ours, our_params) = twin_optimizers(name, options, settings)
    grads = gradients(SHAPES, 6, seed=2)
    for step in range(6):
        take_steps(theirs, their_params, grads[step:step + 1])
        take_steps(ours, our_params, grads[step:step + 1])
        for theirs_p, ours_p in zip(their_params, our_params):
            assert torch.equal(theirs_p, ours_p), (name, step)
    assert not torch.equal(their_params[0], twin_optimizers(name, options, settings)[0][1][0])
    their_state, our_state = theirs.state_dict()["state"], ours.state_dict()["state"]
    assert their_state.keys() == our_state.keys()
    for number, values in their_state.items():
        assert values.keys() == our_state[number].keys()
        for key, value in values.items():
            assert torch.equal(value, our_state[number][key]) and value.dtype == \
                our_state[number][key].dtype, (number, key)


def through_a_file(state: dict) -> dict:
    """The state as a checkpoint holds it: saved with torch.save, read back (no tensor shared
    with the optimizer that wrote it)."""
    file = io.BytesIO()
    torch.save(state, file)
    file.seek(0)
    return torch.load(file)


@pytest.mark.parametrize(("name", "options", "settings"), CASES)
def test_a_checkpoint_moves_between_torchs_optimizer_and_ours(name, options, settings):
    """Checkpoints written with torch's optimizers (before this package had its own) resume
    with ours, and ours load into torch's: the next steps agree bit for bit."""
    grads = gradients(SHAPES, 6, seed=3)
    for writer, reader in ((0, 1), (1, 0)):
        twins = twin_optimizers(name, options, settings)
        (saving, saved_params), (loading, loaded_params) = twins[writer], twins[reader]
        take_steps(saving, saved_params, grads[:3])
        for source, target in zip(saved_params, loaded_params):
            target.copy_(source)
        loading.load_state_dict(through_a_file(saving.state_dict()))
        assert [g["lr"] for g in loading.param_groups] == [0.05, 0.2]
        take_steps(saving, saved_params, grads[3:])
        take_steps(loading, loaded_params, grads[3:])
        for a, b in zip(saved_params, loaded_params):
            assert torch.equal(a, b), (name, writer)


def test_a_checkpoint_of_other_groups_is_refused():
    (_, _), (ours, _) = twin_optimizers("sgd", {}, CASES[0][2])
    other = SGD([{"params": [torch.zeros(1)]}])
    with pytest.raises(ValueError, match="parameter groups do not match"):
        ours.load_state_dict(other.state_dict())


@pytest.mark.slow
def test_a_run_imports_neither_transformers_nor_torchs_compiler():
    """torch's optimizers import torch._dynamo (and sympy) on first use, and HF's schedules
    transformers: seconds of CPU in every worker of every run. A fresh process that builds
    each optimizer with a warmed-up schedule and takes private steps imports neither."""
    code = f"""
import sys
import torch
from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.data.sources import load_data
from raydp_train.models.builders import build_model
from raydp_train.optim.optimizer import make_optimizer, make_schedule
from raydp_train.train.step import DP_SGD, cross_entropy_loss, private_step
data = load_data(pipeline_from_dict({BASE!r}).data).to_torch()
for name in ("sgd", "adam", "adamw"):
    p = pipeline_from_dict({BASE!r}, ["training.optimizer=" + name,
                           "training.schedule=cosine", "training.warmup_steps=2"])
    model = build_model(p.model, data.feature_shape, data.num_classes)
    optimizer = make_optimizer(model, p.training)
    schedule = make_schedule(optimizer, p.training, 15)
    clipper = DP_SGD.attach(model, 1.0)
    for _ in range(3):
        private_step(model, clipper, optimizer, [(data.train_features[:8],
                     data.train_labels[:8])], cross_entropy_loss, 1.0, 8.0, torch.Generator())
        schedule.step()
    assert schedule.last_epoch == 3
print(sorted(m for m in ("torch._dynamo", "sympy", "transformers") if m in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False, cwd=Path(__file__).parents[1], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.thorough
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
