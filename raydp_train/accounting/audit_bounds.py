"""Empirical lower bounds on epsilon from a membership test (the math of `raydp-train audit`).

An (epsilon, delta)-DP mechanism bounds every test that guesses "the canary was in" from its
output (Kairouz et al. 2015): with TPR and FPR the test's true and false positive rates,

    TPR     <= e^eps * FPR       + delta
    1 - FPR <= e^eps * (1 - TPR) + delta

so counts of guesses over repeated runs give, through Clopper-Pearson intervals at a chosen
confidence (alpha split between the two rates), a lower bound on the epsilon of the runs:

    eps >= max( log((TPR_low - delta) / FPR_high), log((1 - FPR_high - delta) / (1 - TPR_low)) )

It is a lower bound, never a guarantee: a bound above the claimed epsilon proves a leak (at
the confidence level), a bound below it proves nothing. No Ray, YAML or torch here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

# Bisection halvings: [0, 1] shrinks to 2^-64, below float resolution near any bound we report.
_BISECTIONS = 64


def binomial_tail(successes: int, trials: int, rate: float, upper: bool) -> float:
    """P(X >= successes) if `upper` else P(X <= successes), X ~ Binomial(trials, rate).

    Sums the exact terms C(n, j) rate^j (1 - rate)^(n - j) in log space (lgamma).
    """
    if rate <= 0.0 or rate >= 1.0:
        at_zero = successes <= 0 if upper else True
        at_one = successes <= trials if upper else successes >= trials
        return float(at_one if rate >= 1.0 else at_zero)
    span = slice(max(successes, 0), trials + 1) if upper else slice(min(successes, trials) + 1)
    j = np.arange(trials + 1)[span]
    if j.size == 0:
        return 0.0
    log_terms = (_log_binomial_coefficients(trials)[span]
                 + j * math.log(rate) + (trials - j) * math.log1p(-rate))
    peak = log_terms.max()
    return min(1.0, math.exp(peak) * float(np.exp(log_terms - peak).sum()))


@lru_cache(maxsize=64)
def _log_binomial_coefficients(trials: int) -> np.ndarray:
    """log C(n, j) for j = 0..n."""
    lgamma = np.vectorize(math.lgamma, otypes=[np.float64])
    j = np.arange(trials + 1)
    return lgamma(trials + 1.0) - lgamma(j + 1.0) - lgamma(trials - j + 1.0)


@lru_cache(maxsize=4096)
def clopper_pearson_lower(successes: int, trials: int, alpha: float) -> float:
    """One-sided lower bound p_L at level 1 - alpha: P(X >= k; n, p_L) = alpha (0 if k = 0).

    Equals Beta(alpha; k, n - k + 1)'s quantile. Bisection keeps the side below p_L, so
    rounding only loosens the bound.
    """
    _check_counts(successes, trials, alpha)
    if successes == 0:
        return 0.0
    low, high = 0.0, 1.0  # P(X >= k) grows with p: below alpha at `low`, not below at `high`
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        if binomial_tail(successes, trials, middle, upper=True) < alpha:
            low = middle
        else:
            high = middle
    return low


@lru_cache(maxsize=4096)
def clopper_pearson_upper(successes: int, trials: int, alpha: float) -> float:
    """One-sided upper bound p_U at level 1 - alpha: P(X <= k; n, p_U) = alpha (1 if k = n).

    Equals Beta(1 - alpha; k + 1, n - k)'s quantile; rounding keeps the side above p_U.
    """
    _check_counts(successes, trials, alpha)
    if successes == trials:
        return 1.0
    low, high = 0.0, 1.0  # P(X <= k) falls with p: above alpha at `low`, not above at `high`
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        if binomial_tail(successes, trials, middle, upper=False) > alpha:
            low = middle
        else:
            high = middle
    return high


def epsilon_lower_bound(
    true_positives: int,
    false_positives: int,
    positives: int,
    negatives: int,
    delta: float,
    confidence: float = 0.95,
) -> float:
    """The largest epsilon the counts prove (module docstring), 0.0 when they prove nothing.

    `positives` runs had the canary and the test said "in" on `true_positives` of them;
    `negatives` runs had no canary and it said "in" on `false_positives`. Holds with
    probability >= `confidence` (each rate's one-sided interval at (1 - confidence) / 2).
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta must be in [0, 1), got {delta}")
    alpha = (1.0 - confidence) / 2
    tpr_low = clopper_pearson_lower(true_positives, positives, alpha)
    fpr_high = clopper_pearson_upper(false_positives, negatives, alpha)
    bounds = [0.0]
    if tpr_low - delta > 0.0:  # fpr_high > 0 always: CP never proves a rate is exactly 0
        bounds.append(math.log((tpr_low - delta) / fpr_high))
    if 1.0 - fpr_high - delta > 0.0:  # and tpr_low < 1 always
        bounds.append(math.log((1.0 - fpr_high - delta) / (1.0 - tpr_low)))
    return max(bounds)


def largest_provable_epsilon(
    positives: int, negatives: int, delta: float, confidence: float = 0.95
) -> float:
    """The ceiling of `epsilon_lower_bound` for these run counts: the bound a perfect test
    (every canary run "in", no other run "in") would prove. Fewer runs prove less."""
    return epsilon_lower_bound(positives, 0, positives, negatives, delta, confidence)


@dataclass(frozen=True)
class MembershipTest:
    """A threshold test "score >= threshold: the canary was in" and its held-out counts."""

    threshold: float
    true_positives: int
    false_positives: int
    positives: int
    negatives: int
    epsilon_lower_bound: float
    confidence: float


def membership_test(
    with_canary: Sequence[float],
    without_canary: Sequence[float],
    delta: float,
    confidence: float = 0.95,
) -> MembershipTest:
    """Choose the threshold on the first half of each score list, count on the second half.

    Choosing it on the very counts it is judged by would make the bound optimistic; the
    held-out half keeps the Clopper-Pearson confidence honest (the runs are independent).
    """
    with_canary, without_canary = np.asarray(with_canary), np.asarray(without_canary)
    if min(len(with_canary), len(without_canary)) < 2:
        raise ValueError("need at least 2 runs with and 2 without the canary (one of each to "
                         "choose the threshold, one to count)")
    chosen_in, held_in = np.array_split(with_canary, 2)
    chosen_out, held_out = np.array_split(without_canary, 2)
    threshold = _best_threshold(chosen_in, chosen_out, delta, confidence)
    true_positives = int((held_in >= threshold).sum())
    false_positives = int((held_out >= threshold).sum())
    return MembershipTest(
        threshold=float(threshold),
        true_positives=true_positives,
        false_positives=false_positives,
        positives=len(held_in),
        negatives=len(held_out),
        epsilon_lower_bound=epsilon_lower_bound(
            true_positives, false_positives, len(held_in), len(held_out), delta, confidence),
        confidence=confidence,
    )


def _best_threshold(
    with_canary: np.ndarray, without_canary: np.ndarray, delta: float, confidence: float
) -> float:
    """The score threshold whose bound on these runs is largest (ties: largest TPR - FPR)."""
    positives, negatives = len(with_canary), len(without_canary)
    with_sorted, without_sorted = np.sort(with_canary), np.sort(without_canary)
    best_key, best = None, math.inf
    for threshold in np.unique(np.concatenate([with_canary, without_canary])):
        true_positives = positives - int(np.searchsorted(with_sorted, threshold, "left"))
        false_positives = negatives - int(np.searchsorted(without_sorted, threshold, "left"))
        bound = epsilon_lower_bound(
            true_positives, false_positives, positives, negatives, delta, confidence)
        key = (bound, true_positives / positives - false_positives / negatives)
        if best_key is None or key > best_key:
            best_key, best = key, float(threshold)
    return best


def subsampled_gaussian_score(
    observations: Sequence[float], sampling_rate: float, noise_multiplier: float, signal: float
) -> float:
    """sum_t log(1 - q + q exp((2 s x_t - s^2) / (2 sigma^2))), the log-likelihood ratio.

    It tests "in": x_t ~ (1 - q) N(0, sigma^2) + q N(s, sigma^2), against "out":
    x_t ~ N(0, sigma^2), for independent steps t: the most powerful test (Neyman-Pearson) when
    x_t is one step's noisy sum along the canary's clipped gradient, in units of C.
    """
    if not 0.0 < sampling_rate <= 1.0 or not noise_multiplier > 0.0:
        raise ValueError(f"need 0 < q <= 1 and sigma > 0, got q={sampling_rate}, "
                         f"sigma={noise_multiplier}")
    x = np.asarray(observations, dtype=np.float64)
    shifted = (2.0 * signal * x - signal**2) / (2.0 * noise_multiplier**2)
    stay_out = math.log1p(-sampling_rate) if sampling_rate < 1.0 else -math.inf
    return float(np.logaddexp(stay_out, math.log(sampling_rate) + shifted).sum())


def _check_counts(successes: int, trials: int, alpha: float) -> None:
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1, got {successes} of "
                         f"{trials}")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
