"""Faults the tests inject into a real run, through `fit(after_step=...)`: test-only code,
pickled by value to the Ray Train workers (the tests folder is not on their path)."""

import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FailOnce:
    """The last rank raises after step `step`, once per run: a marker in the run directory
    says it already did, so the restarted attempt runs through."""

    step: int

    def __call__(self, context, step: int) -> None:
        if step != self.step or context.rank != context.world_size - 1:
            return
        marker = Path(context.run_dir) / ".injected_failure"
        if not marker.exists():
            marker.touch()
            raise RuntimeError(f"injected failure at step {step} on rank {context.rank}")


@dataclass(frozen=True)
class AccountantOnRankZeroOnly:
    """Not a fault, a probe: after step `step` (in a later epoch than the first), a rank other
    than 0 leaves MARKER in the run directory if its process has imported dp-accounting.
    Only rank 0's epoch row is published, so only rank 0 computes its epsilon."""

    step: int
    MARKER = ".accountant_off_rank_zero"

    def __call__(self, context, step: int) -> None:
        if step == self.step and context.rank != 0 and "dp_accounting" in sys.modules:
            (Path(context.run_dir) / self.MARKER).touch()
