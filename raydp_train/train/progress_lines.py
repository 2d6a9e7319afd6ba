"""Rank 0's rows on their way to the driver's console: each epoch's row and its place within
a long epoch, one line of JSON each, appended to a file in the run directory. Ray Train keeps
the run's checkpoints there, so every node of a cluster writes and reads it (README, "Running
on a cluster"). A file needs no process of its own: the queue actor it replaced cost every
run 0.85 CPU-s (benchmarks/RESULTS.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raydp_train.train.charges import Charged
    from raydp_train.train.plan import PrivacyPlan

PROGRESS_LINES = ".progress_lines"


def append_row(run_dir: str | Path, row: dict) -> None:
    """On rank 0: `row` as one whole line (numpy and torch scalars written as numbers)."""
    line = json.dumps(row, default=lambda scalar: scalar.item()) + "\n"
    with open(Path(run_dir) / PROGRESS_LINES, "a", encoding="utf-8") as lines:
        lines.write(line)


class RowReader:
    """On the driver: the rows appended since it was made (a resumed run's file already holds
    the earlier ones), each once, and only whole lines."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / PROGRESS_LINES
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.partial = b""

    def new_rows(self) -> list[dict]:
        try:
            with open(self.path, "rb") as lines:
                lines.seek(self.offset)
                data = lines.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        whole, _, self.partial = (self.partial + data).rpartition(b"\n")
        return [json.loads(line) for line in whole.split(b"\n") if line]

    def remove(self) -> None:
        """The run's rows have been shown: the file goes, the run directory as it was."""
        self.path.unlink(missing_ok=True)


def tracked_privacy(plan: PrivacyPlan, charged: Charged, budget) -> dict[str, float]:
    """What `run.loggers` adds to an epoch's row: epsilon so far by both accountants, and the
    global budget's epsilon left when the run spends from one."""
    row = {f"epsilon_{accountant}": plan.reported_epsilon(charged.steps, accountant,
                                                          charged.releases)
           for accountant in ("rdp", "pld")}
    row = {name: value for name, value in row.items() if value is not None}
    if budget is not None:
        row["budget_epsilon_left"] = budget.status()["epsilon_remaining"]
    return row
