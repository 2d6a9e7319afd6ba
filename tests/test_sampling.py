"""Poisson sampling, step counts and micro-batches."""

import pytest
import torch

from raydp_train.privacy.sampling import micro_batches, poisson_sample, sampling_rate, total_steps


def test_sampling_rate_is_b_over_n():
    assert sampling_rate(64, 800) == 0.08
    assert sampling_rate(800, 800) == 1.0


@pytest.mark.parametrize(("batch", "n"), [(801, 800), (0, 800), (-1, 800)])
def test_sampling_rate_rejects_bad_batch(batch, n):
    with pytest.raises(ValueError, match="training.batch_size"):
        sampling_rate(batch, n)


def test_total_steps_is_exact():
    assert total_steps(30, 64, 800) == 375
    # float division gives 9 / (9 / 14) = 13.999999999999998 -> floor 13, but 9 * 14 // 9 = 14
    assert int(9 / (9 / 14)) == 13
    assert total_steps(9, 9, 14) == 14
    assert total_steps(7, 7, 25) == 25
    assert total_steps(1, 3, 10) == 3


def _draw_sizes(n, q, draws, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.tensor([len(poisson_sample(n, q, gen)) for _ in range(draws)], dtype=torch.float64)


def test_sample_size_mean_and_variance():
    n, q, draws = 1000, 0.1, 4000
    sizes = _draw_sizes(n, q, draws)
    mean, var = n * q, n * q * (1 - q)
    # standard error of the mean is sqrt(90/4000) = 0.15; of the variance ~ 90*sqrt(2/4000) = 2
    assert abs(sizes.mean().item() - mean) < 1.0
    assert abs(sizes.var().item() - var) < 12.0


def test_inclusion_frequency_per_example():
    n, q, draws = 50, 0.2, 5000
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(n)
    for _ in range(draws):
        idx = poisson_sample(n, q, gen)
        counts[idx] += 1
    freq = counts / draws
    # per-example std error sqrt(0.16/5000) = 0.0057: 0.035 is over 6 standard errors
    assert (freq - q).abs().max().item() < 0.035
    # no dependence on position: first half and second half include alike
    assert abs(freq[: n // 2].mean().item() - freq[n // 2 :].mean().item()) < 0.02


def test_sample_is_sorted_unique_int64():
    idx = poisson_sample(1000, 0.3, torch.Generator().manual_seed(2))
    assert idx.dtype == torch.int64
    assert torch.equal(idx, torch.unique(idx))  # unique() sorts
    assert idx.min() >= 0 and idx.max() < 1000


def test_inclusions_are_independent():
    n, q, draws = 20, 0.5, 4000
    gen = torch.Generator().manual_seed(3)
    masks = torch.zeros(draws, n)
    for d in range(draws):
        masks[d, poisson_sample(n, q, gen)] = 1.0
    corr = torch.corrcoef(masks.T)
    off_diagonal = corr[~torch.eye(n, dtype=torch.bool)]
    # std error of a correlation is 1/sqrt(4000) = 0.016
    assert off_diagonal.abs().max().item() < 0.1


def test_seeded_sample_reproduces():
    a = poisson_sample(500, 0.1, torch.Generator().manual_seed(7))
    b = poisson_sample(500, 0.1, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_small_rate_gives_empty_samples():
    sizes = _draw_sizes(10, 0.05, 200, seed=4)  # P(empty) = 0.95**10 = 0.6
    assert (sizes == 0).any() and (sizes > 0).any()
    empty = poisson_sample(10, 1e-9, torch.Generator().manual_seed(5))
    assert empty.numel() == 0 and empty.dtype == torch.int64
    assert micro_batches(empty, 4) == []


def test_micro_batch_chunks():
    idx = torch.arange(10)
    chunks = micro_batches(idx, 4)
    assert [len(c) for c in chunks] == [4, 4, 2]
    assert torch.equal(torch.cat(chunks), idx)
    assert [len(c) for c in micro_batches(idx, 10)] == [10]
    assert [len(c) for c in micro_batches(idx, 64)] == [10]
    with pytest.raises(ValueError, match="max_physical_batch"):
        micro_batches(idx, 0)
