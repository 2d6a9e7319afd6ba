"""The global privacy budget (ARCHITECTURE.md §2.6): one central accountant per budget name.

`BudgetBook` is the bookkeeping, free of Ray: which reservations exist, what each counts, and
whether one more fits. Everything counted (settled steps, plus open reservations in full) is
composed by dp-accounting and must stay within the budget's (epsilon, delta).

`replay` and `catch_up` rebuild a book from ledger rows; `budget_accountant.BudgetAccountant`
puts a book and its ledger together (the Ray actor).
"""

from __future__ import annotations

import copy
import math
import time
import uuid
from dataclasses import asdict, dataclass, replace

from raydp_train.accounting.epsilon import (
    composed_epsilon,
    make_accountant,
)
from raydp_train.budget.ledger import LedgerCorruptError
from raydp_train.budget.terms import BudgetError, BudgetTerms, Spend

NAMESPACE = "raydp_train"
# Recomputing the ledger's events after a restart must give the epsilon it recorded.
_REPLAY_RELATIVE_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Decision:
    granted: bool
    reservation: str  # id to settle with; empty when refused
    owner: str
    epsilon_after: float  # everything counted, with this reservation (granted or not)
    budget_epsilon: float
    reason: str = ""


@dataclass
class _Reservation:
    owner: str
    spend: Spend
    settled: Spend | None = None  # what was actually used, once settled

    @property
    def counted(self) -> Spend:
        return self.settled or self.spend


