"""The privacy plan of a run: what a pipeline will spend, derived before any training."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from raydp_train.privacy.accounting import (
    calibrate_noise_multiplier,
    epsilon_spent,
    rough_epsilon_estimate,
)
from raydp_train.privacy.sampling import sampling_rate, total_steps


class PlanError(ValueError):
    """The pipeline's privacy settings do not fit its data; the message names the field."""


@dataclass(frozen=True)
class PrivacyPlan:
    num_examples: int
    expected_batch_size: int
    sampling_rate: float
    steps: int
    noise_multiplier: float
    noise_calibrated: bool  # True when derived from privacy.target_epsilon
    clip_norm: float
    delta: float
    accountant: str

    def epsilon(self, steps: int | None = None, accountant: str | None = None) -> float:
        """Epsilon spent after `steps` (default: the whole run); no noise: infinite."""
        if self.noise_multiplier == 0:
            return float("inf")
        return epsilon_spent(
            self.sampling_rate,
            self.noise_multiplier,
            self.steps if steps is None else steps,
            self.delta,
            accountant or self.accountant,
        )

    def rough_epsilon(self) -> float:
        return rough_epsilon_estimate(
            self.sampling_rate, self.noise_multiplier, self.steps, self.delta
        )

    def as_dict(self) -> dict:
        return asdict(self)


def make_plan(pipeline, num_examples: int) -> PrivacyPlan:
    """q = B/N, steps = floor(epochs / q), sigma given or calibrated to the target epsilon."""
    privacy, training = pipeline.privacy, pipeline.training
    if training.batch_size > num_examples:
        raise PlanError(
            f"training.batch_size: must be <= the {num_examples} training examples, "
            f"got {training.batch_size}"
        )
    if privacy.delta >= 1.0 / num_examples:
        raise PlanError(
            f"privacy.delta: must be < 1/N = {1.0 / num_examples:.3g} for N = {num_examples} "
            f"training examples (delta bounds the chance of a total leak), got {privacy.delta}"
        )
    rate = sampling_rate(training.batch_size, num_examples)
    steps = total_steps(training.epochs, training.batch_size, num_examples)
    sigma = privacy.noise_multiplier
    if sigma is None:
        sigma = calibrate_noise_multiplier(
            privacy.target_epsilon, privacy.delta, rate, steps, privacy.accountant
        )
    return PrivacyPlan(
        num_examples=num_examples,
        expected_batch_size=training.batch_size,
        sampling_rate=rate,
        steps=steps,
        noise_multiplier=float(sigma),
        noise_calibrated=privacy.noise_multiplier is None,
        clip_norm=privacy.clip_norm,
        delta=privacy.delta,
        accountant=privacy.accountant,
    )
