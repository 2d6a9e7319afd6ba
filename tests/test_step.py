"""The DP-SGD step: normalization by q*N, the single noise draw, empty samples, micro-batches."""

import oracles
import pytest
import torch
from torch import nn

from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.train.step import NonFiniteStepError, cross_entropy_loss, private_step
from raydp_train.train.worker import epoch_ends


def make_model(seed=0, width=4):
    torch.manual_seed(seed)
    return nn.Linear(width, 3)


def flat_params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def take_step(model, batches, noise_std, expected_batch_size, clip_norm=0.5, seed=1):
    clipper = PerExampleClipper(model, clip_norm)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    generator = torch.Generator().manual_seed(seed)
    stats = private_step(
        model, clipper, optimizer, batches, cross_entropy_loss,
        noise_std, expected_batch_size, generator,
    )
    clipper.close()
    return stats


def naive_clipped_sum(model, x, y, clip_norm):
    """The oracle (tests/oracles.py), over every parameter."""
    return oracles.naive_clipped_sum(model, cross_entropy_loss, x, y, clip_norm)[0]


def test_update_divides_by_the_expected_batch_size_not_the_realized_one():
    model = make_model()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    expected = flat_params(model) - naive_clipped_sum(model, x, y, 0.5) / 10.0
    stats = take_step(model, [(x, y)], noise_std=0.0, expected_batch_size=10.0)
    assert stats.num_examples == 5
    torch.testing.assert_close(flat_params(model), expected)


def test_micro_batches_accumulate_to_the_same_step():
    x, y = torch.randn(9, 4), torch.randint(0, 3, (9,))
    one, split = make_model(), make_model()
    take_step(one, [(x, y)], noise_std=0.0, expected_batch_size=8.0)
    take_step(split, [(x[:4], y[:4]), (x[4:8], y[4:8]), (x[8:], y[8:])], 0.0, 8.0)
    torch.testing.assert_close(flat_params(one), flat_params(split))


def test_empty_sample_still_steps_with_noise_of_the_right_scale():
    model = make_model(width=2000)  # 6003 parameters: enough for an empirical std
    before = flat_params(model)
    stats = take_step(model, [], noise_std=3.0, expected_batch_size=2.0)
    update = flat_params(model) - before
    assert stats.num_examples == 0
    # lr 1: update = noise / (q N), std = 3 / 2.
    assert update.mean().abs() < 0.1
    assert update.std().item() == pytest.approx(1.5, rel=0.05)


def test_noise_is_one_draw_added_once():
    """With sigma C = s, the update's std is s / (qN): noise added twice would be sqrt(2) more."""
    model = make_model(width=5000)
    x, y = torch.randn(3, 5000) * 0, torch.zeros(3, dtype=torch.int64)
    before = flat_params(model)
    take_step(model, [(x[:1], y[:1]), (x[1:], y[1:])], noise_std=1.0, expected_batch_size=1.0)
    update = flat_params(model) - before
    # zero inputs give zero weight gradients: weight updates are pure noise
    weights = update[: 3 * 5000]
    assert weights.std().item() == pytest.approx(1.0, rel=0.03)


def test_epoch_ends_give_floor_of_epochs_over_q():
    ends = epoch_ends(30, 64, 800)
    assert ends[-1] == 375 and len(ends) == 30 and ends[0] == 12


def test_non_private_reference_steps_on_the_plain_mean_gradient():
    from raydp_train.privacy.nonprivate import SummedGradients

    model, reference = make_model(), make_model()
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    before = flat_params(model)
    engine = SummedGradients(model)
    private_step(model, engine, torch.optim.SGD(model.parameters(), lr=1.0), [(x, y)],
                 cross_entropy_loss, 0.0, 8.0, torch.Generator())
    # No clipping, no noise: the summed gradient over the expected batch size q*N = 8.
    nn.functional.cross_entropy(reference(x), y, reduction="sum").backward()
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()]) / 8.0
    torch.testing.assert_close(before - flat_params(model), expected)


def test_non_private_run_is_labelled_not_private():
    from raydp_train.checks.preflight import check_pipeline
    from raydp_train.config.pipeline import PipelineError, pipeline_from_dict
    from raydp_train.reports.run import privacy_statement
    from raydp_train.train.context import LocalContext
    from raydp_train.train.worker import train

    raw = {"name": "ref", "data": {"source": "synthetic"}, "model": {"kind": "logistic"},
           "privacy": {"mechanism": "none"}, "training": {"epochs": 2}, "run": {"seed": 0}}
    pipeline = pipeline_from_dict(raw)
    _, plan = check_pipeline(pipeline)
    result = train(pipeline, plan, LocalContext(on_epoch=lambda row: None))
    statement = privacy_statement(plan, result, workers=1)
    assert statement["epsilon"] == float("inf") and not statement["private"]
    assert not statement["for_release"] and result.metrics[-1]["test_accuracy"] > 0.7
    with pytest.raises(PipelineError, match="privacy.mechanism: mechanism none adds no noise"):
        pipeline_from_dict({**raw, "privacy": {"mechanism": "none", "noise_multiplier": 1.0}})
    with pytest.raises(PipelineError, match="budget: a non-private run"):
        pipeline_from_dict({**raw, "budget": {"name": "b", "epsilon": 1.0, "delta": 1e-5}})


@pytest.mark.parametrize("poison", ["weights", "features"])
def test_a_non_finite_step_stops_before_its_release(poison):
    """Weights blown up by a huge lr, or features beyond float32: the step raises before the
    all-reduce (nothing released) and leaves the model as it was."""
    model = make_model()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    if poison == "weights":
        with torch.no_grad():
            model.weight[0, 0] = float("inf")
    else:
        x[2, 1] = float("inf")
    before = flat_params(model).clone()
    released = []
    clipper = PerExampleClipper(model, 1.0)
    with pytest.raises(NonFiniteStepError, match="before this step's noisy gradient was released"):
        private_step(model, clipper, torch.optim.SGD(model.parameters(), lr=1.0), [(x, y)],
                     cross_entropy_loss, 1.0, 5.0, torch.Generator().manual_seed(0),
                     all_reduce_sum=released.append)
    clipper.close()
    assert released == []
    torch.testing.assert_close(flat_params(model), before, equal_nan=True)
