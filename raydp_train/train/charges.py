"""Write-ahead privacy charges: an epoch's steps (and its noisy metric release) are on record
BEFORE they run, and each release is marked before it happens, so the record counts exactly
what was released, across crashes.

`RunCharges` is the run's own record, under `<run_dir>/charges/` (a local directory or a
URI such as s3://...): one immutable JSON file per epoch charge, and, in a local directory,
one release log per attempt (a worker group's life; train/release_log.py). The current
attempt counts its charges in full (write-ahead); a dead attempt counts the larger of what
its log says it released and what the checkpoint the next attempt resumed from proves it
ran, so the epoch a crash cut short costs the steps it ran, and a restart charges repeated
steps again (released again, with new noise). Without a log that chains (an object store,
a log cut or edited), a dead attempt's charges count in full.

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
import time
import uuid
from typing import NamedTuple

from pyarrow import fs

from raydp_train.budget.exclusive_files import replace_durably
from raydp_train.budget.ledger import as_uri
from raydp_train.train.release_log import RELEASE_LOG, ReleaseLog, read_marks
from raydp_train.train.stops import StopReason


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


class RunCharges:
    def __init__(self, run_dir: str):
        self.filesystem, root = fs.FileSystem.from_uri(as_uri(run_dir))
        self.directory = f"{root.rstrip('/')}/charges"
        self.filesystem.create_dir(self.directory, recursive=True)
        self.attempt = uuid.uuid4().hex[:16]
        self._log: ReleaseLog | None = None  # this attempt's, opened by its first charge
        self._marks_of: dict[str, tuple | None] = {}  # a dead attempt's marks, read once
        self._newest = ""  # the newest charge's file: withdrawn if the budget refuses it
        self._total: Charged | None = None  # read from the files once, then kept up to date
        self._resumed_at = 0  # the step this attempt's checkpoint proves the run reached

    def resumed_at(self, step: int) -> None:
        """This attempt continues from a checkpoint at step `step`: the steps before it ran,
        whatever a dead attempt's log says (the larger of the two counts)."""
        self._resumed_at, self._total = step, None

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
        self._mark("step", step)

    def mark_release(self, epoch: int) -> None:
        """Epoch `epoch`'s noisy validation metric is about to be released."""
        self._mark("release", epoch)

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
            self._log.close()
            self._log = None

    def _open_log(self) -> None:
        # Appends that outlive a killed process need a file system with appends: a local one.
        if self._log is None and isinstance(self.filesystem, fs.LocalFileSystem):
            self._log = ReleaseLog(f"{self.directory}/{RELEASE_LOG.format(attempt=self.attempt)}")

    def _mark(self, kind: str, number: int) -> None:
        if self._log is not None:
            self._log.mark(kind, number)

    def _records(self) -> list[dict]:
        selector = fs.FileSelector(self.directory, allow_not_found=True)
        records = []
        # Named by the time written: in name order, the order they were charged.
        for info in sorted(self.filesystem.get_file_info(selector), key=lambda i: i.base_name):
            if info.base_name.endswith(".json") and not info.base_name.startswith("."):
                with self.filesystem.open_input_stream(info.path) as stream:
                    records.append(json.loads(stream.read()))
        self._mark_checkpointed(records)
        return records

    def _mark_checkpointed(self, records: list[dict]) -> None:
        """The checkpoint this attempt resumed from (at step S) was written by the attempt
        that last charged an epoch through S: that charge ran at least S - first_step steps."""
        resumed = self._resumed_at
        covering = [r for r in records if self._dead(r) and "first_step" in r
                    and r["first_step"] < resumed <= r["first_step"] + r["steps"]]
        if covering:
            covering[-1]["checkpointed_steps"] = resumed - covering[-1]["first_step"]

    def _dead(self, record: dict) -> bool:
        return record.get("attempt", self.attempt) != self.attempt

    def _counted(self, record: dict) -> Charged:
        """A charge as it counts: in full, unless a dead attempt's log says what it released
        (or the checkpoint this attempt resumed from proves more ran)."""
        charged = Charged(record["steps"], record.get("releases", 0))
        marks = self._marks(record["attempt"]) if self._dead(record) else None
        if not record.get("release_log") or marks is None:
            return charged
        steps, releases = marks
        first = record["first_step"]
        logged = sum(first <= step < first + charged.steps for step in steps)
        return Charged(max(logged, record.get("checkpointed_steps", 0)),
                       releases.count(record["epoch"]) if charged.releases else 0)

    def _marks(self, attempt: str) -> tuple[list[int], list[int]] | None:
        """(steps, epochs of metric releases) an attempt's log marks; None if it is missing,
        unreadable or does not chain (then its charges count in full)."""
        if attempt not in self._marks_of:
            path = f"{self.directory}/{RELEASE_LOG.format(attempt=attempt)}"
            self._marks_of[attempt] = read_marks(self.filesystem, path)
        return self._marks_of[attempt]


class MemoryCharges:
    """The charges of an in-process run (no run directory; `total`: what a restored state
    says was charged before it)."""

    def __init__(self, total: Charged = Charged()):  # noqa: B008 -- an immutable tuple
        self._total = total

    def charge(self, charge: Charged, request: str = "", epoch: int = 0,
               first_step: int = 0) -> Charged:
        self._total += charge
        return self._total

    def withdraw(self, charge: Charged) -> None:
        self._total -= charge

    def dead_closings(self) -> list[tuple[str, int, int]]:
        return []

    def total(self) -> Charged:
        return self._total

    def _ignored(self, *_) -> None:
        """No mark to write, nothing to close: no later attempt of the run reads them."""

    mark_step = mark_release = resumed_at = close = _ignored


def epsilon_cap(pipeline, plan) -> float | None:
    """The epsilon a run must not pass: its target, when sigma was calibrated to one."""
    return pipeline.privacy.target_epsilon if plan.noise_calibrated else None


def planned_charges(plan) -> Charged:
    """What a run charges when it runs as planned: every step, every epoch's releases."""
    return Charged(plan.steps, plan.epochs * plan.releases_per_epoch)


class RunAccount:
    """Where one run's privacy goes: the global budget (if any) grants, the record keeps."""

    def __init__(self, record: RunCharges | MemoryCharges, budget=None, owner: str = "",
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
        if not self._dead_closed:  # this attempt's first charge starts where it resumed
            self.record.resumed_at(first_step)
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
