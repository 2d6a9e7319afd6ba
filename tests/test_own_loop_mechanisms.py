"""PrivateStep in one process, against oracles: sigma calibrated to a target epsilon is
dp-accounting's, and the loop stops there; epsilon after a save and a restore (and after a
dead attempt that released steps past its checkpoint) is dp-accounting's for every step
released; DP-SGD on dict and tuple batches releases the per-example loop's clipped sum; LSG,
DP-LoRA and secure noise step; rows load from a DataLoader; bad input is refused on one line,
by name, before any noisy gradient."""

import dp_accounting
import pytest
import torch
from oracles import clip_and_sum
from torch import nn

import raydp_train as rt
from raydp_train.accounting.epsilon import calibrate_noise_multiplier

N, B, C, SIGMA, DELTA = 40, 10, 4.0, 3.0, 1e-3


def dp_accounting_epsilon(sigma: float, steps: int, delta: float = DELTA) -> float:
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        B / N, dp_accounting.GaussianDpEvent(sigma)), steps)
    return dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)


def _rows(rows: int = N):
    generator = torch.Generator().manual_seed(3)
    return (torch.randn(rows, 6, generator=generator) * 3,
            torch.randint(0, 2, (rows,), generator=generator))


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _private(model=None, **changed) -> rt.PrivateStep:
    model = model or _model()
    arguments = {"clip_norm": C, "noise_multiplier": SIGMA, "expected_batch_size": B,
                 "num_examples": N, "delta": DELTA, **changed}
    return rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), **arguments)


def _steps(private: rt.PrivateStep, count: int) -> None:
    rows = _rows()
    for _ in range(count):
        private.step(*private.sample(rows))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.thorough
def test_target_epsilon_calibrates_sigma_as_dp_accounting_and_the_loop_stops_there():
    private = _private(noise_multiplier=None, target_epsilon=2.0, steps=12,
                       steps_per_charge=5)
    sigma = private.noise_multiplier
    assert sigma == calibrate_noise_multiplier(2.0, DELTA, B / N, 12)
    assert 2.0 - 1e-3 <= dp_accounting_epsilon(sigma, 12) <= 2.0
    assert dp_accounting_epsilon(sigma * 0.999, 12) > 2.0  # the smallest such sigma
    _steps(private, 12)  # chunks of 5, 5, then the 2 planned steps left
    assert private.epsilon() == pytest.approx(dp_accounting_epsilon(sigma, 12), rel=1e-12)
    before = _flat(private.model)
    with pytest.raises(rt.BudgetExhausted, match="target epsilon reached"):
        _steps(private, 1)
    assert torch.equal(_flat(private.model), before) and private.steps_released == 12


def test_a_restored_state_continues_its_accounting_and_its_model():
    first = _private(seed=5)
    _steps(first, 3)
    state = first.state_dict()
    _steps(first, 2)  # released past the checkpoint: in memory, nothing records them
    second = _private(seed=5)
    second.load_state_dict(state)
    assert torch.equal(_flat(second.model), torch.cat([v.flatten() for k, v in
                                                       state["model"].items()]))
    _steps(second, 4)
    assert second.steps_done == 7 and second.steps_released == 7
    assert second.epsilon() == pytest.approx(dp_accounting_epsilon(SIGMA, 7), rel=1e-12)
    third = _private()
    third.load_state_dict(second.state_dict())
    assert third.epsilon() == pytest.approx(dp_accounting_epsilon(SIGMA, 7), rel=1e-12)


def test_a_record_dir_counts_what_a_dead_attempt_released_past_its_checkpoint(tmp_path):
    """Attempt 1 saves at step 3, releases 2 more and dies; attempt 2 resumes at 3 and takes 4:
    9 steps were released (steps 3 and 4 twice, with new noise each time)."""
    dead = _private(record_dir=str(tmp_path), steps_per_charge=4)
    _steps(dead, 3)
    state = dead.state_dict()
    _steps(dead, 2)  # marked in its release log before each release, then it dies
    restarted = _private(record_dir=str(tmp_path), steps_per_charge=4)
    restarted.load_state_dict(state)
    _steps(restarted, 4)
    assert restarted.steps_done == 7 and restarted.steps_released == 9
    assert restarted.epsilon() == pytest.approx(dp_accounting_epsilon(SIGMA, 9), rel=1e-12)
    restarted.finish()


