"""Random stopping for hyperparameter search (Papernot & Steinke 2022, "Hyperparameter Tuning
with Renyi Differential Privacy").

Run a random number K of independent trials, each with randomly drawn hyperparameters, and keep
the best: the whole search then costs little more than one trial, provided K is drawn from

- shape = inf: Poisson(mean);
- shape = 0:   logarithmic, P[K=k] = (1-g)^k / (k ln(1/g)), k >= 1;
- shape > 0:   truncated negative binomial, P[K=k] ∝ C(k+shape-1, k) (1-g)^k, k >= 1
               (shape = 1 is the geometric distribution, mean 1/g);

with g chosen so that E[K] = mean. The cost itself is dp-accounting's RepeatAndSelectDpEvent.
"""

from __future__ import annotations

import math

import numpy as np


def trial_count_mean(gamma: float, shape: float) -> float:
    """E[K] of the truncated negative binomial (or logarithmic) distribution for this gamma."""
    if shape == 0:
        return (1 - gamma) / (gamma * math.log(1 / gamma))
    return shape * (1 - gamma) / (gamma * (1 - gamma**shape))


def gamma_for_mean(mean_trials: float, shape: float) -> float:
    """The g in (0, 1] with E[K] = mean_trials, by bisection (E[K] falls as g grows)."""
    if mean_trials <= 1:
        return 1.0
    low, high = 1e-300, 1.0 - 1e-15
    for _ in range(200):
        middle = math.sqrt(low * high) if high / low > 4 else (low + high) / 2
        if trial_count_mean(middle, shape) > mean_trials:
            low = middle
        else:
            high = middle
        if high - low <= 1e-15 * high:
            break
    return high


def draw_trial_count(mean_trials: float, shape: float, rng: np.random.Generator) -> int:
    """Draw the number of trials K; `rng` must be secure unless the run is only a rehearsal."""
    if math.isinf(shape):
        return int(rng.poisson(mean_trials))
    gamma = gamma_for_mean(mean_trials, shape)
    if gamma >= 1.0:
        return 1
    if shape == 0:
        return int(rng.logseries(1.0 - gamma))
    while True:  # a negative binomial conditioned on K >= 1
        count = int(rng.negative_binomial(shape, gamma))
        if count >= 1:
            return count
