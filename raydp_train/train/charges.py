"""Write-ahead privacy charges: an epoch's steps (and its noisy metric release) are on record
BEFORE they run, and each release is marked before it happens, so the record counts exactly
what was released, across crashes.

`ChargeLedger` is the run's own record, under `<run_dir>/charges/` (a local directory or a
URI such as s3://..., through pyarrow's filesystem layer): one small immutable JSON file per
epoch charge, written to a temporary name and renamed, and, in a local directory, one
append-only release log per attempt (a worker group's life), where rank 0 writes "step s"
before step s's noisy gradient leaves it and "release e" before epoch e's noisy metric.
The current attempt counts its charges in full (write-ahead); an attempt that died counts
what its log says it released, so the epoch a crash cut short costs the steps it ran, and a
restart from the checkpoint before it charges the repeated steps again: they are released
again, with new noise. Where there is no log (an object store), a dead attempt's charges
count in full: never less than was released.

`RunAccount` adds the global budget in front of it: the charge is recorded with the id of
the budget request it is about to make, the budget's accountant must grant it before the
epoch runs, and a restart closes what a dead attempt reserved with what it released. A run
calibrated to `privacy.target_epsilon` never charges an epoch that would take it past that
target (a restart that repeats steps would). A trial of a random-stopping sweep spends from
the sweep's one reservation, made for its planned steps (tune.worst_trial_spend): it never
charges more than those (`ceiling`), so a restart cannot take it past what was reserved. A
refusal stops the run cleanly at its last checkpoint.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import NamedTuple

from pyarrow import fs

from raydp_train.budget.exclusive_files import replace_durably
from raydp_train.budget.ledger import as_uri
from raydp_train.train.stops import StopReason

RELEASE_LOG = "released-{attempt}.log"  # one per attempt, beside the charges


class Charged(NamedTuple):
    steps: int = 0
    releases: int = 0  # noisy validation-metric releases

    def __add__(self, other: Charged) -> Charged:
        return Charged(self.steps + other.steps, self.releases + other.releases)

    def __sub__(self, other: Charged) -> Charged:
        return Charged(self.steps - other.steps, self.releases - other.releases)


class ChargeRefused(RuntimeError):
    """The next epoch may not be charged: `stop` says why (a StopReason), the message is the
    run's stop reason as shown ("budget exhausted: ...", "target epsilon reached: ...")."""

    def __init__(self, stop: StopReason, details: str):
        super().__init__(stop.because(details))
        self.stop, self.details = stop, details

    def __reduce__(self):  # crosses process boundaries: rebuilt from its arguments
        return (type(self), (self.stop, self.details))


class ChargeLedger:
    def __init__(self, run_dir: str):
        self.filesystem, root = fs.FileSystem.from_uri(as_uri(run_dir))
        self.directory = f"{root.rstrip('/')}/charges"
        self.filesystem.create_dir(self.directory, recursive=True)
        self.attempt = uuid.uuid4().hex[:16]
        self._log: int | None = None  # this attempt's release log, opened by its first charge
        self._marks_of: dict[str, tuple | None] = {}  # a dead attempt's marks, read once
        self._newest = ""  # the newest charge's file: withdrawn if the budget refuses it
        self._total: Charged | None = None  # read from the files once, then kept up to date

    def charge(self, charge: Charged, request: str = "", epoch: int = 0,
               first_step: int = 0) -> Charged:
        """Durably record `charge` (epoch `epoch`, from step `first_step`; `request`: the id
        of the budget request about to pay for it) before it runs; returns the run's total."""
        before = self.total()  # read before writing, so the new charge counts once
        self._open_log()  # before the charge names it, so a charge with a log has one
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json"
        temporary, final = f"{self.directory}/.{name}.tmp", f"{self.directory}/{name}"
        record = {"steps": charge.steps, "releases": charge.releases, "time": time.time(),
                  "attempt": self.attempt, "request": request, "epoch": epoch,
                  "first_step": first_step, "release_log": self._log is not None}
        if isinstance(self.filesystem, fs.LocalFileSystem):  # on disk before it is charged
            replace_durably(temporary, final, json.dumps(record).encode())
        else:
            with self.filesystem.open_output_stream(temporary) as stream:
                stream.write(json.dumps(record).encode())
            self.filesystem.move(temporary, final)
        self._newest, self._total = final, before + charge
        return self._total

    def withdraw(self, charge: Charged) -> None:
        """The newest charge was refused by the budget: none of it will run."""
        self.filesystem.delete_file(self._newest)
        self._total = self.total() - charge

    def mark_step(self, step: int) -> None:
        """Step `step`'s noisy gradient is about to be released."""
        self._mark(f"step {step}\n")

    def mark_release(self, epoch: int) -> None:
        """Epoch `epoch`'s noisy validation metric is about to be released."""
        self._mark(f"release {epoch}\n")

    def total(self) -> Charged:
        """Every charge on record, earlier attempts of the run included (as released)."""
        if self._total is None:
            self._total = sum((self._counted(record) for record in self._records()), Charged())
        return self._total

    def dead_closings(self) -> list[tuple[str, int, int]]:
        """(budget request, steps released, releases released) of each charge an earlier
        attempt made: what its reservation must be settled with."""
        return [(record["request"], *self._counted(record)) for record in self._records()
                if record.get("request") and self._dead(record)]

    def close(self) -> None:
        if self._log is not None:
            os.close(self._log)
            self._log = None

    def _open_log(self) -> None:
        # Appends that outlive a killed process need a file system with appends: a local one.
        if self._log is None and isinstance(self.filesystem, fs.LocalFileSystem):
            path = f"{self.directory}/{RELEASE_LOG.format(attempt=self.attempt)}"
            self._log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def _mark(self, line: str) -> None:
        if self._log is not None:
            os.write(self._log, line.encode())
            os.fdatasync(self._log)  # on disk before the release: a power cut loses no mark

    def _records(self) -> list[dict]:
        selector = fs.FileSelector(self.directory, allow_not_found=True)
        records = []
        # Named by the time written: in name order, the order they were charged.
        for info in sorted(self.filesystem.get_file_info(selector), key=lambda i: i.base_name):
            if info.base_name.endswith(".json") and not info.base_name.startswith("."):
                with self.filesystem.open_input_stream(info.path) as stream:
                    records.append(json.loads(stream.read()))
        return records

    def _dead(self, record: dict) -> bool:
        return record.get("attempt", self.attempt) != self.attempt

    def _counted(self, record: dict) -> Charged:
        """A charge as it counts: in full, unless a dead attempt's log says what it released."""
        charged = Charged(record["steps"], record.get("releases", 0))
        marks = self._marks(record["attempt"]) if self._dead(record) else None
        if not record.get("release_log") or marks is None:
            return charged
        steps, releases = marks
        first = record["first_step"]
        return Charged(sum(first <= step < first + charged.steps for step in steps),
                       releases.count(record["epoch"]) if charged.releases else 0)

    def _marks(self, attempt: str) -> tuple[list[int], list[int]] | None:
        """(steps, epochs of metric releases) an attempt's log marks; None if it is missing
        or unreadable (then its charges count in full)."""
        if attempt not in self._marks_of:
            self._marks_of[attempt] = self._read_marks(attempt)
        return self._marks_of[attempt]

    def _read_marks(self, attempt: str) -> tuple[list[int], list[int]] | None:
        path = f"{self.directory}/{RELEASE_LOG.format(attempt=attempt)}"
        try:
            with self.filesystem.open_input_stream(path) as stream:
                lines = stream.read().decode().splitlines()
        except (OSError, UnicodeDecodeError):
            return None
        marks = {"step": [], "release": []}
        for line in lines:
            kind, _, number = line.partition(" ")
            if kind not in marks or not number.isdigit():
                return None
            marks[kind].append(int(number))
        return marks["step"], marks["release"]


