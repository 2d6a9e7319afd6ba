"""One Gaussian draw per step, from a generator seeded from os.urandom (fast) or explicitly."""

import pytest
import torch

from raydp_train.privacy.noise import fill_gaussian_noise_, make_generator, noise_std


def _noised(n, std, generator, dtype=torch.float32):
    tensor = torch.full(n if isinstance(n, tuple) else (n,), 7.0, dtype=dtype)
    fill_gaussian_noise_(tensor, std, generator)
    return tensor


def test_seeded_generators_reproduce():
    (gen_a, mode_a), (gen_b, _) = make_generator(123), make_generator(123)
    assert mode_a == "seeded"
    assert torch.equal(_noised(100, 1.0, gen_a), _noised(100, 1.0, gen_b))


def test_unseeded_generators_differ():
    (gen_a, mode_a), (gen_b, mode_b) = make_generator(None), make_generator(None)
    assert mode_a == mode_b == "fast"
    assert not torch.equal(_noised(100, 1.0, gen_a), _noised(100, 1.0, gen_b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mean_and_std(dtype):
    std = 2.5
    noise = _noised(1_000_000, std, make_generator(0)[0], dtype).double()
    # std error of the mean: 2.5e-3; of the std: 2.5 / sqrt(2e6) = 1.8e-3
    assert abs(noise.mean().item()) < 0.01 * std
    assert abs(noise.std().item() - std) < 0.01 * std


def test_fills_in_place_and_keeps_dtype():
    tensor = torch.full((3, 4), 5.0, dtype=torch.float64)
    storage = tensor.data_ptr()
    fill_gaussian_noise_(tensor, 0.1, make_generator(1)[0])
    assert tensor.dtype == torch.float64 and tensor.shape == (3, 4)
    assert tensor.data_ptr() == storage
    assert tensor.abs().max().item() < 1.0  # the old values are gone, not added to


def test_zero_std_gives_zeros():
    tensor = torch.randn(10)
    fill_gaussian_noise_(tensor, 0.0, make_generator(2)[0])
    assert torch.equal(tensor, torch.zeros(10))


def test_negative_std_raises():
    with pytest.raises(ValueError, match="std"):
        fill_gaussian_noise_(torch.zeros(3), -1.0, make_generator(3)[0])


def test_one_draw_over_the_whole_tensor():
    noise = _noised((1000, 100), 1.0, make_generator(4)[0], torch.float64)
    assert noise.unique().numel() == noise.numel()  # entries are not copies of one value
    corr = torch.corrcoef(noise.T)  # columns are uncorrelated: std error 1/sqrt(1000)
    assert corr[~torch.eye(100, dtype=torch.bool)].abs().max().item() < 0.2


def test_noise_std_is_sigma_times_clip():
    assert noise_std(1.5, 0.4) == pytest.approx(0.6)


def test_large_draw_split_over_threads_is_one_independent_gaussian(monkeypatch):
    """A draw above PARALLEL_DRAW_MIN_ENTRIES is filled in chunks by several generators: the
    chunks must not repeat or correlate, and the whole must be N(0, std^2) and reproducible."""
    from raydp_train.privacy import noise

    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # 4 chunks on any machine
    size, std = 4 * noise.PARALLEL_DRAW_MIN_ENTRIES, 1.5
    drawn = _noised(size, std, make_generator(5)[0]).double()
    assert torch.equal(drawn.float(), _noised(size, std, make_generator(5)[0]))  # reproducible
    chunks = drawn.view(4, -1)
    assert chunks.unique(dim=0).shape[0] == 4
    correlation = torch.corrcoef(chunks)  # std error 1/sqrt(2^17) = 2.8e-3
    assert correlation[~torch.eye(4, dtype=torch.bool)].abs().max().item() < 0.015
    for chunk in chunks:  # each chunk: std error of the mean 4.1e-3, of the std 2.9e-3
        assert abs(chunk.mean().item()) < 0.025 and abs(chunk.std().item() - std) < 0.025
