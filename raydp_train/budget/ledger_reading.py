"""A budget's ledger read directly, without Ray or its accountant actor: its rows, its status,
a pipeline's book, a check of its chain. So `raydp-train budget` works on any machine that can
reach the ledger's directory or bucket, and on a ledger whose budget is not running."""

from __future__ import annotations

from raydp_train.budget.book import BudgetBook, check_same_terms, replay
from raydp_train.budget.ledger import BudgetLedger, as_uri
from raydp_train.budget.run_witnesses import check_against_runs
from raydp_train.budget.terms import BudgetError, BudgetTerms


def ledger_rows(name: str, ledger: str) -> list[dict]:
    rows = BudgetLedger(as_uri(ledger), name, create=False).rows()
    if not rows:
        raise BudgetError(f"no budget named '{name}' in ledger {ledger}")
    return rows


def verify_ledger(name: str, ledger: str) -> dict:
    """Read every fragment and check the chain and the head marker (raises on any damage)."""
    reader = BudgetLedger(as_uri(ledger), name, create=False)
    rows = ledger_rows(name, ledger)
    head = reader.head()
    witness = reader.witness.read() if reader.witness is not None else None
    return {"ledger": reader.uri, "fragments": len(rows),
            "chained": sum(row["prev_hash"] is not None for row in rows),
            "head": None if head is None else f"fragment {head[0]} (sha256 {head[1][:12]}...)",
            "witness": None if witness is None else f"fragment {witness[0]} ({reader.witness.path})"}


def budget_status(name: str, ledger: str) -> dict:
    rows = ledger_rows(name, ledger)
    return replay(rows).status()


def book_of(config, runs_folder: str = "", unit: str = "example") -> BudgetBook:
    """A pipeline's budget (its `budget` section) as its ledger has it now, read without Ray:
    a fresh book if it has no ledger yet; other terms than it was created with are refused,
    as its accountant would; so is a ledger older than a run record in `runs_folder` (the
    pipeline's run.output_dir) or than the witness beside it."""
    terms = BudgetTerms(config.name, config.epsilon, config.delta, config.accountant, unit)
    rows = check_against_runs(config.name, config.ledger, runs_folder)
    book = replay(rows, terms)
    check_same_terms(terms, book.terms)
    return book