class BudgetBook:
    """The budget's state as a pure function of its ledger rows.

    `propose` and `settle_row` compute the row (and the accountant of the state it leads to);
    `apply` takes a written row in. Replaying a ledger applies rows without accountants and
    composes what is counted once at the end.
    """

    def __init__(self, terms: BudgetTerms):
        self.terms = terms
        self.reservations: dict[str, _Reservation] = {}
        self.answers: dict[str, dict] = {}  # request id -> the row that answered it
        self.next_seq = 0
        self.epsilon = 0.0  # of everything counted, as recorded by the last row
        self.resets = 0
        # Per reset: the epsilon of the spending it stopped counting (settled before it).
        self.epsilon_before_resets: list[float] = []
        self._accountant = make_accountant(terms.accountant)
        self._stale = False  # the accountant must be recomposed from the reservations

    def open_row(self) -> dict:
        return self._row("open", "", "", "", None, running_epsilon=0.0)

    def propose(self, request_id: str, owner: str, spend: Spend):
        """Decide a reservation: (decision, ledger row or None, accountant after granting)."""
        spend.check()
        candidate = copy.deepcopy(self._counted())
        candidate.compose(spend.dp_event())
        epsilon_after = float(candidate.get_epsilon(self.terms.delta))
        if epsilon_after > self.terms.epsilon:
            remaining = max(self.terms.epsilon - self.epsilon, 0.0)
            reason = (f"budget exhausted: '{self.terms.name}' has epsilon {remaining:.4g} of "
                      f"{self.terms.epsilon:g} left (delta {self.terms.delta:g}); {owner} asked "
                      f"for {spend.describe()}, which would bring it to {epsilon_after:.4g}")
            return Decision(False, "", owner, epsilon_after, self.terms.epsilon, reason), None, None
        reservation = uuid.uuid4().hex
        row = self._row("reserve", request_id, owner, reservation, spend, epsilon_after)
        return decision_of(row), row, candidate

    def settle_row(self, request_id: str, reservation: str, steps_done: int, releases_done: int):
        """The row closing `reservation` with what was used, and the accountant after it."""
        held = self.reservations.get(reservation)
        if held is None:
            raise BudgetError(f"settle: no reservation {reservation!r} in '{self.terms.name}'")
        if held.settled is not None:
            raise BudgetError(f"settle: reservation {reservation!r} is already settled")
        if not (0 <= steps_done <= held.spend.steps and 0 <= releases_done <= held.spend.releases):
            raise BudgetError(
                f"settle: {steps_done} steps / {releases_done} releases done do not fit "
                f"reservation {reservation!r} of {held.spend.describe()}")
        used = replace(held.spend, steps=steps_done, releases=releases_done)
        if held.spend.random_stopping:
            used = held.spend  # the sweep's cost does not depend on how far its trials got
        accountant = self._counted()
        if used != held.spend:  # unused steps return: recompose what stays counted
            held.settled = used
            accountant = self._compose_counted()
            held.settled = None
        epsilon = float(accountant.get_epsilon(self.terms.delta))
        return self._row("settle", request_id, held.owner, reservation, used, epsilon), accountant

    def reset_row(self, request_id: str, note: str):
        """The row of a reset (`budget reset --force`) and the accountant after it.

        From a reset on, settled reservations no longer count; the ledger keeps them. Open
        reservations stay counted in full: their runs are still spending.
        """
        accountant = self._compose_counted(self._open_reservations())
        epsilon = float(accountant.get_epsilon(self.terms.delta))
        return self._row("reset", request_id, note, "", None, epsilon), accountant

    def apply(self, row: dict, accountant=None) -> None:
        """Take a written row into the state; `accountant` is the one of the state after it."""
        self.next_seq = row["seq"] + 1
        if row["kind"] == "reserve":
            self.reservations[row["reservation"]] = _Reservation(row["owner"], _spend_of(row))
        elif row["kind"] == "settle":
            self.reservations[row["reservation"]].settled = _spend_of(row)
        elif row["kind"] == "reset":
            self.epsilon_before_resets.append(self._epsilon_dropped_by_reset())
            self.reservations = self._open_reservations()
            self.resets += 1
        if row["request_id"]:
            self.answers[row["request_id"]] = row
        self.epsilon = row["running_epsilon"]
        if row["kind"] != "open":
            self._stale = accountant is None
            self._accountant = accountant if accountant is not None else self._accountant

    def recomposed_epsilon(self) -> float:
        return float(self._counted().get_epsilon(self.terms.delta))

    def status(self) -> dict:
        owners: dict[str, dict] = {}
        for held in self.reservations.values():
            entry = owners.setdefault(held.owner, {"steps_spent": 0, "steps_reserved": 0,
                                                   "releases": 0, "open_reservations": 0})
            if held.settled is None:
                entry["steps_reserved"] += held.spend.steps
                entry["open_reservations"] += 1
            else:
                entry["steps_spent"] += held.settled.steps
            entry["releases"] += held.counted.releases
        return {
            **asdict(self.terms),
            "epsilon_counted": self.epsilon,
            "epsilon_remaining": max(self.terms.epsilon - self.epsilon, 0.0),
            "steps_spent": sum(o["steps_spent"] for o in owners.values()),
            "steps_reserved": sum(o["steps_reserved"] for o in owners.values()),
            "owners": owners,
            "resets": self.resets,
            "epsilon_before_resets": list(self.epsilon_before_resets),
            "epsilon_across_resets": sum(self.epsilon_before_resets) + self.epsilon,
        }

    def epsilon_of(self, owner: str) -> float:
        """Epsilon of what `owner` and its parts (`owner/...`: a sweep's trials) count; not
        another owner whose name only starts alike (a sweep `X-1` beside `X`)."""
        events = [h.counted.dp_event() for h in self.reservations.values()
                  if h.owner == owner or h.owner.startswith(f"{owner}/")]
        return composed_epsilon(events, self.terms.delta, self.terms.accountant) if events else 0.0

    def _epsilon_dropped_by_reset(self) -> float:
        """Epsilon of the settled reservations a reset stops counting (open ones stay counted
        after it, in the next period), so each reservation falls in exactly one period."""
        settled = {key: held for key, held in self.reservations.items()
                   if held.settled is not None}
        return float(self._compose_counted(settled).get_epsilon(self.terms.delta))

    def _open_reservations(self) -> dict[str, _Reservation]:
        return {key: held for key, held in self.reservations.items() if held.settled is None}

    def _counted(self):
        if self._stale:
            self._accountant, self._stale = self._compose_counted(), False
        return self._accountant

    def _compose_counted(self, reservations: dict | None = None):
        """Everything counted, merged by identical mechanism (T1 + T2 steps compose as one)."""
        merged: dict[tuple, Spend] = {}
        held_now = self.reservations if reservations is None else reservations
        for number, held in enumerate(held_now.values()):
            spend = held.counted
            if spend.random_stopping:
                merged[("random_stopping", number)] = spend  # each sweep is its own event
                continue
            key = (spend.mechanism, spend.sampling_rate, spend.noise_multiplier,
                   spend.release_noise_multiplier)
            if key in merged:
                spend = replace(spend, steps=spend.steps + merged[key].steps,
                                releases=spend.releases + merged[key].releases)
            merged[key] = spend
        accountant = make_accountant(self.terms.accountant)
        for key in sorted(merged, key=str):
            if merged[key].steps or merged[key].releases:
                accountant.compose(merged[key].dp_event())
        return accountant

    def _row(self, kind, request_id, owner, reservation, spend, running_epsilon) -> dict:
        spend_fields = asdict(spend if spend is not None else Spend(1.0, 1.0, 0))
        return {"seq": self.next_seq, "budget": self.terms.name, "kind": kind,
                "request_id": request_id, "owner": owner, "reservation": reservation,
                **spend_fields, "budget_epsilon": self.terms.epsilon,
                "budget_delta": self.terms.delta, "accountant": self.terms.accountant,
                "timestamp": time.time(), "running_epsilon": running_epsilon,
                **({"unit": self.terms.unit} if self.terms.unit != "example" else {})}


