"""What a budget is asked (ARCHITECTURE.md §2.6): its fixed terms, one reservation's `Spend`
(steps of a mechanism, noisy releases, or a whole random-stopping sweep) as a dp-accounting
event, and the error of a request that cannot be served."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from raydp_train.accounting.epsilon import gaussian_release_event, repeat_and_select_event
from raydp_train.errors import UserError
from raydp_train.privacy.mechanism import MECHANISMS, mechanism_named

if TYPE_CHECKING:
    import dp_accounting


class BudgetError(UserError, RuntimeError):
    """A budget request that cannot be served (bad terms, bad request, unusable ledger)."""


@dataclass(frozen=True)
class BudgetTerms:
    """Fixed when the budget is first opened; every later user must ask for the same."""

    name: str
    epsilon: float
    delta: float
    accountant: str = "rdp"
    # What the budget's epsilon protects: one example, or one user (privacy.unit). A budget
    # keeps one unit: a per-user guarantee and a per-example one do not compose.
    unit: str = "example"


@dataclass(frozen=True)
class Spend:
    """What one reservation counts: the mechanism's steps (q, sigma), noisy metric releases of
    sensitivity 1, and for a random-stopping sweep (mean_trials > 0) the whole
    repeat-and-select event of such trials."""

    sampling_rate: float
    noise_multiplier: float
    steps: int
    release_noise_multiplier: float = 0.0
    releases: int = 0
    mechanism: str = "dpsgd"  # a registered private mechanism (privacy/mechanism.py)
    mean_trials: float = 0.0  # random stopping only
    shape: float = 0.0

    @property
    def random_stopping(self) -> bool:
        return self.mean_trials > 0

    def dp_event(self) -> dp_accounting.DpEvent:
        import dp_accounting  # here: a Ray worker that only carries a Spend skips scipy

        parts = []
        if self.steps:
            parts.append(mechanism_named(self.mechanism).dp_event(
                self.sampling_rate, self.noise_multiplier, self.steps))
        if self.releases:
            parts.append(gaussian_release_event(self.release_noise_multiplier, self.releases))
        event = parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts)
        if self.random_stopping:
            event = repeat_and_select_event(event, self.mean_trials, self.shape)
        return event

    def check(self) -> None:
        problems = []
        if not 0 < self.sampling_rate <= 1:
            problems.append(f"sampling_rate must be in (0, 1], got {self.sampling_rate}")
        if not self.noise_multiplier > 0:
            problems.append(f"noise_multiplier must be > 0, got {self.noise_multiplier}")
        if self.steps < 0 or self.releases < 0 or self.steps + self.releases == 0:
            problems.append(f"asks for nothing: steps={self.steps}, releases={self.releases}")
        if self.releases and not self.release_noise_multiplier > 0:
            problems.append("releases need release_noise_multiplier > 0")
        private = sorted(name for name, cls in MECHANISMS.items() if cls.private)
        if self.mechanism not in private:
            problems.append(f"mechanism must be one of {', '.join(private)}, got "
                            f"{self.mechanism}")
        if problems:
            raise BudgetError("invalid reservation: " + "; ".join(problems))

    def describe(self) -> str:
        text = f"{self.steps} steps at q={self.sampling_rate:.4g}, sigma={self.noise_multiplier:.4g}"
        if self.releases:
            text += f" + {self.releases} releases at sigma={self.release_noise_multiplier:.4g}"
        if self.random_stopping:
            text = (f"a random-stopping sweep (mean {self.mean_trials:g} trials, shape "
                    f"{self.shape:g}) of {text} each")
        return text
