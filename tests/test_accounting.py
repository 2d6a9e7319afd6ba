"""Accounting goes through dp-accounting; calibration returns the smallest sigma meeting a target."""

import pytest
from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent, pld, rdp

from raydp_train.accounting.epsilon import (
    calibrate_noise_multiplier,
    dpsgd_event,
    epsilon_spent,
    rough_epsilon_estimate,
)

Q, STEPS, SIGMA, DELTA = 0.08, 375, 2.0, 1e-5  # 30 epochs, B=64, N=800


def _oracle_event():
    return SelfComposedDpEvent(PoissonSampledDpEvent(Q, GaussianDpEvent(SIGMA)), STEPS)


def test_event_shape():
    assert dpsgd_event(Q, SIGMA, STEPS) == _oracle_event()


def test_rdp_matches_direct_accountant():
    expected = rdp.RdpAccountant().compose(_oracle_event()).get_epsilon(DELTA)
    got = epsilon_spent(Q, SIGMA, STEPS, DELTA, "rdp")
    assert got == pytest.approx(expected, rel=1e-12)
    assert abs(got - 4.007) < 5e-3


def test_pld_matches_direct_accountant():
    expected = pld.PLDAccountant().compose(_oracle_event()).get_epsilon(DELTA)
    got = epsilon_spent(Q, SIGMA, STEPS, DELTA, "pld")
    assert got == pytest.approx(expected, rel=1e-12)
    assert abs(got - 3.672) < 5e-3


def test_default_is_rdp_and_pld_is_tighter():
    assert epsilon_spent(Q, SIGMA, STEPS, DELTA) == epsilon_spent(Q, SIGMA, STEPS, DELTA, "rdp")
    assert epsilon_spent(Q, SIGMA, STEPS, DELTA, "pld") < epsilon_spent(Q, SIGMA, STEPS, DELTA)


def test_zero_steps_spend_nothing():
    assert epsilon_spent(Q, SIGMA, 0, DELTA) == 0.0
    assert epsilon_spent(Q, SIGMA, 0, DELTA, "pld") == 0.0


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_more_steps_more_epsilon(accountant):
    eps = [epsilon_spent(Q, SIGMA, steps, DELTA, accountant) for steps in (1, 10, 100, 375)]
    assert eps == sorted(eps) and len(set(eps)) == len(eps)


def test_more_noise_less_epsilon():
    eps = [epsilon_spent(Q, sigma, STEPS, DELTA) for sigma in (1.0, 2.0, 4.0)]
    assert eps == sorted(eps, reverse=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sampling_rate": 0.0}, "sampling_rate"),
        ({"sampling_rate": 1.5}, "sampling_rate"),
        ({"noise_multiplier": 0.0}, "noise_multiplier"),
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"steps": -1}, "steps"),
        ({"steps": 2.5}, "steps"),
        ({"accountant": "moments"}, "accountant"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = {"sampling_rate": Q, "noise_multiplier": SIGMA, "steps": STEPS, "delta": DELTA}
    with pytest.raises(ValueError, match=match):
        epsilon_spent(**(args | kwargs))


@pytest.mark.parametrize(
    ("target", "q", "steps", "accountant"),
    [
        (4.0, 0.08, 375, "rdp"),
        (1.0, 0.01, 1000, "rdp"),
        (8.0, 0.08, 375, "rdp"),
        (0.5, 0.001, 100, "rdp"),
        (4.0, 0.08, 375, "pld"),
    ],
)
@pytest.mark.thorough
def test_calibration_is_tight_and_smallest(target, q, steps, accountant):
    sigma = calibrate_noise_multiplier(target, DELTA, q, steps, accountant)
    eps = epsilon_spent(q, sigma, steps, DELTA, accountant)
    assert target - 1e-3 <= eps <= target
    assert epsilon_spent(q, sigma * (1 - 1e-3), steps, DELTA, accountant) > target


def test_calibration_recovers_known_sigma():
    target = epsilon_spent(Q, SIGMA, STEPS, DELTA)
    assert calibrate_noise_multiplier(target, DELTA, Q, STEPS) == pytest.approx(SIGMA, rel=1e-5)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0.0, DELTA, Q, STEPS), "target_epsilon"),
        ((-1.0, DELTA, Q, STEPS), "target_epsilon"),
        ((4.0, DELTA, Q, 0), "steps"),
        ((4.0, 2.0, Q, STEPS), "delta"),
        ((1e7, DELTA, Q, STEPS), "so loose"),
    ],
)
def test_calibration_errors(args, match):
    with pytest.raises(ValueError, match=match):
        calibrate_noise_multiplier(*args)


def test_rough_estimate_is_the_simple_formula():
    assert rough_epsilon_estimate(0.01, 1.0, 10_000, 1e-5) == pytest.approx(
        0.01 * (10_000 * 11.512925464970229) ** 0.5
    )
