"""Write-ahead privacy charges: an epoch's steps (and its noisy metric release) are on record
BEFORE they run.

`ChargeLedger` is the run's own record: one small immutable JSON file per charge under
`<run_dir>/charges/`, written to a temporary name and renamed, through pyarrow's filesystem
layer (a local directory or a URI such as s3://...). A worker group that restarts from a
checkpoint charges the repeated steps again, so epsilon counts every step that was ever run.

`RunAccount` adds the global budget in front of it: the budget's accountant must grant an
epoch before the run records it, and a run calibrated to `privacy.target_epsilon` never
charges an epoch that would take it past that target (a restart that repeats steps would).
A trial of a random-stopping sweep spends from the sweep's one reservation, made for its
planned steps (tune.worst_trial_spend): it never charges more than those (`ceiling`), so a
restart cannot take it past what was reserved. A refusal stops the run cleanly at its last
checkpoint.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import NamedTuple

from pyarrow import fs

from raydp_train.privacy.ledger import as_uri


class Charged(NamedTuple):
    steps: int = 0
    releases: int = 0  # noisy validation-metric releases

    def __add__(self, other: Charged) -> Charged:
        return Charged(self.steps + other.steps, self.releases + other.releases)


class ChargeRefused(RuntimeError):
    """The next epoch may not be charged; the message is the run's stop reason ("budget
    exhausted: ...", "target epsilon reached: ...", "interrupted: ...")."""


class ChargeLedger:
    def __init__(self, run_dir: str):
        self.filesystem, root = fs.FileSystem.from_uri(as_uri(run_dir))
        self.directory = f"{root.rstrip('/')}/charges"
        self.filesystem.create_dir(self.directory, recursive=True)
        self._total: Charged | None = None  # read from the files once, then kept up to date

    def charge(self, charge: Charged) -> Charged:
        """Durably record `charge` as spent; returns the total charged by the run so far."""
        before = self.total()  # read before writing, so the new charge counts once
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json"
        temporary, final = f"{self.directory}/.{name}.tmp", f"{self.directory}/{name}"
        record = {"steps": charge.steps, "releases": charge.releases, "time": time.time()}
        with self.filesystem.open_output_stream(temporary) as stream:
            stream.write(json.dumps(record).encode())
        self.filesystem.move(temporary, final)
        self._total = before + charge
        return self._total

    def total(self) -> Charged:
        """Every charge on record, earlier attempts of the run included."""
        if self._total is None:
            self._total = self._read_total()
        return self._total

    def _read_total(self) -> Charged:
        selector = fs.FileSelector(self.directory, allow_not_found=True)
        total = Charged()
        for info in self.filesystem.get_file_info(selector):
            if info.base_name.endswith(".json") and not info.base_name.startswith("."):
                with self.filesystem.open_input_stream(info.path) as stream:
                    record = json.loads(stream.read())
                total += Charged(record["steps"], record.get("releases", 0))
        return total


class MemoryCharges:
    """The charges of an in-process run (world size 1, no run directory)."""

    def __init__(self):
        self._total = Charged()

    def charge(self, charge: Charged) -> Charged:
        self._total += charge
        return self._total

    def total(self) -> Charged:
        return self._total


def epsilon_cap(pipeline, plan) -> float | None:
    """The epsilon a run must not pass: its target, when sigma was calibrated to one."""
    return pipeline.privacy.target_epsilon if plan.noise_calibrated else None


def planned_charges(plan) -> Charged:
    """What a run charges when it runs as planned: every step, every epoch's releases."""
    return Charged(plan.steps, plan.epochs * plan.releases_per_epoch)


class RunAccount:
    """Where one run's privacy goes: the global budget (if any) grants, the record keeps."""

    def __init__(self, record: ChargeLedger | MemoryCharges, budget=None, owner: str = "",
                 plan=None, epsilon_cap: float | None = None, ceiling: Charged | None = None):
        """`epsilon_cap`: the run's `privacy.target_epsilon` (None: no cap of its own);
        `ceiling`: the most it may charge in all, when a reservation made elsewhere pays."""
        self.record, self.budget, self.owner, self.plan = record, budget, owner, plan
        self.epsilon_cap, self.ceiling = epsilon_cap, ceiling
        self._open = None  # the budget's grant for the epoch being run

    def charge(self, charge: Charged) -> Charged:
        """Reserve `charge` from the budget, then record it; raises ChargeRefused."""
        self._check_cap(charge)
        self._check_ceiling(charge)
        if self.budget is not None:
            decision = self.budget.reserve(self.owner, self.plan.spend(*charge))
            if not decision.granted:
                raise ChargeRefused(f"budget exhausted: {decision.reason}")
            self._open = decision
        return self.record.charge(charge)

    def _check_cap(self, charge: Charged) -> None:
        if self.epsilon_cap is None:
            return
        before = self.total()
        after = before + charge
        epsilon = self.plan.epsilon(after.steps, releases=after.releases)
        if epsilon > self.epsilon_cap:
            raise ChargeRefused(
                f"target epsilon reached: {before.steps} steps are charged and the next "
                f"epoch's {charge.steps} would make epsilon {epsilon:.4f}, above "
                f"privacy.target_epsilon {self.epsilon_cap:g}"
            )

    def _check_ceiling(self, charge: Charged) -> None:
        if self.ceiling is None:
            return
        after = self.total() + charge
        if after.steps > self.ceiling.steps or after.releases > self.ceiling.releases:
            raise ChargeRefused(
                f"reservation used up: the sweep reserved {self.ceiling.steps} steps and "
                f"{self.ceiling.releases} releases for this trial, and the next epoch would "
                f"charge {after.steps} and {after.releases} (a restart repeats steps)")

    def settle(self, used: Charged) -> None:
        """Tell the budget what the granted epoch used (all of it, unless it stopped early)."""
        if self._open is not None:
            self.budget.settle(self._open, used.steps, used.releases)
            self._open = None

    def total(self) -> Charged:
        return self.record.total()
