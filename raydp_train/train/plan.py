"""The plan of a run: what a pipeline will spend, derived before any training, the mechanism
that spends it and the task it trains for, each resolved once from its name: the driver, the
budget and the workers receive this frozen object, never a name to look up again."""

from __future__ import annotations

from dataclasses import dataclass

from raydp_train.accounting.epsilon import (
    PLD_MIN_NOISE_MULTIPLIER,
    calibrate_noise_multiplier,
    composed_epsilon,
    rough_epsilon_estimate,
)
from raydp_train.budget.terms import Spend
from raydp_train.errors import UserError
from raydp_train.privacy.adaptive_clipping import count_noise_problem
from raydp_train.privacy.mechanism import DpSgd, Mechanism, mechanism_named
from raydp_train.privacy.sampling import sampling_rate, total_steps
from raydp_train.train.tasks import Task, task_of


class PlanError(UserError, ValueError):
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
    epochs: int = 1
    mechanism: type[Mechanism] = DpSgd  # the registered class (privacy/mechanism.py)
    # Noise on each released count of correct validation predictions (sensitivity 1), one
    # release per epoch; 0 when nothing private is released besides the model.
    release_noise_multiplier: float = 0.0
    # What the workers train for (train/tasks.py); None in a user's own loop, which brings
    # its own loss and metrics (train/own_loop.py).
    task: Task | None = None
    # What N, q and the guarantee count (privacy.unit): examples, or users (§2.14), each user
    # bringing at most rows_per_user rows to a step.
    unit: str = "example"
    rows_per_user: int | None = None
    user_contribution: str = "sum"  # a user's rows' gradients summed or averaged, then clipped

    def __post_init__(self) -> None:
        if not (isinstance(self.mechanism, type) and issubclass(self.mechanism, Mechanism)):
            raise TypeError("PrivacyPlan.mechanism: a registered Mechanism class "
                            f"(mechanism_named(name)), got {self.mechanism!r}")

    @property
    def private(self) -> bool:
        return self.mechanism.private

    @property
    def releases_per_epoch(self) -> int:
        return 1 if self.release_noise_multiplier > 0 else 0

    def epsilon(
        self, steps: int | None = None, accountant: str | None = None, releases: int | None = None
    ) -> float:
        """Epsilon spent after `steps` and `releases` (default: the whole run); not private: inf."""
        if not self.private:
            return float("inf")
        steps = self.steps if steps is None else steps
        releases = self.epochs * self.releases_per_epoch if releases is None else releases
        if not steps and not releases:
            return 0.0
        event = self.spend(steps, releases).dp_event()
        return composed_epsilon([event], self.delta, accountant or self.accountant)

    def reported_epsilon(self, steps: int, accountant: str, releases: int) -> float | None:
        """As `epsilon`, or None for the pld accountant below its smallest noise multiplier
        (the run's own accountant, checked before training, always reports)."""
        noises = [self.noise_multiplier, *([self.release_noise_multiplier] if releases else [])]
        if accountant == "pld" and self.private and min(noises) < PLD_MIN_NOISE_MULTIPLIER:
            return None
        return self.epsilon(steps, accountant, releases)

    def spend(self, steps: int, releases: int) -> Spend:
        """A budget reservation for `steps` training steps and `releases` metric releases."""
        return Spend(self.sampling_rate, self.noise_multiplier, steps,
                     self.release_noise_multiplier if releases else 0.0, releases,
                     mechanism=self.mechanism.name)

    def rough_epsilon(self) -> float:
        if not self.private:
            return float("inf")
        return rough_epsilon_estimate(
            self.sampling_rate, self.noise_multiplier, self.steps, self.delta
        )


def make_plan(pipeline, num_examples: int) -> PrivacyPlan:
    """q = B/N, steps = floor(epochs / q), sigma given or calibrated to the target epsilon."""
    privacy, training = pipeline.privacy, pipeline.training
    unit = getattr(privacy, "unit", "example")  # N counts users with unit user
    if training.batch_size > num_examples:
        raise PlanError(
            f"training.batch_size: must be <= the {num_examples} training {unit}s, "
            f"got {training.batch_size}"
        )
    if privacy.delta >= 1.0 / num_examples:
        raise PlanError(
            f"privacy.delta: must be < 1/N = {1.0 / num_examples:.3g} for N = {num_examples} "
            f"training {unit}s (delta bounds the chance of a total leak), got {privacy.delta}"
        )
    rate = sampling_rate(training.batch_size, num_examples)
    steps = total_steps(training.epochs, training.batch_size, num_examples)
    validation = pipeline.data.validation
    release_sigma = 0.0
    if validation is not None and validation.private and validation.noise_multiplier:
        release_sigma = validation.noise_multiplier
    sigma = privacy.noise_multiplier
    if sigma is None and release_sigma:
        raise PlanError(
            "privacy.target_epsilon: calibration covers the training steps only; with noisy "
            "validation releases (data.validation.noise_multiplier) set privacy.noise_multiplier"
        )
    mechanism = mechanism_named(privacy.mechanism)
    private = mechanism.private
    if not private:
        sigma = 0.0  # the non-private reference: epsilon is infinite
    elif sigma is None:
        try:
            sigma = calibrate_noise_multiplier(
                privacy.target_epsilon, privacy.delta, rate, steps, privacy.accountant
            )
        except ValueError as error:  # a target no noise multiplier in range can meet
            raise PlanError(f"privacy.target_epsilon: {error}") from None
    if private and privacy.clipping == "adaptive":  # the count's noise, split from sigma's
        problem = count_noise_problem(sigma, privacy.adaptive.count_noise, training.batch_size)
        if problem:
            raise PlanError(f"privacy.adaptive.{problem}")
    return PrivacyPlan(
        num_examples=num_examples,
        expected_batch_size=training.batch_size,
        sampling_rate=rate,
        steps=steps,
        noise_multiplier=float(sigma),
        noise_calibrated=privacy.noise_multiplier is None and private,
        clip_norm=privacy.clip_norm,
        delta=privacy.delta,
        accountant=privacy.accountant,
        epochs=training.epochs,
        mechanism=mechanism,
        release_noise_multiplier=release_sigma,
        task=task_of(pipeline),
        unit=unit,
        rows_per_user=getattr(privacy, "rows_per_user", None),
        user_contribution=getattr(privacy, "user_contribution", "sum"),
    )

