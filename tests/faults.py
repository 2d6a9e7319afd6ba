"""Faults the tests inject into a real run, through `fit(after_step=...)`: test-only code,
pickled by value to the Ray Train workers (the tests folder is not on their path)."""

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
