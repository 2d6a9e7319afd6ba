"""training.ema_decay: the bias-corrected moving average of the trained weights, held to a
float64 oracle over the weights after every step; the steps are the same as without it,
evaluation reads the average, and --resume continues it. In-process, no Ray."""

import pytest
import torch
from resuming import ResumingContext

from raydp_train.config.pipeline import PipelineError, pipeline_from_dict
from raydp_train.optim.averaging import WeightAverage
from raydp_train.train.plan import make_plan
from raydp_train.train.worker import WorkerRun, epoch_ends, train

# 200 synthetic rows -> N = 160; batch 32 -> q = 0.2: 5 steps per epoch, 15 in all.
BASE = {
    "name": "average",
    "data": {"source": "synthetic", "n_samples": 200},
    "model": {"kind": "mlp", "hidden_sizes": [16]},
    "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0},
    "training": {"epochs": 3, "batch_size": 32, "max_physical_batch": 8, "lr": 0.5,
                 "momentum": 0.5},
    "run": {"seed": 3},
}
DECAY = 0.7


def pipeline(**training):
    return pipeline_from_dict({**BASE, "training": {**BASE["training"], **training}})


def oracle_average(iterates: list[list[torch.Tensor]], decay: float) -> list[torch.Tensor]:
    """sum_i (1 - d) d^(t - i) w_i / (1 - d^t), in float64, from every step's weights."""
    t = len(iterates)
    weights = [(1 - decay) * decay ** (t - i) / (1 - decay ** t) for i in range(1, t + 1)]
    return [sum(w * step[k].double() for w, step in zip(weights, iterates, strict=True))
            for k in range(len(iterates[0]))]


def run_recording_iterates(p, context=None):
    """(result, the trained parameters after every step, the last step's parameters)."""
    plan = make_plan(p, 160)
    run = WorkerRun.setup(p, plan, context or ResumingContext(), None, None)
    params = [q for group in run.optimizer.param_groups for q in group["params"]]
    iterates = []
    ends = epoch_ends(p.training.epochs, plan.expected_batch_size, plan.num_examples)
    for epoch in range(run.first_epoch, len(ends) + 1):
        run.train_epoch(epoch, ends[epoch - 1], lambda context, step: iterates.append(
            [q.detach().clone() for q in params]))
    raw = [q.detach().clone() for q in params]
    return run.finish(), iterates, raw


@pytest.mark.thorough
def test_the_average_matches_a_float64_oracle_and_the_steps_are_unchanged():
    averaged, iterates, raw = run_recording_iterates(pipeline(ema_decay=DECAY))
    plain, plain_iterates, _ = run_recording_iterates(pipeline())
    assert len(iterates) == 15
    # The average is read, never fed back: the same weights after every step as without it.
    for mine, theirs in zip(iterates, plain_iterates, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
    returned = [p for p in averaged.model.parameters() if p.requires_grad]
    expected = oracle_average(iterates, DECAY)
    for got, want in zip(returned, expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # ... and it is not the last step's weights (the oracle would pass a no-op otherwise).
    assert max((a - b).abs().max().item() for a, b in zip(returned, raw, strict=True)) > 1e-3
    final_plain = [p for p in plain.model.parameters() if p.requires_grad]
    assert all(torch.equal(a, b) for a, b in zip(final_plain, raw, strict=True))


@pytest.mark.thorough
def test_each_epochs_metrics_are_the_averages():
    p = pipeline(ema_decay=DECAY)
    result = train(p, make_plan(p, 160), ResumingContext())
    from raydp_train.data.sources import load_data

    data = load_data(p.data).to_torch()
    model = result.model.eval()
    with torch.no_grad():
        accuracy = (model(data.test_features).argmax(1) == data.test_labels).double().mean()
    assert result.metrics[-1]["test_accuracy"] == pytest.approx(accuracy.item(), abs=1e-12)


def test_the_first_step_is_the_average_of_itself():
    """Bias-corrected: the starting weights do not count, whatever the decay."""
    param = torch.nn.Parameter(torch.zeros(3))
    average = WeightAverage([param], 0.99)
    with torch.no_grad():
        param.copy_(torch.tensor([1.0, 2.0, 3.0]))
    average.update(1)
    assert torch.equal(average.average[0], torch.tensor([1.0, 2.0, 3.0]))
    with torch.no_grad():
        param.copy_(torch.tensor([3.0, 2.0, 1.0]))
    average.update(2)  # (0.01 * 0.99 * w1 + 0.01 * w2) / (1 - 0.99^2)
    torch.testing.assert_close(average.average[0],
                               (0.99 * torch.tensor([1.0, 2, 3]) + torch.tensor([3.0, 2, 1])) / 1.99)
    with average.applied():
        assert torch.equal(param.detach(), average.average[0])
    assert torch.equal(param.detach(), torch.tensor([3.0, 2.0, 1.0]))


def assert_continues(start: list[torch.Tensor], iterates, resumed) -> None:
    """The resumed run returns `start` (the average after 5 steps) carried on over its 10
    steps: d^10 (1 - d^5) / (1 - d^15) start + (1 - d^10) / (1 - d^15) their own average."""
    carried = DECAY ** 10 * (1 - DECAY ** 5) / (1 - DECAY ** 15)
    expected = [carried * a.double() + (1 - DECAY ** 10) / (1 - DECAY ** 15) * later
                for a, later in zip(start, oracle_average(iterates, DECAY), strict=True)]
    returned = [q for q in resumed.model.parameters() if q.requires_grad]
    for got, want in zip(returned, expected, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.thorough
def test_resume_continues_the_average_from_its_checkpoint():
    """A_15 = d^10 (1 - d^5) / (1 - d^15) A_5 + the steps 6..15 the resumed run takes, each
    weighted (1 - d) d^(15 - i) / (1 - d^15)."""
    p = pipeline(ema_decay=DECAY)
    whole = ResumingContext()
    _, first_iterates, _ = run_recording_iterates(p, whole)
    checkpoint = whole.states[0]  # after epoch 1: 5 steps
    assert checkpoint["average"]["decay"] == DECAY and checkpoint["step"] == 5
    torch.testing.assert_close(
        [a.double() for a in checkpoint["average"]["average"]],
        oracle_average(first_iterates[:5], DECAY), rtol=1e-5, atol=1e-6)
    resumed, iterates, _ = run_recording_iterates(p, ResumingContext(restore_from=checkpoint))
    assert len(iterates) == 10
    assert_continues(checkpoint["average"]["average"], iterates, resumed)


@pytest.mark.thorough
def test_a_checkpoint_without_an_average_starts_one_from_its_weights():
    p = pipeline()
    whole = ResumingContext()
    train(p, make_plan(p, 160), whole)
    checkpoint = whole.states[0]
    assert checkpoint["average"] is None
    resumed, iterates, _ = run_recording_iterates(pipeline(ema_decay=DECAY),
                                                  ResumingContext(restore_from=checkpoint))
    start = [checkpoint["model"][name] for name in ("1.weight", "1.bias", "3.weight", "3.bias")]
    assert_continues(start, iterates, resumed)


@pytest.mark.parametrize("settings, message", [
    ({"ema_decay": 1.0}, "training.ema_decay"),
    ({"ema_decay": 0.0}, "training.ema_decay"),
    ({"ema_decay": 0.9, "sharding": "fsdp"}, "training.ema_decay: a weight average is kept"),
])
def test_bad_decays_are_refused_naming_the_field(settings, message):
    with pytest.raises(PipelineError, match=message):
        pipeline(**settings)