def test_a_saved_state_of_another_loop_or_after_a_step_is_refused_by_name():
    state = _private().state_dict()
    other = _private(noise_multiplier=2.0)
    with pytest.raises(rt.UserError, match=r"^PrivateStep load_state_dict: noise_multiplier "
                       r"is 2.0 here and 3.0 in the saved state"):
        other.load_state_dict(state)
    stepped = _private()
    _steps(stepped, 1)
    with pytest.raises(rt.UserError, match="load_state_dict after step()"):
        stepped.load_state_dict(state)


class TwoInputs(nn.Module):
    """A multi-input model: a vector and a sequence, each through its own layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.vector, self.tokens = nn.Linear(6, 2), nn.Embedding(11, 2)

    def forward(self, vector, tokens):
        return self.vector(vector) + self.tokens(tokens).sum(1)


def _dict_loss(model, batch):
    logits = model(batch["vector"], batch["tokens"])
    return nn.functional.cross_entropy(logits, batch["labels"], reduction="none")


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("layout", ["dict", "tuple"])
def test_dict_and_tuple_batches_release_the_per_example_clipped_sum(layout):
    """One seeded step on the rows and one on none: the difference is the clipped sum."""
    generator = torch.Generator().manual_seed(4)
    rows = {"vector": torch.randn(N, 6, generator=generator) * 3,
            "tokens": torch.randint(0, 11, (N, 5), generator=generator),
            "labels": torch.randint(0, 2, (N,), generator=generator)}
    after, sampled = {}, None
    for name in ("data", "noise only"):
        model = TwoInputs()
        private = _private(model, seed=7, **({"loss": _dict_loss} if layout == "dict" else {}))
        private.optimizer.param_groups[0]["lr"] = 1.0
        batch = private.sample(rows)  # the same rows both times: seed 7, step 0
        if name == "data":
            sampled = batch
        else:
            batch = {key: value[:0] for key, value in batch.items()}
        if layout == "tuple":
            private.step(batch["vector"], batch["tokens"], batch["labels"])
        else:
            private.step(batch)
        after[name] = _flat(model)
    model = TwoInputs()
    per_example = []
    for i in range(sampled["labels"].shape[0]):
        loss = _dict_loss(model, {k: v[i:i + 1] for k, v in sampled.items()}).sum()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        per_example.append(torch.cat([g.flatten() for g in grads]))
    expected, norms, _ = clip_and_sum(torch.stack(per_example), C)
    assert (norms > C).any() and len(per_example) > 1
    clipped_sum = (after["noise only"] - after["data"]) * B
    assert torch.max(torch.abs(clipped_sum - expected)) / torch.max(torch.abs(expected)) < 1e-9


@pytest.mark.parametrize("mechanism, settings", [("lsg", {"rank": 2}), ("lora", {"rank": 2})])
def test_lsg_and_lora_step_and_spend_dp_sgds_epsilon(mechanism, settings):
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(),
                          nn.Linear(8, 2))
    private = _private(model, mechanism=mechanism, **{mechanism: settings})
    groups = len(private.optimizer.param_groups)
    assert groups == (2 if mechanism == "lora" else 1)  # the adapters: a group of their own
    start = _flat(private.model)
    _steps(private, 3)
    assert not torch.equal(_flat(private.model), start)
    assert private.epsilon() == pytest.approx(dp_accounting_epsilon(SIGMA, 3), rel=1e-12)
    restarted = _private(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8),
                                       nn.Tanh(), nn.Linear(8, 2)),
                         mechanism=mechanism, **{mechanism: settings})
    restarted.load_state_dict(private.state_dict())  # adapters and all
    assert torch.equal(_flat(restarted.model), _flat(private.model))
    _steps(restarted, 1)
    assert restarted.epsilon() == pytest.approx(dp_accounting_epsilon(SIGMA, 4), rel=1e-12)


def test_secure_noise_steps():
    private = _private(noise="secure")
    assert private.noise_mode == "secure"
    start = _flat(private.model)
    _steps(private, 1)
    assert not torch.equal(_flat(private.model), start)


def test_rows_load_from_a_dataloader_of_dicts_and_tuples():
    inputs, labels = _rows()
    dataset = torch.utils.data.TensorDataset(inputs, labels)
    loaded = rt.PrivateStep.load_rows(torch.utils.data.DataLoader(dataset, batch_size=7))
    assert torch.equal(loaded[0], inputs) and torch.equal(loaded[1], labels)
    as_dicts = [{"x": inputs[i:i + 8], "y": labels[i:i + 8]} for i in range(0, N, 8)]
    loaded = rt.PrivateStep.load_rows(as_dicts)
    assert torch.equal(loaded["x"], inputs) and torch.equal(loaded["y"], labels)
    private = _private(seed=0)
    sampled = private.sample(loaded)
    assert set(sampled) == {"x", "y"} and 0 < sampled["y"].shape[0] < N


BAD = {
    "both sigma and target": ({"target_epsilon": 1.0, "steps": 5},
                              "noise_multiplier, target_epsilon: give exactly one"),
    "target without steps": ({"noise_multiplier": None, "target_epsilon": 1.0},
                             "steps: target_epsilon needs the planned number of steps"),
    "unreachable target": ({"noise_multiplier": None, "target_epsilon": 1e9, "steps": 5},
                           "target_epsilon: target_epsilon=1000000000.0 is so loose"),
    "mechanism none": ({"mechanism": "none"}, "mechanism: must be one of 'dpsgd', 'lora', 'lsg'"),
    "settings of another": ({"lsg": {"rank": 2}}, "lsg: only with mechanism='lsg'"),
    "bad setting": ({"mechanism": "lsg", "lsg": {"rank": 0}}, "lsg.rank: must be >= 1, got 0"),
    "noise mode": ({"noise": "quantum"}, "noise: must be one of 'fast', 'secure'"),
    "seeded secure": ({"noise": "secure", "seed": 1}, "noise: 'secure' cannot be seeded"),
    "self check": ({"self_check": {"examples": 0}}, "self_check.examples: must be >= 1"),
    "accountant": ({"accountant": "moments"}, "accountant: must be one of 'rdp', 'pld'"),
    "loss": ({"loss": "cross_entropy"}, "loss: must be a function (model, *batch)"),
    "chunk": ({"steps_per_charge": 0}, "steps_per_charge: must be an int > 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_are_refused_on_one_line_by_name(case):
    changed, message = BAD[case]
    with pytest.raises(rt.UserError) as refusal:
        _private(**changed)
    assert str(refusal.value).startswith(f"PrivateStep {message}")
    assert "\n" not in str(refusal.value)


BAD_BATCHES = {
    "text": (lambda x, y: ({"x": x, "text": ["a"] * len(y)},),
             "step: batch['text'][0] is a str, not a tensor"),
    "sizes": (lambda x, y: (x, y[:-1]), "step: the tensors of a batch must share their first"),
    "a dict's keys": (lambda x, y: tuple({"x": x, "y": y}),
                      "step: got strings ('x', 'y'), the keys of a dict batch"),
    "default loss on a dict": (lambda x, y: ({"x": x, "y": y},),
                               "loss: the default loss takes step(inputs..., labels)"),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_bad_batches_are_refused_before_any_noisy_step(case):
    make, message = BAD_BATCHES[case]
    private = _private()
    before = _flat(private.model)
    inputs, labels = _rows()
    with pytest.raises(rt.UserError) as refusal:
        private.step(*make(inputs[:4], labels[:4]))
    assert str(refusal.value).startswith(f"PrivateStep {message}")
    assert torch.equal(_flat(private.model), before) and private.steps_released == 0
