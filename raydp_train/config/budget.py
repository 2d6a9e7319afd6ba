"""The `budget` section of a pipeline: the global privacy budget every run and trial spends
from, and the ledger that keeps it."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from raydp_train.config.base import MAX_COMPONENT_BYTES, SafeName, Section, WrittenPath
from raydp_train.config.errors import FieldProblem


def default_ledger() -> str:
    """One ledger per machine, wherever a command runs from: `$RAYDP_TRAIN_HOME/budgets`,
    default `~/.raydp_train/budgets`. Relative to the current folder, two runs of one pipeline
    started from two folders would each grant the whole budget."""
    home = os.environ.get("RAYDP_TRAIN_HOME") or os.path.join("~", ".raydp_train")
    return os.path.join(os.path.abspath(os.path.expanduser(home)), "budgets")


class BudgetConfig(Section):
    """The global privacy budget every run and trial of this name spends from
    (ARCHITECTURE.md §2.6)."""

    name: SafeName
    epsilon: float = Field(gt=0)
    delta: float = Field(gt=0, lt=1)
    accountant: Literal["rdp", "pld"] = "rdp"
    ledger: WrittenPath = Field(default_factory=default_ledger, min_length=1)  # folder or URI
    persist_across_jobs: bool = False  # a detached accountant actor that outlives the job

    @field_validator("ledger")
    @classmethod
    def _witness_fits(cls, ledger: str) -> str:
        """The witness folder beside the ledger (`<ledger>.witness`) must be a valid name too."""
        last = os.fsencode(ledger.rstrip("/")).rpartition(b"/")[2]
        room = MAX_COMPONENT_BYTES - len(".witness")
        if "://" not in ledger and len(last) > room:
            raise FieldProblem(f"its last folder name is {len(last)} bytes long, at most {room} "
                               "(the witness beside it adds '.witness')")
        return ledger
