"""Mechanisms are objects registered by name (ARCHITECTURE.md §2.8): the plan, the budget's
Spend, the step and the worker ask the mechanism; a fourth mechanism is one class."""

import re
from pathlib import Path

import dp_accounting
import pytest
import torch

from raydp_train.accounting.epsilon import composed_epsilon, dpsgd_event
from raydp_train.budget.terms import BudgetError, Spend
from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.models.builders import build_model
from raydp_train.privacy.mechanism import (
    MECHANISMS,
    DpSgd,
    Mechanism,
    mechanism_named,
    register_mechanism,
)
from raydp_train.train.context import LocalContext
from raydp_train.train.plan import make_plan
from raydp_train.train.worker import train

PACKAGE = Path(__file__).resolve().parents[1] / "raydp_train"


class HeadOnly(Mechanism):
    """A toy fourth mechanism: DP-SGD on the model's last layer alone."""

    name, label = "head_only", "DP-SGD (head only)"

    def attach(self, model, clip_norm: float):
        *body, _, _ = model.parameters()  # the last Linear's weight and bias train
        for parameter in body:
            parameter.requires_grad_(False)
        return super().attach(model, clip_norm)


@pytest.fixture
def head_only():
    register_mechanism(HeadOnly)
    yield HeadOnly
    del MECHANISMS[HeadOnly.name]


def digits(mechanism: str = "dpsgd"):
    pipeline = pipeline_from_dict({
        "name": "digits", "data": {"source": "sklearn_digits"},
        "model": {"kind": "mlp", "hidden_sizes": [32]},
        "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0},
        "training": {"epochs": 1, "batch_size": 128, "lr": 0.5}, "run": {"seed": 3}})
    pipeline.privacy.mechanism = mechanism  # a schema entry is all a new mechanism adds
    return pipeline


def test_a_fourth_mechanism_is_one_registered_class(head_only):
    pipeline = digits("head_only")
    plan = make_plan(pipeline, 1438)
    torch.manual_seed(3)
    initial = build_model(pipeline.model, (64,), 10)
    result = train(pipeline, plan, LocalContext(on_epoch=lambda row: None))
    body_unchanged = [torch.equal(a, b) for a, b in zip(initial.parameters(),
                                                         result.model.parameters(), strict=True)]
    assert body_unchanged == [True, True, False, False]
    assert result.trained_per_step == 32 * 10 + 10
    # Its steps are accounted as its dp_event says (here DP-SGD's), and the budget takes them
    # under its own name.
    dpsgd = make_plan(digits(), 1438)
    assert result.metrics[-1]["epsilon"] == pytest.approx(dpsgd.epsilon(plan.steps))
    assert plan.spend(plan.steps, 0).mechanism == "head_only"
    plan.spend(plan.steps, 0).check()


def test_the_registry_refuses_a_second_mechanism_of_one_name_and_names_the_registered():
    with pytest.raises(ValueError, match="'dpsgd' is already registered"):
        register_mechanism(type("Again", (DpSgd,), {}))
    with pytest.raises(ValueError, match="registered: dpsgd, lora, lsg, none"):
        mechanism_named("nope")


@pytest.mark.parametrize("name", ["dpsgd", "lsg"])
def test_private_mechanisms_are_accounted_as_dp_accounting_composes_them(name):
    event = mechanism_named(name).dp_event(0.02, 1.1, 300)
    direct = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.1)), 300)
    assert composed_epsilon([event], 1e-5, "rdp") == pytest.approx(
        composed_epsilon([direct], 1e-5, "rdp"), rel=1e-12)
    assert event == dpsgd_event(0.02, 1.1, 300)


def test_the_non_private_reference_spends_nothing_from_a_budget_and_has_no_epsilon():
    plan = make_plan(pipeline_from_dict({
        "name": "digits", "data": {"source": "sklearn_digits"}, "model": {"kind": "mlp"},
        "privacy": {"mechanism": "none"}, "training": {"epochs": 1, "batch_size": 128}}), 1438)
    assert not plan.private and plan.noise_multiplier == 0 and plan.epsilon() == float("inf")
    with pytest.raises(BudgetError, match="mechanism must be one of dpsgd, lora, lsg, got none"):
        Spend(0.1, 1.0, 10, mechanism="none").check()


def test_only_the_registry_and_the_schema_name_mechanisms():
    """Everything else asks the mechanism (no branch on a mechanism's name)."""
    naming = re.compile(r'"lsg"|== "dpsgd"|== "none"|!= "dpsgd"|!= "none"|!= "lsg"')
    found = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
             if naming.search(path.read_text())}
    assert found <= {"privacy/mechanism.py", "config/pipeline.py"}, found
