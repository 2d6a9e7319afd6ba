"""The central accountant of one budget: a `BudgetBook` and its ledger (ARCHITECTURE.md §2.6).

Run as a Ray actor by `budget_actor` (one call at a time), it writes each change to the ledger
BEFORE answering (write-ahead), and a restarted accountant rebuilds its book from the ledger
alone. The ledger, not this object, decides which writer's row takes each sequence number, so
any number of accountants (two clusters, two embedded runs) may share one ledger: a row is
decided on the book, committed by an exclusive create, and decided again on the caught-up book
if another writer committed that number first. With one writer nothing is re-read.
"""

from __future__ import annotations

from raydp_train.budget.book import Decision, catch_up, check_same_terms, decision_of, replay
from raydp_train.budget.ledger import BudgetLedger, FragmentTaken, LedgerCorruptError, LedgerError
from raydp_train.budget.terms import BudgetError, BudgetTerms, Spend


class BudgetAccountant:
    """Decides and records reservations of one budget; every call raises the error of a
    ledger that cannot be read, rather than working around it."""

    def __init__(self, ledger_root: str, terms: BudgetTerms):
        self.ledger_root = ledger_root
        self._broken: LedgerError | None = None
        try:
            self.ledger = BudgetLedger(ledger_root, terms.name)
            self.book = replay(self.ledger.rows(), terms)
            self._commit(self._decide_open)
        except LedgerError as error:
            self._broken = error

    def check_terms(self, terms: BudgetTerms, ledger_root: str) -> dict:
        """Refuse a user whose pipeline asks for other terms or another ledger."""
        self._usable()
        check_same_terms(terms, self.book.terms)
        if ledger_root != self.ledger_root:
            raise BudgetError(f"budget.ledger: budget '{terms.name}' keeps its ledger at "
                              f"{self.ledger_root}, not {ledger_root}")
        return self.book.status()

    def reserve(self, request_id: str, owner: str, spend: Spend) -> Decision:
        self._usable()

        def decide():
            if request_id in self.book.answers:  # a retried call: answer it again
                return decision_of(self.book.answers[request_id]), None, None
            return self.book.propose(request_id, owner, spend)

        return self._commit(decide)  # durable BEFORE the grant leaves this actor

    def settle(self, request_id: str, reservation: str, steps_done: int,
               releases_done: int = 0) -> int:
        """Close a reservation with what was used; returns the steps given back."""
        self._usable()

        def decide():
            if request_id in self.book.answers:
                return None, None, None
            return None, *self.book.settle_row(request_id, reservation, steps_done,
                                               releases_done)

        self._commit(decide)
        row, held = self.book.answers[request_id], self.book.reservations.get(reservation)
        # A retried settle may find the reservation reset away since: nothing to give back.
        return 0 if held is None else held.spend.steps - row["steps"]

    def close_requests(self, closings: list[tuple[str, int, int]]) -> int:
        """Settle what a dead attempt of a run reserved: each (reserve request id, steps done,
        releases done) closes the reservation that request was granted, if it is still open.
        A request that was refused or never arrived reserved nothing. Returns how many closed."""
        self._usable()
        closed = 0
        for request_id, steps_done, releases_done in closings:
            row = self.book.answers.get(request_id, {})
            held = self.book.reservations.get(row.get("reservation", ""))
            if held is None or held.settled is not None:  # refused, lost, settled or reset
                continue
            if steps_done > held.spend.steps or releases_done > held.spend.releases:
                continue  # more than was granted cannot be: stays counted in full
            self.settle(f"{request_id}:closed", row["reservation"], steps_done, releases_done)
            closed += 1
        return closed

    def status(self) -> dict:
        self._usable()
        self._catch_up()  # other writers may have spent since this accountant last wrote
        return self.book.status()

    def reset(self, request_id: str, note: str) -> dict:
        """Append a reset row (see BudgetBook.reset_row); returns the status after it."""
        self._usable()

        def decide():
            if request_id in self.book.answers:
                return None, None, None
            return None, *self.book.reset_row(request_id, note)

        self._commit(decide)
        return self.book.status()

    def epsilon_of(self, owner: str) -> float:
        self._usable()
        self._catch_up()
        return self.book.epsilon_of(owner)

    def head(self) -> tuple[int, str]:
        """(seq, hash) of the newest ledger row, after catching up: what a run's record keeps,
        so that a ledger restored from an older copy is noticed (budget/run_witnesses.py)."""
        self._usable()
        self._catch_up()
        return self.book.next_seq - 1, self.ledger.hash_of(self.book.next_seq - 1)

    def _decide_open(self):
        """A new budget's terms are fixed by its first row, whichever writer commits it."""
        return None, None if self.book.next_seq else self.book.open_row(), None

    def _commit(self, decide):
        """`decide()` -> (answer, row or None, accountant after the row), on the book as it
        is; commit the row, and if another writer took its number, catch up, decide again."""
        while True:
            answer, row, accountant = decide()
            if row is None:
                return answer
            try:
                self.ledger.append(row)
            except FragmentTaken:
                if not self._catch_up():
                    raise LedgerCorruptError(
                        f"ledger {self.ledger.uri}: fragment number {row['seq']} is taken but "
                        "cannot be read") from None
                continue
            self.book.apply(row, accountant)
            return answer

    def _catch_up(self) -> int:
        """Take in the rows other writers committed after ours; returns how many."""
        missed = self.ledger.rows_from(self.book.next_seq)
        if self.book.next_seq == 0 and missed:  # another writer opened the budget
            self.book = replay(missed)
        else:
            catch_up(self.book, missed)
        return len(missed)

    def _usable(self) -> None:
        if self._broken is not None:
            raise self._broken
