"""training.optimizer names any torch.optim class, with its keyword arguments
(training.optimizer_options): a run with torch's AdamW(foreach) trains as the package's own
adamw does; an unknown class, a keyword the class does not take, a value torch refuses are
each one line at validate time naming the field. In-process, no Ray."""

import pytest
import torch

import raydp_train as rt
from raydp_train.config.pipeline import PipelineError, pipeline_from_dict
from raydp_train.data.sources import load_data
from raydp_train.optim.optimizer import make_optimizer
from raydp_train.train.context import LocalContext
from raydp_train.train.plan import make_plan
from raydp_train.train.worker import train

BASE = {
    "name": "torch-optimizers",
    "data": {"source": "synthetic", "n_samples": 200},
    "model": {"kind": "mlp", "hidden_sizes": [16]},
    "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0},
    "training": {"epochs": 2, "batch_size": 32, "lr": 0.01, "weight_decay": 0.01,
                 "param_groups": [{"params": ["3.*"], "lr": 0.05}]},
    "run": {"seed": 3},
}


def pipeline(**training):
    return pipeline_from_dict({**BASE, "training": {**BASE["training"], **training}})


def trained(p) -> torch.Tensor:
    data = load_data(p.data)
    result = train(p, make_plan(p, data.num_train), LocalContext(on_epoch=lambda row: None))
    return torch.cat([param.detach().flatten() for param in result.model.parameters()])


def test_torchs_foreach_adamw_trains_as_the_packages_own_adamw():
    foreach = pipeline(optimizer="AdamW", optimizer_options={"foreach": True, "eps": 1e-8})
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 2))
    optimizer = make_optimizer(model, foreach.training)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["foreach"] is True
    assert [group["lr"] for group in optimizer.param_groups] == [0.05, 0.01]
    torch.testing.assert_close(trained(foreach), trained(pipeline(optimizer="adamw")),
                               rtol=1e-5, atol=1e-6)


BAD = {
    "unknown class": ({"optimizer": "Adamw"},
                      ("training.optimizer: 'Adamw' is neither one of this package's (sgd, adam, "
                      "adamw) nor a torch.optim class; torch.optim has")),
    "closure": ({"optimizer": "LBFGS"}, "training.optimizer: torch.optim.LBFGS cannot drive"),
    "unknown keyword": ({"optimizer": "AdamW", "optimizer_options": {"beta": 0.9}},
                        ("training.optimizer_options.beta: not a keyword of torch.optim.AdamW; "
                        "it takes betas, eps, amsgrad, maximize, foreach")),
    "set elsewhere": ({"optimizer": "RAdam", "optimizer_options": {"lr": 0.1}},
                      "training.optimizer_options.lr: set by training.lr"),
    "momentum here": ({"optimizer": "SGD", "optimizer_options": {"momentum": 0.9}},
                      "training.optimizer_options.momentum: set by training.momentum"),
    "no momentum": ({"optimizer": "Adagrad", "momentum": 0.9},
                    "training.momentum: torch.optim.Adagrad takes no momentum"),
    "own loop keyword": ({"optimizer": "adamw", "optimizer_options": {"fused": True}},
                         ("training.optimizer_options.fused: not a keyword of adamw; it takes "
                         "betas, eps")),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_optimizer_is_one_line_naming_the_field(case):
    changed, message = BAD[case]
    with pytest.raises(PipelineError) as refusal:
        pipeline(**changed)
    assert message in str(refusal.value) and "\n" not in str(refusal.value)


def test_a_value_torch_refuses_is_refused_at_validate_naming_the_field():
    bad = pipeline(optimizer="AdamW", optimizer_options={"betas": [2.0, 0.9]})
    with pytest.raises(rt.UserError, match=r"^training.optimizer_options: torch.optim.AdamW "
                       r"refused \{'betas': \[2.0, 0.9\]\}: Invalid beta parameter"):
        rt.validate(bad)


def test_sgd_takes_training_momentum_and_the_own_loops_take_their_keywords():
    model = torch.nn.Linear(3, 2)
    sgd = make_optimizer(model, pipeline(optimizer="SGD", momentum=0.9, param_groups=[],
                                         optimizer_options={"nesterov": True}).training)
    assert sgd.defaults["momentum"] == 0.9 and sgd.defaults["nesterov"] is True
    own = make_optimizer(model, pipeline(optimizer="adam", param_groups=[],
                                         optimizer_options={"betas": [0.8, 0.99]}).training)
    assert own.param_groups[0]["betas"] == [0.8, 0.99]