def decision_of(row: dict) -> Decision:
    """The grant a reserve row records (a retried request gets the same answer)."""
    return Decision(True, row["reservation"], row["owner"], row["running_epsilon"],
                    row["budget_epsilon"])


# Ledgers written before mechanisms were named recorded a random-stopping sweep of DP-SGD-
# accounted trials as mechanism "random_stopping" (its mean_trials > 0 says it is one).
_LEGACY_MECHANISMS = {"random_stopping": "dpsgd"}


def _spend_of(row: dict) -> Spend:
    spend = Spend(**{name: row[name] for name in Spend.__dataclass_fields__})
    return replace(spend, mechanism=_LEGACY_MECHANISMS.get(spend.mechanism, spend.mechanism))


def replay(rows: list[dict], terms: BudgetTerms | None = None) -> BudgetBook:
    """Rebuild a book from ledger rows (its terms are those of the first row; `terms` for an
    empty ledger), checking every row's terms and the recorded epsilon."""
    book = BudgetBook(terms_of(rows[0]) if rows else terms)
    catch_up(book, rows)
    return book


def catch_up(book: BudgetBook, rows: list[dict]) -> None:
    """Apply the rows that follow the book's last one (written by any writer), checking their
    terms and that their events compose to the epsilon they recorded."""
    for row in rows:
        if terms_of(row) != book.terms:
            raise LedgerCorruptError(f"ledger fragment {row['fragment']} has other budget terms")
        book.apply(row)
    if not rows:
        return
    recomputed = book.recomposed_epsilon()
    if not math.isclose(recomputed, book.epsilon, rel_tol=_REPLAY_RELATIVE_TOLERANCE,
                        abs_tol=1e-12):
        raise LedgerCorruptError(
            f"ledger of '{book.terms.name}': its events compose to epsilon {recomputed:.6g}, but "
            f"the last fragment ({rows[-1]['fragment']}) recorded {book.epsilon:.6g}")


def check_same_terms(asked: BudgetTerms, held: BudgetTerms) -> None:
    """Refuse a pipeline that asks an existing budget for other terms than it was created with."""
    if asked == held:
        return
    if asked.unit != held.unit:
        raise BudgetError(
            f"privacy.unit: budget '{asked.name}' counts epsilon per {held.unit}; this "
            f"pipeline spends per {asked.unit}, and the two guarantees do not compose. A budget "
            f"keeps one unit: set privacy.unit: {held.unit}, or use another budget name")
    differ = [f"budget.{key}" for key in ("epsilon", "delta", "accountant")
              if getattr(asked, key) != getattr(held, key)]
    raise BudgetError(
        f"{', '.join(differ)}: budget '{asked.name}' was created with "
        f"epsilon={held.epsilon:g}, delta={held.delta:g}, accountant={held.accountant}; "
        f"this pipeline asks for epsilon={asked.epsilon:g}, delta={asked.delta:g}, "
        f"accountant={asked.accountant}. A budget's terms never change: use these "
        "values or another budget name")


def terms_of(row: dict) -> BudgetTerms:
    """The budget terms every ledger row carries."""
    return BudgetTerms(row["budget"], row["budget_epsilon"], row["budget_delta"],
                       row["accountant"], row.get("unit") or "example")
