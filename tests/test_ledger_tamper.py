"""A ledger that notices its own damage: each kind of damage fails closed with one
line naming the fragment (exit 2), never a lower epsilon, never a grant, never a traceback."""

import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydp_train.budget.accountant import BudgetAccountant
from raydp_train.budget.ledger import LedgerCorruptError
from raydp_train.budget.ledger_reading import budget_status, verify_ledger
from raydp_train.budget.ledger_schema import LEDGER_SCHEMA, UNCHAINED_SCHEMA
from raydp_train.budget.terms import BudgetTerms, Spend
from raydp_train.commands.cli import main

TERMS = BudgetTerms("b", 20.0, 1e-5)
SPEND = Spend(0.02, 1.0, 200)


@pytest.fixture
def ledger(tmp_path):
    """A budget with an open row and three reserve+settle pairs: fragments 0 to 6."""
    accountant = BudgetAccountant(str(tmp_path), TERMS)
    for request in ("a", "b", "c"):
        decision = accountant.reserve(request, f"run-{request}", SPEND)
        accountant.settle(f"{request}-done", decision.reservation, 150)
    return tmp_path / "b"


def fragment(ledger, seq: int):
    return ledger / f"{seq:012d}.parquet"


def rewrite(path, **changes):
    """Write the fragment again with some fields changed, as a careless edit would."""
    table = pq.read_table(path)
    row = {**table.to_pylist()[0], **changes}
    pq.write_table(pa.Table.from_pylist([row], schema=table.schema), path)


