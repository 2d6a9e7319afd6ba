"""Why a run or a sweep's trial stopped: one enum, compared by identity, never by the text.

A stop reason shown to the user is "<value>: <details>" (e.g. "budget exhausted: ..."); the
enum member travels beside that text (TrainResult.stop, RunResult.stop, a trial's "stop").
"""

from __future__ import annotations

from enum import Enum


class StopReason(str, Enum):
    COMPLETED = "completed"
    BUDGET_EXHAUSTED = "budget exhausted"  # the global budget refused the next epoch
    TARGET_EPSILON_REACHED = "target epsilon reached"  # one more epoch would pass the target
    RESERVATION_USED_UP = "reservation used up"  # a random-stopping trial's share is spent
    INTERRUPTED = "interrupted"  # Ctrl-C (or a stop asked for on the driver)
    # A sweep's trials only:
    RUNNING = "running"  # reported after each epoch; still there if the scheduler ended it
    STOPPED_BY_SCHEDULER = "stopped by scheduler"
    FAILED = "failed"
    NOT_STARTED = "not started"

    def because(self, details: str) -> str:
        """The text shown: "<value>: <details>" (once, where the details already say it)."""
        shown = f"{self.value}: "
        return details if details.startswith(shown) else f"{shown}{details}"


# Refusals of the next charge: a sweep shows them without their long reasons.
REFUSALS = (StopReason.BUDGET_EXHAUSTED, StopReason.RESERVATION_USED_UP)
