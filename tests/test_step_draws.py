"""Poisson sampling drawn row by row (privacy/step_draws.py): the law of each step's batch
is Poisson sampling's, checked statistically at fixed seeds; no Ray, no torch."""

import numpy as np
import pytest
from scipy import stats

from raydp_train.privacy.step_draws import CHUNK_ROWS, row_steps


def _inclusions(num_rows, steps, q, epochs, seed=0, first_row=0) -> np.ndarray:
    """[epochs * steps, num_rows] 0/1: whether row r joined each (epoch, step)."""
    joined = np.zeros((epochs, steps, num_rows), np.int8)
    for epoch in range(epochs):
        rows, step_ids = row_steps(seed, epoch, first_row, num_rows, steps, q)
        joined[epoch, step_ids, rows] = 1
    return joined.reshape(epochs * steps, num_rows)


def test_each_row_joins_each_step_with_probability_q():
    num_rows, steps, q, epochs = 300, 20, 0.05, 200
    frequency = _inclusions(num_rows, steps, q, epochs).mean(axis=0)
    standard_error = np.sqrt(q * (1 - q) / (steps * epochs))  # 0.0034
    assert abs(frequency.mean() - q) < 4 * standard_error / np.sqrt(num_rows)
    assert np.abs(frequency - q).max() < 5 * standard_error  # 300 rows, none off by 5 se
    # not a function of the row's place: a chi-square over the rows' counts fits
    counts = frequency * steps * epochs
    assert stats.chisquare(counts).pvalue > 1e-3


def test_each_step_joined_with_probability_q():
    """The steps are alike: no step id is favoured by the distinct-steps draw."""
    num_rows, steps, q, epochs = 500, 8, 0.4, 100
    joined = _inclusions(num_rows, steps, q, epochs).reshape(epochs, steps, num_rows)
    per_step = joined.mean(axis=(0, 2))
    standard_error = np.sqrt(q * (1 - q) / (epochs * num_rows))
    assert np.abs(per_step - q).max() < 5 * standard_error


def test_two_rows_join_independently():
    """P(i and j both in a step) = q^2 for rows in one chunk and across a chunk boundary,
    and the same row in two steps of an epoch: q^2 too (Bernoulli per (row, step))."""
    steps, q, epochs = 10, 0.3, 500
    first = CHUNK_ROWS - 2  # rows first .. first+3 straddle a chunk boundary
    joined = _inclusions(4, steps, q, epochs, seed=3, first_row=first)
    trials = steps * epochs
    tolerance = 5 * np.sqrt(q * q * (1 - q * q) / trials)
    for i, j in [(0, 1), (1, 2), (0, 3)]:
        assert abs((joined[:, i] * joined[:, j]).mean() - q * q) < tolerance, (i, j)
    correlation = np.corrcoef(joined.T.astype(np.float64))
    assert np.abs(correlation[~np.eye(4, dtype=bool)]).max() < 5 / np.sqrt(trials)
    by_epoch = joined.reshape(epochs, steps, 4)
    both_steps = (by_epoch[:, 0, :] * by_epoch[:, 1, :]).mean()
    assert abs(both_steps - q * q) < 5 * np.sqrt(q * q / (epochs * 4))


def test_batch_size_is_binomial_n_q():
    num_rows, steps, q, epochs = 1000, 25, 0.04, 120
    sizes = _inclusions(num_rows, steps, q, epochs, seed=5).sum(axis=1)
    # a chi-square of the sizes' histogram against Binomial(N, q), tails pooled
    edges = np.arange(int(stats.binom.ppf(0.005, num_rows, q)),
                      int(stats.binom.ppf(0.995, num_rows, q)) + 1)
    observed = np.array([(sizes < edges[0]).sum(),
                         *[(sizes == k).sum() for k in edges[:-1]], (sizes >= edges[-1]).sum()])
    probabilities = np.array([stats.binom.cdf(edges[0] - 1, num_rows, q),
                              *stats.binom.pmf(edges[:-1], num_rows, q),
                              stats.binom.sf(edges[-1] - 1, num_rows, q)])
    expected = probabilities * sizes.size
    assert observed.sum() == sizes.size
    assert stats.chisquare(observed, expected * observed.sum() / expected.sum()).pvalue > 1e-3
    assert abs(sizes.var() - num_rows * q * (1 - q)) < 0.2 * num_rows * q


def test_a_rows_steps_are_distinct_and_in_range():
    rows, step_ids = row_steps(1, 0, 0, 4000, 3, 0.9)  # most rows join 2-3 of 3 steps
    pairs = rows * 3 + step_ids
    assert np.unique(pairs).size == pairs.size
    assert step_ids.min() >= 0 and step_ids.max() < 3
    assert np.all(np.diff(pairs) > 0)  # sorted by (row, step)
    counts = np.bincount(rows, minlength=4000)
    # a row's count is Binomial(3, 0.9)
    expected = stats.binom.pmf(np.arange(4), 3, 0.9) * 4000
    assert stats.chisquare(np.bincount(counts, minlength=4), expected).pvalue > 1e-3


def test_draws_depend_on_seed_epoch_and_row_not_on_how_rows_are_cut():
    whole = row_steps(7, 2, 100, 3000, 40, 0.03)
    parts = [row_steps(7, 2, 100 + a, b - a, 40, 0.03) for a, b in
             [(0, 5), (5, 1500), (1500, 1501), (1501, 3000)]]
    rows = np.concatenate([r + a for (r, _), a in zip(parts, [0, 5, 1500, 1501])])
    assert np.array_equal(rows, whole[0])
    assert np.array_equal(np.concatenate([s for _, s in parts]), whole[1])
    assert np.array_equal(row_steps(7, 2, 100, 3000, 40, 0.03)[1], whole[1])  # again: same
    assert not np.array_equal(row_steps(7, 3, 100, 3000, 40, 0.03)[0], whole[0])  # epoch
    assert not np.array_equal(row_steps(8, 2, 100, 3000, 40, 0.03)[0], whole[0])  # seed


def test_no_steps_no_rows_and_bad_rates_refused():
    assert row_steps(0, 0, 0, 100, 0, 0.5)[0].size == 0
    assert row_steps(0, 0, 50, 0, 10, 0.5)[0].size == 0
    with pytest.raises(ValueError, match="sampling rate"):
        row_steps(0, 0, 0, 10, 10, 0.0)
