"""A ledger older than what was seen of it is refused: the witness beside the
ledger and each run record name the newest row they saw; a ledger restored from an older
copy, or its tail deleted with its head marker, or rows rewritten without their hashes, fails
closed in one line naming the witness, before anything more is granted."""

import json
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydp_train.budget.accountant import BudgetAccountant
from raydp_train.budget.ledger import LedgerCorruptError
from raydp_train.budget.ledger_reading import book_of, budget_status
from raydp_train.budget.ledger_schema import UNCHAINED_SCHEMA
from raydp_train.budget.run_witnesses import budget_witness, check_against_runs
from raydp_train.budget.terms import BudgetTerms, Spend
from raydp_train.commands.cli import main
from raydp_train.config.budget import BudgetConfig

TERMS = BudgetTerms("bt", 2.1, 1e-5)
SPEND = Spend(0.01, 1.1, 25)  # one run of 25 steps


def spend_runs(root, owners) -> BudgetAccountant:
    accountant = BudgetAccountant(str(root), TERMS)
    for owner in owners:
        decision = accountant.reserve(f"{owner}-r", owner, SPEND)
        assert decision.granted, decision.reason
        accountant.settle(f"{owner}-s", decision.reservation, SPEND.steps)
    return accountant


def fragment(budget_dir, seq: int):
    return budget_dir / f"{seq:012d}.parquet"


def one_line_refusal(root, capsys, match: str) -> None:
    """status and verify each refuse in one line (exit 2); a new accountant grants nothing;
    validate's read of the book refuses."""
    with pytest.raises(LedgerCorruptError, match=match):
        budget_status("bt", str(root))
    for view in ("status", "verify"):
        assert main(["budget", view, "bt", "--ledger", str(root)]) == 2
        output = capsys.readouterr()
        lines = [line for line in (output.out + output.err).splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in lines[0], lines
        assert re.search(match, lines[0]), lines[0]
    with pytest.raises(LedgerCorruptError, match=match):
        BudgetAccountant(str(root), TERMS).reserve("after", "run-x", SPEND)
    config = BudgetConfig(name="bt", epsilon=2.1, delta=1e-5, ledger=str(root))
    with pytest.raises(LedgerCorruptError, match=match):
        book_of(config)


def test_a_ledger_restored_from_an_older_copy_is_refused_before_any_grant(tmp_path, capsys):
    """The reproduction: copy after run 1, two more runs, the copy put back."""
    root = tmp_path / "LT"
    spend_runs(root, ["run-1"])
    shutil.copytree(root, tmp_path / "LT_after1")
    spend_runs(root, ["run-2"])
    before = budget_status("bt", str(root))["epsilon_counted"]
    shutil.rmtree(root)
    shutil.copytree(tmp_path / "LT_after1", root)
    witness = tmp_path / "LT.witness" / "bt.json"
    assert json.loads(witness.read_text())["seq"] == 4
    one_line_refusal(root, capsys, f"the witness {witness} names fragment 000000000004.parquet, "
                                   "but only 3 fragments are there")
    assert len(list((root / "bt").glob("*.parquet"))) == 3  # nothing granted on it
    assert before > 0.8


def test_a_ledger_deleted_whole_is_refused(tmp_path):
    root = tmp_path / "LT"
    spend_runs(root, ["run-1"])
    shutil.rmtree(root / "bt")
    with pytest.raises(LedgerCorruptError, match="names fragment 000000000002.parquet, but only "
                                                 "0 fragments"):
        BudgetAccountant(str(root), TERMS).reserve("again", "run-2", SPEND)


def test_the_newest_fragments_deleted_with_the_head_marker_are_refused(tmp_path, capsys):
    root = tmp_path / "LT"
    spend_runs(root, ["run-1", "run-2"])
    for seq in (3, 4):
        fragment(root / "bt", seq).unlink()
    (root / "bt" / "HEAD").unlink()
    one_line_refusal(root, capsys, "the witness .* names fragment 000000000004.parquet")
    (tmp_path / "LT.witness" / "bt.json").unlink()  # the witness gone too: the chain says so
    one_line_refusal(root, capsys, "its fragments are chained but the head marker HEAD is "
                                   "missing")


def unchain(path) -> None:
    """The fragment written again in the format before the chain (no prev_hash)."""
    row = pq.read_table(path).to_pylist()[0]
    del row["prev_hash"]
    pq.write_table(pa.Table.from_pylist([row], schema=UNCHAINED_SCHEMA), path)


def test_unchained_rows_after_chained_ones_are_refused(tmp_path, capsys):
    root = tmp_path / "LT"
    spend_runs(root, ["run-1", "run-2"])
    for seq in (3, 4):
        unchain(fragment(root / "bt", seq))
    (root / "bt" / "HEAD").unlink()
    (tmp_path / "LT.witness" / "bt.json").unlink()
    one_line_refusal(root, capsys, "000000000003.parquet is unchained .no prev_hash. after "
                                   "chained fragments")


def test_every_row_unchained_is_refused_by_the_witness(tmp_path, capsys):
    root = tmp_path / "LT"
    spend_runs(root, ["run-1"])
    for seq in range(3):
        unchain(fragment(root / "bt", seq))
    (root / "bt" / "HEAD").unlink()
    one_line_refusal(root, capsys, "000000000002.parquet is not the one the witness")


def test_a_run_record_is_a_witness_of_its_ledger(tmp_path, capsys):
    """The witness beside the ledger restored too (the whole parent folder): the run records
    still see the newer ledger; `budget verify --runs` names each difference."""
    root, runs = tmp_path / "LT", tmp_path / "runsT"
    accountant = spend_runs(root, ["run-1"])
    shutil.copytree(root, tmp_path / "old")
    shutil.copytree(tmp_path / "LT.witness", tmp_path / "old.witness")
    for owner in ("run-1", "run-2"):
        if owner == "run-2":
            spend_runs(root, ["run-2"])
        (runs / owner).mkdir(parents=True)
        entry = budget_witness("bt", str(root), owner, (25, 0), accountant.head())
        (runs / owner / "record.json").write_text(json.dumps({"budget": entry}))
    assert main(["budget", "verify", "bt", "--ledger", str(root), "--runs", str(runs)]) == 0
    assert "2 run records under" in capsys.readouterr().out
    for name in ("LT", "LT.witness"):
        shutil.rmtree(tmp_path / name)
        shutil.copytree(tmp_path / name.replace("LT", "old"), tmp_path / name)
    assert budget_status("bt", str(root))["epsilon_counted"] > 0  # the witness agrees with it
    record = runs / "run-2" / "record.json"
    with pytest.raises(LedgerCorruptError, match=f"the run record {record} names fragment"):
        check_against_runs("bt", str(root), str(runs))
    config = BudgetConfig(name="bt", epsilon=2.1, delta=1e-5, ledger=str(root))
    with pytest.raises(LedgerCorruptError, match="the run record"):
        book_of(config, str(runs))
    assert main(["budget", "verify", "bt", "--ledger", str(root), "--runs", str(runs)]) == 2
    output = capsys.readouterr()
    assert f"the run record {record} names fragment 000000000004.parquet" in output.err
    assert "run-2 charged 25 steps, but the ledger has no reservation of it" in output.err
    assert "(2 differences, above): DIFFERS" in output.out
