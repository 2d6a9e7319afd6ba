"""The privacy audit: Clopper-Pearson and the epsilon lower bound (math, milliseconds), then
canary runs on the real DP-SGD engine (in-process, no Ray) and `raydp-train audit`."""

import json
import math
from pathlib import Path

import pytest
from doc_blocks import marked_block, output_labels

from raydp_train.accounting.audit_bounds import (
    binomial_tail,
    clopper_pearson_lower,
    clopper_pearson_upper,
    epsilon_lower_bound,
    membership_test,
    subsampled_gaussian_score,
)
from raydp_train.accounting.epsilon import epsilon_spent
from raydp_train.checks.preflight import check_pipeline
from raydp_train.commands.audit import audit_pipeline
from raydp_train.commands.cli import main
from raydp_train.config.pipeline import pipeline_from_dict

QUICKSTART = str(Path(__file__).parents[1] / "pipelines" / "quickstart.yaml")
CASES = [(k, n, alpha) for n in (1, 2, 7, 50, 200) for k in sorted({0, 1, n // 3, n - 1, n})
         for alpha in (0.025, 0.05, 0.3)]


# ------------------------------------------------------------------ Clopper-Pearson


@pytest.mark.parametrize("successes,trials,alpha", CASES)
def test_clopper_pearson_matches_the_beta_quantiles(successes, trials, alpha):
    stats = pytest.importorskip("scipy.stats")
    lower = stats.beta.ppf(alpha, successes, trials - successes + 1) if successes else 0.0
    upper = stats.beta.ppf(1 - alpha, successes + 1, trials - successes) \
        if successes < trials else 1.0
    assert clopper_pearson_lower(successes, trials, alpha) == pytest.approx(lower, abs=1e-12)
    assert clopper_pearson_upper(successes, trials, alpha) == pytest.approx(upper, abs=1e-12)


@pytest.mark.parametrize("successes,trials,alpha", CASES)
def test_clopper_pearson_bounds_solve_the_binomial_tails(successes, trials, alpha):
    """Brute force: at p_L, P(X >= k) = alpha; at p_U, P(X <= k) = alpha (scipy-free)."""
    def tail(k, p, upper):  # the plain sum of C(n, j) p^j (1 - p)^(n - j)
        span = range(k, trials + 1) if upper else range(k + 1)
        return sum(math.comb(trials, j) * p**j * (1 - p) ** (trials - j) for j in span)

    lower = clopper_pearson_lower(successes, trials, alpha)
    upper = clopper_pearson_upper(successes, trials, alpha)
    if successes > 0:
        assert tail(successes, lower, upper=True) == pytest.approx(alpha, rel=1e-9)
    if successes < trials:
        assert tail(successes, upper, upper=False) == pytest.approx(alpha, rel=1e-9)
    assert binomial_tail(successes, trials, 0.3, upper=True) == pytest.approx(
        tail(successes, 0.3, upper=True), rel=1e-12, abs=1e-300)


def test_clopper_pearson_closed_forms_at_the_extremes():
    n, alpha = 100, 0.025
    assert clopper_pearson_lower(n, n, alpha) == pytest.approx(alpha ** (1 / n), abs=1e-14)
    assert clopper_pearson_upper(0, n, alpha) == pytest.approx(1 - alpha ** (1 / n), abs=1e-14)
    with pytest.raises(ValueError, match="successes <= trials"):
        clopper_pearson_lower(5, 4, alpha)


# ------------------------------------------------------------------ the epsilon lower bound


def test_perfect_separation_is_limited_by_the_number_of_runs():
    """100/100 true and 0/100 false positives: TPR_low = a^(1/n), FPR_high = 1 - a^(1/n)."""
    a, delta = 0.025, 1e-5  # 95% confidence split over the two rates
    expected = math.log((a ** (1 / 100) - delta) / (1 - a ** (1 / 100)))
    assert epsilon_lower_bound(100, 0, 100, 100, delta) == pytest.approx(expected, rel=1e-10)
    assert expected == pytest.approx(3.28, abs=0.01)  # ~log(n / ln(1/a)): never "infinite"
    assert epsilon_lower_bound(1000, 0, 1000, 1000, delta) > expected


def test_the_ceiling_is_the_perfect_test_and_grows_with_the_runs():
    from raydp_train.accounting.audit_bounds import largest_provable_epsilon

    a, delta = 0.025, 1e-5
    expected = math.log((a ** (1 / 10) - delta) / (1 - a ** (1 / 10)))  # 10 + 10 held-out runs
    assert largest_provable_epsilon(10, 10, delta) == pytest.approx(expected, rel=1e-10)
    assert largest_provable_epsilon(10, 10, delta) < largest_provable_epsilon(100, 100, delta)
    for true_positives, false_positives in [(10, 0), (7, 1), (3, 3)]:
        bound = epsilon_lower_bound(true_positives, false_positives, 10, 10, delta)
        assert bound <= largest_provable_epsilon(10, 10, delta)


def test_zero_false_positives_with_few_true_ones():
    stats = pytest.importorskip("scipy.stats")
    tpr_low = stats.beta.ppf(0.025, 10, 91)
    fpr_high = stats.beta.ppf(0.975, 1, 100)
    expected = max(math.log((tpr_low - 1e-5) / fpr_high), 0.0)
    assert epsilon_lower_bound(10, 0, 100, 100, 1e-5) == pytest.approx(expected, rel=1e-9)


def test_the_second_inequality_counts_false_negatives():
    """All canary runs flagged, half the others too: 1 - FPR <= e^eps (1 - TPR) + delta."""
    stats = pytest.importorskip("scipy.stats")
    tpr_low, fpr_high = stats.beta.ppf(0.025, 100, 1), stats.beta.ppf(0.975, 51, 50)
    expected = math.log((1 - fpr_high - 1e-5) / (1 - tpr_low))
    assert epsilon_lower_bound(100, 50, 100, 100, 1e-5) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("true_positives,false_positives", [(50, 50), (0, 100), (0, 0), (100, 100)])
def test_guessing_proves_nothing(true_positives, false_positives):
    assert epsilon_lower_bound(true_positives, false_positives, 100, 100, 1e-5) == 0.0


def test_a_large_delta_absorbs_the_evidence():
    assert epsilon_lower_bound(12, 0, 100, 100, 1e-5) > 0.0
    assert epsilon_lower_bound(12, 0, 100, 100, 0.2) == 0.0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="confidence"):
        epsilon_lower_bound(1, 0, 10, 10, 1e-5, confidence=1.0)
    with pytest.raises(ValueError, match="delta"):
        epsilon_lower_bound(1, 0, 10, 10, -1e-5)
    with pytest.raises(ValueError, match="at least 2 runs"):
        membership_test([1.0], [0.0, 0.0], 1e-5)


def test_the_threshold_is_chosen_on_one_half_and_counted_on_the_other():
    with_canary = [2.0, 3.0, 4.0, 5.0] + [1.5, 2.5, 3.5, 4.5]
    without_canary = [0.0, 1.0, -1.0, -2.0] + [0.5, 2.0, -0.5, -1.5]
    test = membership_test(with_canary, without_canary, 1e-5)
    assert test.threshold == 2.0  # the best cut of the first halves, blind to the second
    assert (test.true_positives, test.false_positives, test.positives, test.negatives) == (
        3, 1, 4, 4)
    assert test.epsilon_lower_bound == epsilon_lower_bound(3, 1, 4, 4, 1e-5)


def test_the_score_is_the_gaussian_log_likelihood_ratio():
    observations = [0.3, -1.2, 2.0]
    gaussian = sum((2 * x - 1) / (2 * 1.5**2) for x in observations)  # q = 1, signal 1
    assert subsampled_gaussian_score(observations, 1.0, 1.5, 1.0) == pytest.approx(gaussian)
    never = 3 * math.log(1 - 0.1 + 0.1 * math.exp(-1 / 2))  # x_t = 0: the canary never seen
    assert subsampled_gaussian_score([0.0] * 3, 0.1, 1.0, 1.0) == pytest.approx(never)


# ------------------------------------------------------------------ canary runs (real engine)


def small_pipeline(noise_multiplier: float, kind: str = "logistic"):
    """200 training examples, q = 0.2, 20 steps; at sigma 4: epsilon ~1.0 (RDP, delta 1e-5)."""
    return pipeline_from_dict({
        "name": "audit-test",
        "data": {"source": "synthetic", "n_samples": 250, "random_state": 0},
        "model": {"kind": kind, "hidden_sizes": [16]} if kind == "mlp" else {"kind": kind},
        "privacy": {"clip_norm": 1.0, "noise_multiplier": noise_multiplier, "delta": 1e-5},
        "training": {"epochs": 4, "batch_size": 40, "lr": 0.1, "workers": 1},
    })


def run_audit(pipeline, trials=100, seed=0):
    dataset, plan = check_pipeline(pipeline)
    return audit_pipeline(pipeline, dataset, plan, trials, seed=seed)


@pytest.mark.thorough
@pytest.mark.parametrize("noise_multiplier,kind", [(4.0, "logistic"), (0.5, "mlp")])
def test_the_lower_bound_stays_below_the_claimed_epsilon(noise_multiplier, kind):
    result = run_audit(small_pipeline(noise_multiplier, kind))
    assert result.claimed_epsilon == epsilon_spent(0.2, noise_multiplier, 20, 1e-5, "rdp")
    assert result.steps == 20 and result.test.positives == result.test.negatives == 50
    assert result.epsilon_lower_bound <= result.claimed_epsilon
    assert result.consistent
    if noise_multiplier < 1:  # little noise: the audit sees the canary, within the claim
        assert result.epsilon_lower_bound > 0.3


def test_with_the_noise_disabled_the_audit_detects_the_leak(monkeypatch):
    """A broken engine that adds no noise: the canary's steps show exactly, far above epsilon ~1."""
    monkeypatch.setattr("raydp_train.train.step.fill_gaussian_noise_",
                        lambda tensor, std, generator: tensor.zero_())
    result = run_audit(small_pipeline(4.0))
    assert result.claimed_epsilon == pytest.approx(1.0, abs=0.01)
    assert result.test.false_positives == 0
    assert result.epsilon_lower_bound > 2.4 > 2 * result.claimed_epsilon
    assert not result.consistent


def test_audits_with_one_seed_repeat_exactly():
    first = run_audit(small_pipeline(1.0), trials=6)
    second = run_audit(small_pipeline(1.0), trials=6)
    assert first.test == second.test and first.seed == second.seed == 0


# ------------------------------------------------------------------ the command line


def test_audit_command_prints_the_claim_and_the_lower_bound(capsys):
    args = ["audit", QUICKSTART, "--set", "training.epochs=1", "--trials", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    claimed = epsilon_spent(0.08, 2.0, 12, 1e-5, "rdp")
    assert f"claimed epsilon         {claimed:.4f} (RDP, these 12 steps)" in out
    assert "empirical lower bound   " in out and "consistent              yes" in out
    assert "largest it could show   " in out and "with 4 + 4 held-out runs" in out
    assert "nothing spent" in out and "audit: 8/8 pairs of runs" in out
    # The output docs/concepts/audit.md shows: each of its lines, as this audit prints it.
    for label in output_labels(marked_block("docs/concepts/audit.md", "output")):
        assert f"\n{label}  " in out, label


def test_audit_command_json(capsys):
    assert main(["audit", QUICKSTART, "--set", "training.epochs=1", "--set", "run.seed=3",
                 "--trials", "4", "--json"]) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out)
    assert record["seed"] == 3 and record["budget_spent"] is False
    assert record["epsilon_lower_bound"] <= record["epsilon_ceiling"]
    assert record["epsilon_lower_bound"] <= record["claimed_epsilon"]
    assert "audit: 4/4" in captured.err  # progress stays out of the JSON


@pytest.mark.parametrize("overrides,trials,message", [
    (["privacy.mechanism=none", "privacy.noise_multiplier=null"], "8", "privacy.mechanism"),
    (["privacy.mechanism=lsg"], "8", "privacy.mechanism"),
    (["model.kind=cnn"], "8", "supports logistic and mlp"),
    ([], "3", "--trials"),
])
def test_audit_command_refuses_what_it_cannot_audit(capsys, overrides, trials, message):
    args = ["audit", QUICKSTART, "--trials", trials]
    for override in overrides:
        args += ["--set", override]
    assert main(args) == 2
    assert message in capsys.readouterr().err
