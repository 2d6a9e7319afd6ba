"""The engine inside the user's own Ray Train loop: the TorchTrainer example of
docs/guides/own-loop.md runs as written on 2 workers and spends quickstart.yaml's epsilon
(dp-accounting's), its budget counts the same; on 2 workers one step's clipped sum equals one backward pass per
example (float64) and its noise is ONE draw of std sigma*C; a budget refusal stops the loop
before the refused steps; bad arguments are refused by name."""

import contextlib
import io
import sys
from pathlib import Path

import dp_accounting
import pytest
import torch
from doc_blocks import marked_block
from oracles import naive_clipped_sum
from ray import cloudpickle

import raydp_train as rt

ROOT = Path(__file__).parents[1]
GUIDE = "docs/guides/own-loop.md"
N, B, C, SIGMA = 40, 10, 4.0, 3.0


def _dp_accounting_epsilon(rate: float, sigma: float, steps: int, delta: float) -> float:
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        rate, dp_accounting.GaussianDpEvent(sigma)), steps)
    return dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)


# make test: test_two_workers_release_the_naive_clipped_sum_plus_one_noise_draw, and
# test_a_refused_reservation_stops_the_loop_before_the_refused_steps (the budget's chunks)
@pytest.mark.long
def test_the_guides_own_loop_runs_on_two_workers_and_spends_the_pipelines_epsilon(ray_session):
    namespace = {"__name__": "readme_own_loop"}  # not importable: Ray pickles its functions
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(marked_block(GUIDE, "own loop"), GUIDE, "exec"), namespace)  # noqa: S102
    metrics, status = namespace["result"].return_value, namespace["budget"].status()
    expected = _dp_accounting_epsilon(64 / 800, 2.0, 375, 1e-5)
    pipeline_epsilon = rt.validate(rt.Pipeline.from_yaml(ROOT / "pipelines/quickstart.yaml"))
    assert metrics["steps"] == 375
    assert metrics["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert metrics["epsilon"] == pytest.approx(pipeline_epsilon.epsilon(), rel=1e-12)
    assert status["epsilon_counted"] == pytest.approx(expected, rel=1e-6)  # chunks compose
    assert status["owners"]["my-loop"]["steps_spent"] == 375  # the unused rest given back
    assert status["steps_reserved"] == 0
    assert printed.getvalue().splitlines()[-2:] == [f"{metrics['epsilon']}",
                                                    f"{status['epsilon_counted']}"]


def _data(rows: int = N):
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(rows, 6, generator=generator, dtype=torch.float64) * 3
    return inputs, torch.randint(0, 2, (rows,), generator=generator)


def _model() -> torch.nn.Module:
    torch.manual_seed(1)  # float64 from the start: the same weights whatever the default dtype
    return torch.nn.Sequential(torch.nn.Linear(6, 48, dtype=torch.float64), torch.nn.Tanh(),
                               torch.nn.Linear(48, 2, dtype=torch.float64))


def _flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()


def one_seeded_step_with_and_without_data(config) -> dict:
    """One step from the same start and the same seeded noise: on the sampled rows, and on
    none. Their difference is the clipped sum alone, the second step's update the noise alone."""
    import ray.train

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    inputs, labels = _data()
    mine = torch.arange(rank, N, world)  # this rank's rows, as indices into the whole set
    after, sampled = {}, None
    for name in ("data", "noise only"):
        model = _model()
        with rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=1.0), clip_norm=C,
                            noise_multiplier=SIGMA, expected_batch_size=B, num_examples=N,
                            delta=1e-3, seed=7) as private:
            rows = private.sample(len(mine))  # the same rows both times (seed 7 + 1 + rank)
            rows = rows if name == "data" else rows[:0]
            private.step(inputs[mine[rows]], labels[mine[rows]])
            sampled = mine[rows].tolist() if name == "data" else sampled
        after[name] = _flat(model)
    every_rank = [None] * world
    torch.distributed.all_gather_object(every_rank, sampled)
    return {**after, "sampled": sorted(row for rows in every_rank for row in rows),
            "ranks_sampled": [len(rows) for rows in every_rank]}