def refused(ledger, capsys, match: str):
    """Every way in fails closed with the same one line: status, verify, a new accountant."""
    with pytest.raises(LedgerCorruptError, match=match):
        budget_status("b", str(ledger.parent))
    for view in ("status", "verify"):
        assert main(["budget", view, "b", "--ledger", str(ledger.parent)]) == 2
        output = capsys.readouterr()
        lines = [line for line in (output.out + output.err).splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in lines[0], lines
        assert match.split(".*")[0] in lines[0]
    accountant = BudgetAccountant(str(ledger.parent), TERMS)
    with pytest.raises(LedgerCorruptError):
        accountant.reserve("after-damage", "run-d", SPEND)  # no grant on a damaged ledger


def test_an_intact_ledger_verifies(ledger, capsys):
    assert main(["budget", "verify", "b", "--ledger", str(ledger.parent)]) == 0
    out = capsys.readouterr().out
    assert "7 fragments, 7 linked by their hashes, head marker at fragment 6" in out
    assert verify_ledger("b", str(ledger.parent))["chained"] == 7


def test_the_newest_fragment_deleted_is_noticed(ledger, capsys):
    before = budget_status("b", str(ledger.parent))["epsilon_counted"]
    fragment(ledger, 6).unlink()  # the newest settle: counting it as open would still hold,
    fragment(ledger, 5).unlink()  # but the newest reserve too would count less than spent
    # The witness beside the ledger says it first; without it, the head marker would.
    refused(ledger, capsys, "names fragment 000000000006.parquet, but only 5")
    assert before > 0


def test_a_fragment_replaced_by_a_directory_is_noticed(ledger, capsys):
    fragment(ledger, 3).unlink()
    fragment(ledger, 3).mkdir()
    refused(ledger, capsys, "000000000003.parquet is not a fragment file")


def test_a_fragment_edited_in_the_middle_is_noticed(ledger, capsys):
    rewrite(fragment(ledger, 2), steps=1)  # run-a's settle: 150 steps spent, now 1
    refused(ledger, capsys, "000000000003.parquet does not follow the fragment before it")


def test_the_newest_fragment_edited_is_noticed(ledger, capsys):
    rewrite(fragment(ledger, 6), steps=1)
    refused(ledger, capsys, "000000000006.parquet is not the one the witness .* names")


def test_a_damaged_kind_is_noticed(ledger, capsys):
    rewrite(fragment(ledger, 4), kind="sett1e")
    refused(ledger, capsys, "000000000004.parquet has kind 'sett1e'")


def test_a_budget_folder_replaced_by_a_file_is_noticed(ledger, capsys):
    shutil.rmtree(ledger)
    ledger.write_text("not a ledger")
    with pytest.raises(LedgerCorruptError, match="is not a directory of ledger fragments"):
        budget_status("b", str(ledger.parent))
    assert main(["budget", "status", "b", "--ledger", str(ledger.parent)]) == 2
    output = capsys.readouterr()
    assert len((output.out + output.err).strip().splitlines()) == 1


def test_a_ledger_written_before_the_chain_is_read_and_extended(tmp_path):
    """Fragments of the old schema (no prev_hash) and no head marker: read as they are; the
    next row links to the last old one, and from then on the chain holds."""
    ledger = tmp_path / "b"
    ledger.mkdir()
    accountant = BudgetAccountant(str(tmp_path / "new"), TERMS)
    accountant.reserve("a", "run-a", SPEND)
    for seq in range(2):  # the same rows, as an old version wrote them
        row = pq.read_table(fragment(tmp_path / "new" / "b", seq)).to_pylist()[0]
        del row["prev_hash"]
        pq.write_table(pa.Table.from_pylist([row], schema=UNCHAINED_SCHEMA), fragment(ledger, seq))
    assert verify_ledger("b", str(tmp_path))["chained"] == 0
    BudgetAccountant(str(tmp_path), TERMS).reserve("b", "run-b", SPEND)
    report = verify_ledger("b", str(tmp_path))
    assert (report["fragments"], report["chained"]) == (3, 1)
    assert pq.read_table(fragment(ledger, 2)).schema.equals(LEDGER_SCHEMA)
    rewrite(fragment(ledger, 1), steps=1)  # the old row the first link names: noticed
    with pytest.raises(LedgerCorruptError, match="does not follow"):
        verify_ledger("b", str(tmp_path))


def test_a_row_appended_while_the_ledger_is_read_is_not_taken_for_damage(ledger, monkeypatch):
    """A reader (`budget status` during a sweep) lists the fragments, then a writer commits
    a row and moves the head marker: the reader must see an intact ledger, not a truncated one."""
    from raydp_train.budget.ledger import BudgetLedger

    listing = BudgetLedger._fragments
    writer = BudgetAccountant(str(ledger.parent), TERMS)

    def list_then_let_a_writer_in(self):
        fragments = listing(self)
        monkeypatch.setattr(BudgetLedger, "_fragments", listing)  # one interleaving only
        writer.reserve("during-the-read", "run-e", SPEND)
        return fragments

    monkeypatch.setattr(BudgetLedger, "_fragments", list_then_let_a_writer_in)
    assert len(BudgetLedger(str(ledger.parent), "b", create=False).rows()) == 7
    assert verify_ledger("b", str(ledger.parent))["fragments"] == 8


def test_the_head_marker_never_moves_back_when_two_writers_race(tmp_path, monkeypatch):
    """Writer A read the head and is about to name fragment 1 when writer B names fragment 2:
    A must not move it back to 1, or losing the newest fragment would go unnoticed."""
    import threading

    import raydp_train.budget.ledger as ledger_module
    import raydp_train.budget.ledger_marks as marks_module

    ledger = ledger_module.BudgetLedger(str(tmp_path), "race", create=True)
    a_is_writing, a_may_go = threading.Event(), threading.Event()
    replace = marks_module.replace_durably

    def a_pauses(temporary, path, data):
        if b'"seq": 1' in data:
            a_is_writing.set()
            a_may_go.wait(10)
        replace(temporary, path, data)

    monkeypatch.setattr(marks_module, "replace_durably", a_pauses)
    a = threading.Thread(target=ledger._move_head, args=(1, "a"))
    a.start()
    assert a_is_writing.wait(10)
    b = threading.Thread(target=ledger._move_head, args=(2, "b"))
    b.start()
    b.join(0.5)  # B would be done by now, had it not waited its turn
    a_may_go.set()
    a.join(10)
    b.join(10)
    assert ledger.head() == (2, "b")
