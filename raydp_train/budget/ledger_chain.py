"""The checks a ledger's rows must pass once read (budget/ledger.py): numbered 0, 1, 2, ...
without a gap; each chained row naming the hash of the row before; no unchained row after a
chained one (an edit that computed no hash); a head marker wherever a row is chained; and no
mark (the head marker, the witness beside the ledger, a run record) naming a row that is not
there: a ledger older than what was seen of it is refused, naming what saw it."""

from __future__ import annotations

from raydp_train.budget.ledger_schema import fragment_name, row_hash
from raydp_train.errors import UserError


class LedgerError(UserError, RuntimeError):
    """The ledger cannot be read or written; the message names the path."""


class LedgerCorruptError(LedgerError):
    """A fragment is unreadable or the sequence has a gap: the budget refuses to run on it."""


OLDER_THAN_WITNESS = (
    "the ledger is older than what that saw: it was restored from an older copy, or its newest "
    "fragments were deleted, and would count less than was spent; put back its newest copy")


def check_rows(uri: str, rows: list[dict], head: tuple[int, str] | None,
               witnesses: tuple[tuple[tuple[int, str], str], ...] = ()) -> None:
    """Numbers, links, `witnesses` ((mark, who saw it) each) and the head marker of every row
    of a ledger read whole."""
    chained = False
    for expected, row in enumerate(rows):
        if row["seq"] != expected:
            raise LedgerCorruptError(
                f"ledger {uri}: expected fragment number {expected}, found {row['seq']} "
                f"({row['fragment']}): a fragment is missing or duplicated")
        hash_before = row_hash(rows[expected - 1]) if expected else ""
        chained = check_link(uri, hash_before, row, chained)
    for mark, name in witnesses:  # before the head: what they name says more
        check_mark(uri, rows, mark, name)
    if head is None and chained:
        raise LedgerCorruptError(
            f"ledger {uri}: its fragments are chained but the head marker HEAD is missing: it "
            "was deleted (with the newest fragments, a truncated ledger would count less)")
    if head is not None:
        check_mark(uri, rows, head, "the head marker")


def check_link(uri: str, hash_before: str, row: dict, chained: bool) -> bool:
    """A chained row must name the hash of the row before it (`hash_before`), and no row may
    be unchained after a chained one (`chained`: whether one was). Returns whether this row
    is chained."""
    if row["prev_hash"] is None:
        if chained:
            raise LedgerCorruptError(
                f"ledger fragment {uri}/{row['fragment']} is unchained (no prev_hash) after "
                "chained fragments: it was rewritten without its hash")
        return False
    if row["prev_hash"] != hash_before:
        raise LedgerCorruptError(
            f"ledger fragment {uri}/{row['fragment']} does not follow the fragment before it: "
            "one of them was edited, replaced or moved")
    return True


def check_mark(uri: str, rows: list[dict], mark: tuple[int, str], name: str) -> None:
    """`name` (the head marker, a witness, a run record) saw row `mark` = (seq, hash): the
    ledger must hold that very row. A seq of -1 names the empty ledger (nothing to hold)."""
    seq, digest = mark
    if seq >= len(rows):
        why = ("the newest were deleted (a truncated ledger would count less than was spent)"
               if name == "the head marker" else OLDER_THAN_WITNESS)
        raise LedgerCorruptError(
            f"ledger {uri}: {name} names fragment {fragment_name(seq)}, but only {len(rows)} "
            f"fragments are there: {why}")
    if seq >= 0 and row_hash(rows[seq]) != digest:
        raise LedgerCorruptError(
            f"ledger fragment {uri}/{rows[seq]['fragment']} is not the one {name} names: it "
            "was edited or replaced, or the ledger restored from another copy")
