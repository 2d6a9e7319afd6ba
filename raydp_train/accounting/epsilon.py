"""Privacy accounting for DP-SGD (ARCHITECTURE.md §2.5), done entirely by `dp-accounting`.

One DP-SGD step is ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``; a run of ``T`` steps
is that event self-composed ``T`` times. Two accountants are offered:

- ``"rdp"`` (default): Rényi DP, fast; a valid but loose upper bound, markedly loose for small
  noise multipliers (sigma below ~0.5-1), where it can overstate epsilon several-fold.
- ``"pld"``: privacy-loss distributions, tighter (notably for small sigma) but slower.

No RDP formula is written here: every epsilon comes from a dp-accounting accountant.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import dp_accounting

# dp-accounting's RDP warns (through absl's logger) each time it drops an order whose series
# does not converge; dropping orders only loosens the bound, which stays valid.
logging.getLogger("absl").setLevel(logging.ERROR)

Accountant = Literal["rdp", "pld"]

# Calibration searches sigma in [_MIN_NOISE_MULTIPLIER (pld: PLD_MIN_NOISE_MULTIPLIER),
# _MAX_NOISE_MULTIPLIER]: below the floor the privacy guarantee is meaningless anyway.
_MIN_NOISE_MULTIPLIER = 0.05
# Below it PLD's privacy-loss grid (1e-4 apart) outgrows memory: sigma 0.3 takes under 1 GiB
# for 1,000 steps, 0.05 over 6 GiB for 54, 0.001 asks for 38 GiB. RDP has no such floor.
PLD_MIN_NOISE_MULTIPLIER = 0.3
_MAX_NOISE_MULTIPLIER = 1e6
# Brent's tolerance in sigma, relative to the bracket: small enough that epsilon lands within
# 1e-3 of the target (checked in tests) and the result is the smallest sigma to ~1e-8 relative.
_RELATIVE_SIGMA_TOL = 1e-8


def dpsgd_event(sampling_rate: float, noise_multiplier: float, steps: int) -> dp_accounting.DpEvent:
    """``steps`` DP-SGD steps: ``SelfComposed(PoissonSampled(q, Gaussian(sigma)), steps)``."""
    import dp_accounting  # here, not above: a Ray worker that computes no epsilon skips scipy

    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
        ),
        steps,
    )


def gaussian_release_event(noise_multiplier: float, releases: int) -> dp_accounting.DpEvent:
    """``releases`` Gaussian mechanisms of sensitivity 1 (e.g. noisy counts of correct answers)."""
    import dp_accounting

    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.GaussianDpEvent(noise_multiplier), releases
    )


def repeat_and_select_event(
    trial_event: dp_accounting.DpEvent, mean_trials: float, shape: float
) -> dp_accounting.DpEvent:
    """A random number of trials (mean, shape; Papernot & Steinke 2022) and the best one kept."""
    import dp_accounting

    return dp_accounting.dp_event.RepeatAndSelectDpEvent(trial_event, mean_trials, shape)


def composed_epsilon(
    events: list[dp_accounting.DpEvent], delta: float, accountant: Accountant = "rdp"
) -> float:
    """Epsilon at ``delta`` of all ``events`` composed, by the chosen accountant."""
    import dp_accounting

    if accountant == "pld":
        check_pld_noise(min((smallest_noise_multiplier(e) for e in events), default=math.inf))
    ledger = make_accountant(accountant)
    ledger.compose(dp_accounting.ComposedDpEvent(list(events)))
    return float(ledger.get_epsilon(delta))


def smallest_noise_multiplier(event: dp_accounting.DpEvent) -> float:
    """The smallest Gaussian noise multiplier inside ``event`` (inf where it has none)."""
    import dp_accounting

    if isinstance(event, dp_accounting.GaussianDpEvent):
        return event.noise_multiplier
    inner = getattr(event, "events", None) or [getattr(event, "event", None)]
    return min((smallest_noise_multiplier(e) for e in inner if e is not None), default=math.inf)


def check_pld_noise(noise_multiplier: float) -> None:
    """Refuse, in one line, a PLD account whose grid would not fit in memory."""
    if noise_multiplier < PLD_MIN_NOISE_MULTIPLIER:
        raise ValueError(
            f"the pld accountant needs noise multipliers >= {PLD_MIN_NOISE_MULTIPLIER} (got "
            f"{noise_multiplier:g}): below it its privacy-loss grid needs GiBs of memory; "
            "use the rdp accountant")


def make_accountant(accountant: Accountant) -> dp_accounting.PrivacyAccountant:
    """A fresh dp-accounting accountant: ``RdpAccountant()`` or ``PLDAccountant()``."""
    from dp_accounting import pld, rdp

    if accountant == "rdp":
        return rdp.RdpAccountant()
    if accountant == "pld":
        return pld.PLDAccountant()
    raise ValueError(f"accountant must be 'rdp' or 'pld', got {accountant!r}")


def _check_common(sampling_rate: float, delta: float, steps: int) -> None:
    if not 0.0 < sampling_rate <= 1.0:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if isinstance(steps, bool) or int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")


def epsilon_spent(
    sampling_rate: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    accountant: Accountant = "rdp",
) -> float:
    """Epsilon at ``delta`` after ``steps`` DP-SGD steps with sampling rate q and noise sigma.

    RDP uses ``RdpAccountant()`` with its default orders; PLD uses ``PLDAccountant()``.
    RDP is loose for small sigma (below ~0.5-1); prefer PLD there.
    """
    _check_common(sampling_rate, delta, steps)
    if not noise_multiplier > 0.0:
        raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}")
    ledger = make_accountant(accountant)
    if accountant == "pld":
        check_pld_noise(noise_multiplier)
    if steps == 0:
        return 0.0
    event = dpsgd_event(sampling_rate, noise_multiplier, int(steps))
    return float(ledger.compose(event).get_epsilon(delta))


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    accountant: Accountant = "rdp",
) -> float:
    """The smallest sigma with ``epsilon_spent(q, sigma, steps, delta) <= target``: dp-accounting's
    ``calibrate_dp_mechanism`` (Brent's method, ~1e-8 relative in sigma) on a bracket found by
    doubling or halving from the rough estimate; epsilon is at most the target, within 1e-3."""
    from dp_accounting import mechanism_calibration

    _check_common(sampling_rate, delta, steps)
    make_accountant(accountant)
    if not target_epsilon > 0.0 or math.isinf(target_epsilon):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon}")
    if steps == 0:
        raise ValueError("steps must be >= 1 to calibrate: zero steps spend no privacy")

    def epsilon_at(sigma: float) -> float:
        return epsilon_spent(sampling_rate, sigma, steps, delta, accountant)

    floor = PLD_MIN_NOISE_MULTIPLIER if accountant == "pld" else _MIN_NOISE_MULTIPLIER
    guess = rough_epsilon_estimate(sampling_rate, 1.0, steps, delta) / target_epsilon
    guess = min(max(guess, floor), _MAX_NOISE_MULTIPLIER)
    low, high = guess, guess
    if epsilon_at(guess) > target_epsilon:  # too little noise: double until the target is met
        while True:
            if high >= _MAX_NOISE_MULTIPLIER:
                raise ValueError(
                    f"target_epsilon={target_epsilon} at delta={delta} cannot be met with "
                    f"noise_multiplier <= {_MAX_NOISE_MULTIPLIER:g} (sampling_rate="
                    f"{sampling_rate}, steps={steps}); raise the target or train fewer steps"
                )
            low, high = high, min(2.0 * high, _MAX_NOISE_MULTIPLIER)
            if epsilon_at(high) <= target_epsilon:
                break
    else:  # enough noise: halve until the target is missed
        while True:
            if low <= floor:
                raise ValueError(
                    f"target_epsilon={target_epsilon} is so loose that noise_multiplier="
                    f"{floor} already meets it (sampling_rate={sampling_rate}, "
                    f"steps={steps}, delta={delta}); calibration does not search below it: "
                    "set noise_multiplier directly or lower the target"
                )
            low, high = max(low / 2.0, floor), low
            if epsilon_at(low) > target_epsilon:
                break

    sigma = mechanism_calibration.calibrate_dp_mechanism(
        make_fresh_accountant=lambda: make_accountant(accountant),
        make_event_from_param=lambda s: dpsgd_event(sampling_rate, s, int(steps)),
        target_epsilon=target_epsilon,
        target_delta=delta,
        bracket_interval=mechanism_calibration.ExplicitBracketInterval(low, high),
        tol=_RELATIVE_SIGMA_TOL * high,
    )
    return float(sigma)


def rough_epsilon_estimate(
    sampling_rate: float, noise_multiplier: float, steps: int, delta: float
) -> float:
    """``q * sqrt(T * ln(1/delta)) / sigma``: the moments-accountant scaling (Abadi et al. 2016)
    with constants dropped.

    NOT a privacy guarantee; shown only for comparison with the real accountants.
    """
    return sampling_rate * math.sqrt(steps * math.log(1.0 / delta)) / noise_multiplier