class MemoryCharges:
    """The charges of an in-process run (world size 1, no run directory, no restarts)."""

    def __init__(self):
        self._total = Charged()

    def charge(self, charge: Charged, request: str = "", epoch: int = 0,
               first_step: int = 0) -> Charged:
        self._total += charge
        return self._total

    def withdraw(self, charge: Charged) -> None:
        self._total -= charge

    def mark_step(self, step: int) -> None:
        pass

    def mark_release(self, epoch: int) -> None:
        pass

    def dead_closings(self) -> list[tuple[str, int, int]]:
        return []

    def total(self) -> Charged:
        return self._total

    def close(self) -> None:
        pass


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
        self._dead_closed = False  # a dead attempt's reservations: closed before charging

    def charge(self, charge: Charged, epoch: int = 0, first_step: int = 0) -> Charged:
        """Record `charge` with the id of the budget request that will pay for it, then
        reserve it from the budget; the run's total, or ChargeRefused (then withdrawn)."""
        self._close_dead_attempts()
        self._check_cap(charge)
        self._check_ceiling(charge)
        request = uuid.uuid4().hex
        total = self.record.charge(charge, request, epoch, first_step)
        if self.budget is not None:
            decision = self.budget.reserve(self.owner, self.plan.spend(*charge), request)
            if not decision.granted:
                self.record.withdraw(charge)
                raise ChargeRefused(StopReason.BUDGET_EXHAUSTED, decision.reason)
            self._open = decision
        return total

    def releasing_step(self, step: int) -> None:
        self.record.mark_step(step)

    def releasing_metric(self, epoch: int) -> None:
        self.record.mark_release(epoch)

    def _close_dead_attempts(self) -> None:
        """Settle what the attempts before this one reserved with what they released (the
        epoch a crash cut short), before this one asks for more."""
        if self.budget is not None and not self._dead_closed:
            closings = self.record.dead_closings()
            if closings:
                self.budget.close_requests(closings)
        self._dead_closed = True

    def _check_cap(self, charge: Charged) -> None:
        if self.epsilon_cap is None:
            return
        before = self.total()
        after = before + charge
        epsilon = self.plan.epsilon(after.steps, releases=after.releases)
        if epsilon > self.epsilon_cap:
            raise ChargeRefused(
                StopReason.TARGET_EPSILON_REACHED,
                f"{before.steps} steps are charged and the next "
                f"epoch's {charge.steps} would make epsilon {epsilon:.4f}, above "
                f"privacy.target_epsilon {self.epsilon_cap:g}"
            )

    def _check_ceiling(self, charge: Charged) -> None:
        if self.ceiling is None:
            return
        after = self.total() + charge
        if after.steps > self.ceiling.steps or after.releases > self.ceiling.releases:
            raise ChargeRefused(
                StopReason.RESERVATION_USED_UP,
                f"the sweep reserved {self.ceiling.steps} steps and "
                f"{self.ceiling.releases} releases for this trial, and the next epoch would "
                f"charge {after.steps} and {after.releases} (a restart repeats steps)")

    def settle(self, used: Charged) -> None:
        """Tell the budget what the granted epoch used (all of it, unless it stopped early)."""
        if self._open is not None:
            self.budget.settle(self._open, used.steps, used.releases)
            self._open = None

    def total(self) -> Charged:
        return self.record.total()
