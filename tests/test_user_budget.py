"""A budget keeps one unit (ARCHITECTURE.md §2.14): a per-user run cannot spend from a
per-example budget, nor the reverse, refused by name before anything is reserved; a per-user
budget's ledger says so, and a per-example budget's fragments keep their old format."""

import pyarrow.parquet as pq
import pytest

from raydp_train.budget.accountant import BudgetAccountant
from raydp_train.budget.ledger_reading import book_of, budget_status, verify_ledger
from raydp_train.budget.ledger_schema import LEDGER_SCHEMA, UNIT_SCHEMA
from raydp_train.budget.terms import BudgetError, BudgetTerms, Spend
from raydp_train.config.budget import BudgetConfig
from raydp_train.reports.budget import status_text


def budget_config(tmp_path):
    return BudgetConfig(name="b", epsilon=10.0, delta=1e-5, ledger=str(tmp_path))


@pytest.mark.parametrize("held, asked", [("example", "user"), ("user", "example")])
def test_a_budget_refuses_a_run_of_another_unit_by_name(tmp_path, held, asked):
    budget = BudgetAccountant(str(tmp_path), BudgetTerms("b", 10.0, 1e-5, "rdp", held))
    budget.reserve("r1", "run-1", Spend(0.01, 1.0, 10))
    rows_before = len(list(tmp_path.rglob("*.parquet")))
    with pytest.raises(BudgetError, match=f"privacy.unit: budget 'b' counts epsilon per {held}; "
                                          f"this pipeline spends per {asked}"):
        book_of(budget_config(tmp_path), unit=asked)
    with pytest.raises(BudgetError, match=f"counts epsilon per {held}"):
        budget.check_terms(BudgetTerms("b", 10.0, 1e-5, "rdp", asked), str(tmp_path))
    assert len(list(tmp_path.rglob("*.parquet"))) == rows_before  # nothing reserved
    assert book_of(budget_config(tmp_path), unit=held).status()["steps_reserved"] == 10


def test_status_says_per_user_and_the_ledger_verifies(tmp_path):
    budget = BudgetAccountant(str(tmp_path), BudgetTerms("b", 10.0, 1e-5, "rdp", "user"))
    budget.reserve("r1", "run-1", Spend(0.01, 1.0, 10))
    status = budget_status("b", str(tmp_path))
    assert status["unit"] == "user"
    assert "per user" in status_text(status).splitlines()[0]
    assert verify_ledger("b", str(tmp_path))["chained"] == 2
    fragments = sorted((tmp_path / "b").glob("*.parquet"))
    assert all(pq.read_schema(f).equals(UNIT_SCHEMA) for f in fragments)


def test_a_per_example_budget_writes_the_format_it_always_wrote(tmp_path):
    budget = BudgetAccountant(str(tmp_path), BudgetTerms("b", 10.0, 1e-5, "rdp"))
    budget.reserve("r1", "run-1", Spend(0.01, 1.0, 10))
    fragments = sorted((tmp_path / "b").glob("*.parquet"))
    assert fragments and all(pq.read_schema(f).equals(LEDGER_SCHEMA) for f in fragments)
    assert "per example" in status_text(budget_status("b", str(tmp_path)))
