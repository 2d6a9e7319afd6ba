"""run.noise: secure -- AES-CTR noise with Holohan-Braghin sums; and every mode's record label."""

import math

import numpy as np
import pytest
import torch
import yaml

from raydp_train.config.pipeline import PipelineError, pipeline_from_dict
from raydp_train.privacy.noise import (
    NOISE_SOURCES,
    fill_gaussian_noise_,
    make_noise_generator,
)
from raydp_train.privacy.secure_noise import SecureGaussian
from raydp_train.reports.run import noise_description, privacy_statement
from raydp_train.train.context import LocalContext
from raydp_train.train.plan import make_plan
from raydp_train.train.worker import train

DRAWS = 1_000_000
# Five standard errors: a correct sampler fails one of these checks about once in 10^6 runs.
TOLERANCE_SE = 5.0

TINY_RUN = yaml.safe_load("""
name: tiny
data: {source: synthetic, n_samples: 200, n_features: 8, n_informative: 4, n_redundant: 2}
model: {kind: logistic}
privacy: {noise_multiplier: 1.0, clip_norm: 1.0, delta: 1e-5}
training: {epochs: 1, batch_size: 32}
""")


def _secure_draws(std: float, count: int = DRAWS) -> np.ndarray:
    tensor = torch.empty(count, dtype=torch.float64)
    fill_gaussian_noise_(tensor, std, SecureGaussian())
    return tensor.numpy()


def test_mean_and_std_are_those_asked_for():
    noise_multiplier, clip_norm = 1.3, 0.5
    std = noise_multiplier * clip_norm
    draws = _secure_draws(std)
    mean_se, std_se = std / math.sqrt(DRAWS), std / math.sqrt(2 * DRAWS)
    assert abs(draws.mean()) < TOLERANCE_SE * mean_se
    assert abs(draws.std() - std) < TOLERANCE_SE * std_se


def test_each_entry_sums_four_draws_scaled_by_one_half(monkeypatch):
    """Holohan-Braghin with n = 2: (1 / sqrt(4)) * sum of 4 draws; all-ones draws give 2 std."""
    asked = []

    def ones(count: int) -> np.ndarray:
        asked.append(count)
        return np.ones(count)

    generator = SecureGaussian()
    monkeypatch.setattr(generator, "standard_normals", ones)
    assert np.array_equal(generator.gaussians(10, 0.5), np.full(10, 2 * 0.5))
    assert asked == [40]


def test_tails_are_gaussian():
    """P(|X| > 2 std) = 0.0455 for a Gaussian; a wrong Box-Muller or sum scaling moves it."""
    draws = _secure_draws(1.0)
    expected = math.erfc(2 / math.sqrt(2))
    se = math.sqrt(expected * (1 - expected) / DRAWS)
    assert abs(np.mean(np.abs(draws) > 2) - expected) < TOLERANCE_SE * se


def test_neighbouring_entries_are_uncorrelated():
    draws = _secure_draws(1.0)
    # Box-Muller makes its cos and sin normals from one pair: entries half a chunk apart.
    half = len(draws) // 2
    for first, second in ((draws[:-1], draws[1:]), (draws[:half], draws[half:2 * half])):
        correlation = np.corrcoef(first, second)[0, 1]
        assert abs(correlation) < TOLERANCE_SE / math.sqrt(len(first))


def test_consecutive_draws_are_uncorrelated():
    generator = SecureGaussian()
    first, second = (torch.empty(DRAWS, dtype=torch.float64) for _ in range(2))
    fill_gaussian_noise_(first, 1.0, generator)
    fill_gaussian_noise_(second, 1.0, generator)
    correlation = np.corrcoef(first.numpy(), second.numpy())[0, 1]
    assert abs(correlation) < TOLERANCE_SE / math.sqrt(DRAWS)


def test_two_unseeded_generators_draw_different_noise():
    (first, mode), (second, _) = (make_noise_generator("secure", None) for _ in range(2))
    assert mode == "secure"
    draws = [torch.zeros(1000) for _ in range(2)]
    fill_gaussian_noise_(draws[0], 1.0, first)
    fill_gaussian_noise_(draws[1], 1.0, second)
    assert not torch.equal(draws[0], draws[1])


def test_fills_float32_in_place_across_chunks(monkeypatch):
    monkeypatch.setattr("raydp_train.privacy.secure_noise.CHUNK_ENTRIES", 1000)
    tensor = torch.full((25, 100), 7.0)
    storage = tensor.data_ptr()
    fill_gaussian_noise_(tensor, 1.0, SecureGaussian())
    assert tensor.dtype == torch.float32 and tensor.data_ptr() == storage
    assert (tensor != 7.0).all() and tensor.abs().max() < 7.0  # every chunk drawn, none added


def test_secure_noise_with_a_seed_is_refused_naming_the_fields():
    with pytest.raises(PipelineError) as info:
        pipeline_from_dict(TINY_RUN, ["run.noise=secure", "run.seed=3"])
    assert "run.noise: secure noise cannot be seeded: remove run.seed" in str(info.value)


@pytest.mark.parametrize("overrides, mode", [
    ((), "fast"), (("run.noise=secure",), "secure"), (("run.seed=3",), "seeded"),
])
def test_the_record_names_the_noise_a_run_used(overrides, mode):
    pipeline = pipeline_from_dict(TINY_RUN, list(overrides))
    plan = make_plan(pipeline, 160)
    result = train(pipeline, plan, LocalContext(on_epoch=lambda row: None))
    privacy = privacy_statement(plan, result, workers=1)
    assert privacy["noise_mode"] == mode and privacy["noise_source"] == NOISE_SOURCES[mode]
    assert privacy["for_release"] is (mode != "seeded")
    assert noise_description(privacy).startswith(f"{mode}: ")


def test_a_record_before_0_2_0_calls_its_secure_noise_fast():
    assert noise_description({"noise_mode": "secure"}).startswith("fast: torch Mersenne Twister")
    assert noise_description({"noise_mode": "seeded"}).startswith("seeded: ")
