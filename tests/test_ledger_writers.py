"""Several accountants on one ledger, without Ray: the ledger's exclusive create arbitrates.

Oracle: the number of identical reservations that fit, from one accountant alone.
"""

import os
import threading

import pytest

from raydp_train.budget import ledger as ledger_module
from raydp_train.budget.accountant import BudgetAccountant
from raydp_train.budget.book import replay
from raydp_train.budget.ledger import (
    BudgetLedger,
    LedgerCorruptError,
    LedgerError,
    check_ledger_location,
)
from raydp_train.budget.ledger_reading import budget_status, ledger_rows
from raydp_train.budget.terms import BudgetTerms, Spend

SPEND = Spend(0.02, 1.0, 200)  # about 10 fit: few decisions, each one a real race


def _fits(tmp_path, epsilon: float) -> int:
    """How many SPENDs one accountant alone grants within `epsilon`."""
    alone = BudgetAccountant(str(tmp_path / "alone"), BudgetTerms("b", epsilon, 1e-5))
    granted = 0
    while alone.reserve(f"r{granted}", "alone", SPEND).granted:
        granted += 1
    return granted


def _accountants(tmp_path, count: int, epsilon: float) -> list[BudgetAccountant]:
    return [BudgetAccountant(str(tmp_path / "shared"), BudgetTerms("b", epsilon, 1e-5))
            for _ in range(count)]


def test_interleaved_accountants_grant_what_one_would(tmp_path):
    fits = _fits(tmp_path, 6.0)
    first, second = _accountants(tmp_path, 2, 6.0)
    granted = 0
    for turn in range(2 * fits + 2):  # each decides on a view the other has just made stale
        granted += (first, second)[turn % 2].reserve(f"r{turn}", f"w{turn % 2}", SPEND).granted
    assert granted == fits
    rows = ledger_rows("b", str(tmp_path / "shared"))
    assert [row["seq"] for row in rows] == list(range(len(rows)))
    assert sum(row["kind"] == "reserve" for row in rows) == fits
    assert sum(row["kind"] == "open" for row in rows) == 1  # the second one found it opened
    assert budget_status("b", str(tmp_path / "shared")) == first.status() == second.status()


@pytest.mark.thorough
def test_racing_threads_with_their_own_accountants_never_overspend(tmp_path):
    fits = _fits(tmp_path, 8.0)
    accountants = _accountants(tmp_path, 3, 8.0)
    start, granted = threading.Barrier(len(accountants)), []

    def spend_until_refused(number: int, accountant: BudgetAccountant) -> None:
        start.wait()
        for attempt in range(fits + 1):
            decision = accountant.reserve(f"{number}-{attempt}", f"writer-{number}", SPEND)
            granted.append(decision.granted)

    threads = [threading.Thread(target=spend_until_refused, args=(number, accountant))
               for number, accountant in enumerate(accountants)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(granted) == fits
    book = replay(ledger_rows("b", str(tmp_path / "shared")))
    assert len(book.reservations) == fits
    assert book.epsilon <= 8.0


def test_settle_and_reset_made_on_a_stale_view_are_decided_again(tmp_path):
    first, second = _accountants(tmp_path, 2, 20.0)
    reservation = first.reserve("r1", "a", SPEND)
    second.reserve("r2", "b", SPEND)  # `first` has not seen this row
    assert first.settle("s1", reservation.reservation, steps_done=10) == SPEND.steps - 10
    second.reset("x1", "test")  # `second` has not seen the settle
    assert first.status() == second.status() == budget_status("b", str(tmp_path / "shared"))
    assert first.status()["steps_reserved"] == SPEND.steps  # r2 still open, r1 settled+reset


def test_a_plain_replace_instead_of_an_exclusive_create_would_lose_a_row(tmp_path, monkeypatch):
    """The check of the check: with a rename that may replace, the race test's setting breaks."""
    first, second = _accountants(tmp_path, 2, 20.0)
    monkeypatch.setattr(ledger_module, "link_exclusively",
                        lambda temporary, final: os.replace(temporary, final) or True)
    first.reserve("r1", "a", SPEND)
    second.reserve("r2", "b", SPEND)  # replaces r1's fragment: r1's grant is gone
    # ... and the witness and head marker, which name r1's fragment, notice: it fails closed.
    with pytest.raises(LedgerCorruptError, match="000000000001.parquet is not the one the "
                                                 "witness .* names"):
        ledger_rows("b", str(tmp_path / "shared"))


def test_a_retransmitted_link_that_succeeded_counts_as_committed(tmp_path, monkeypatch):
    """NFS may answer EEXIST to a link it made: the temporary file's link count decides."""
    real_link = os.link

    def link_then_report_exists(source, target):
        real_link(source, target)
        raise FileExistsError(17, "File exists", target)

    (accountant,) = _accountants(tmp_path, 1, 20.0)
    monkeypatch.setattr(ledger_module.os, "link", link_then_report_exists)
    assert accountant.reserve("r1", "a", SPEND).granted
    monkeypatch.undo()
    assert [row["kind"] for row in ledger_rows("b", str(tmp_path / "shared"))] == ["open",
                                                                                   "reserve"]


@pytest.mark.parametrize("uri", ["s3://bucket/ledgers", "gs://bucket/ledgers"])
def test_an_object_store_ledger_is_refused_for_writing(uri):
    expected = f"budget.ledger: {uri}: a {uri[:2]}:// ledger cannot create a fragment exclusively"
    with pytest.raises(LedgerError, match=expected):
        check_ledger_location(uri)
    with pytest.raises(LedgerError, match=expected):
        BudgetLedger(uri, "b")  # before any filesystem is contacted
    with pytest.raises(LedgerError, match=expected):
        BudgetAccountant(uri, BudgetTerms("b", 5.0, 1e-5)).reserve("r1", "a", SPEND)


def test_ledger_on_a_filesystem_without_hard_links_is_refused_before_any_grant(tmp_path,
                                                                               monkeypatch):
    def no_hard_links(source, target):
        raise PermissionError(1, "Operation not permitted", target)

    monkeypatch.setattr(ledger_module.os, "link", no_hard_links)
    accountant = BudgetAccountant(str(tmp_path), BudgetTerms("b", 5.0, 1e-5))
    with pytest.raises(LedgerError, match="has no hard links"):
        accountant.status()
    with pytest.raises(LedgerError, match="has no hard links"):
        accountant.reserve("r1", "a", SPEND)


def test_fragments_named_before_exclusive_creates_are_still_read(tmp_path):
    (accountant,) = _accountants(tmp_path, 1, 20.0)
    accountant.reserve("r1", "a", SPEND)
    directory = tmp_path / "shared" / "b"
    for fragment in directory.glob("*.parquet"):  # <seq>-<kind>-<id>.parquet, as before
        fragment.rename(directory / f"{fragment.stem}-reserve-0a1b2c3d.parquet")
    (reopened,) = _accountants(tmp_path, 1, 20.0)
    assert reopened.reserve("r2", "b", SPEND).granted
    assert [row["seq"] for row in ledger_rows("b", str(tmp_path / "shared"))] == [0, 1, 2]