@pytest.mark.usefixtures("float64")
def test_two_workers_release_the_naive_clipped_sum_plus_one_noise_draw(ray_session):
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    result = TorchTrainer(one_seeded_step_with_and_without_data,
                          scaling_config=ScalingConfig(num_workers=2)).fit()
    metrics = result.return_value
    assert all(count > 0 for count in metrics["ranks_sampled"])  # both ranks contributed
    start = torch.tensor(_flat(_model()))
    inputs, labels = _data()
    rows = torch.tensor(metrics["sampled"])

    def losses(model, x, y):
        return torch.nn.functional.cross_entropy(model(x), y, reduction="none")

    expected, norms, _ = naive_clipped_sum(_model(), losses, inputs[rows], labels[rows], C)
    assert (norms > C).any() and (norms < C).any()  # some clipped, some not
    with_data, noise_only = torch.tensor(metrics["data"]), torch.tensor(metrics["noise only"])
    clipped_sum = (noise_only - with_data) * B  # lr 1: each update is -(noise + sum) / B
    assert torch.max(torch.abs(clipped_sum - expected)) / torch.max(torch.abs(expected)) < 1e-9
    noise = (start - noise_only) * B
    # One draw of std sigma*C (a draw per worker would make it sqrt(2) times that); 434
    # entries estimate the std within a few percent.
    assert noise.std().item() == pytest.approx(SIGMA * C, rel=0.15)


def test_a_refused_reservation_stops_the_loop_before_the_refused_steps(ray_session):
    budget = rt.open_budget("small", epsilon=1.3, delta=1e-5)  # 9 steps, not 12
    model = _model()
    private = rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), clip_norm=C,
                             noise_multiplier=SIGMA, expected_batch_size=B, num_examples=N,
                             delta=1e-5, budget=budget, owner="loop", steps_per_charge=3)
    inputs, labels = _data()
    with pytest.raises(rt.BudgetExhausted, match="budget exhausted") as refusal:
        for _ in range(1000):
            rows = private.sample(N)
            private.step(inputs[rows], labels[rows])
    taken = private.steps_done
    assert taken > 0 and taken % 3 == 0 and f"after {taken} steps" in str(refusal.value)
    private.finish()
    status = budget.status()
    assert status["owners"]["loop"]["steps_spent"] == taken and status["steps_reserved"] == 0
    assert taken == 9
    spent = _dp_accounting_epsilon(B / N, SIGMA, taken, 1e-5)
    assert private.epsilon() == pytest.approx(spent, rel=1e-9)
    assert status["epsilon_counted"] == pytest.approx(spent, rel=1e-6) and spent <= 1.3
    assert _dp_accounting_epsilon(B / N, SIGMA, taken + 3, 1e-5) > 1.3  # why it was refused


BAD_ARGUMENTS = {
    "clip_norm": ({"clip_norm": 0.0}, "clip_norm: must be > 0"),
    "noise_multiplier": ({"noise_multiplier": 0.0}, "noise_multiplier: must be > 0"),
    "expected_batch_size": ({"expected_batch_size": N + 1}, "expected_batch_size: must be in"),
    "delta": ({"delta": 0.5}, "delta: must be in (0, 1/num_examples)"),
    "max_physical_batch": ({"max_physical_batch": 0}, "max_physical_batch: must be >= 1"),
}


@pytest.mark.parametrize("field", list(BAD_ARGUMENTS))
def test_bad_arguments_are_refused_by_name(field):
    changed, message = BAD_ARGUMENTS[field]
    arguments = {"clip_norm": C, "noise_multiplier": SIGMA, "expected_batch_size": B,
                 "num_examples": N, "delta": 1e-3, **changed}
    model = _model()
    with pytest.raises(rt.UserError, match=f"PrivateStep {message}".replace("(", r"\(")
                       .replace(")", r"\)")):
        rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=0.1), **arguments)


def _mixing_loss(model, features, labels):
    """Each example's logits centred on the batch's mean: one example moves the others'
    losses, which per-example clipping cannot bound."""
    logits = model(features)
    return torch.nn.functional.cross_entropy(logits - logits.mean(0, keepdim=True), labels,
                                             reduction="none")


@pytest.mark.usefixtures("float64")
def test_a_loss_that_mixes_examples_is_refused_before_the_first_noisy_step():
    """The own loop runs the pipeline's self-check: on the first step, the engine against one
    backward pass per example; a mismatch stops the step before its noisy gradient reaches
    the model."""
    from raydp_train.privacy.self_check import SelfCheckError

    inputs, labels = _data()
    model = _model()
    before = _flat(model)
    private = rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=1.0), clip_norm=C,
                             noise_multiplier=SIGMA, expected_batch_size=B, num_examples=N,
                             delta=1e-3, loss=_mixing_loss, seed=0)
    with pytest.raises(SelfCheckError):
        private.step(inputs[:8], labels[:8])
    assert _flat(model) == before and private.steps_done == 0
    private.finish()
    with pytest.raises(rt.UserError, match=r"PrivateStep.step after finish\(\)"):
        private.step(inputs[:8], labels[:8])
    # The same loss with the check turned off steps (privacy.self_check.enabled: false).
    unchecked = rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=1.0), clip_norm=C,
                               noise_multiplier=SIGMA, expected_batch_size=B, num_examples=N,
                               delta=1e-3, loss=_mixing_loss, seed=0,
                               self_check={"enabled": False})
    unchecked.step(inputs[:8], labels[:8])
    assert _flat(model) != before
