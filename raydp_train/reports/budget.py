"""`raydp-train budget status | history`: a budget's ledger as people read it.

Reads the ledger directly (no Ray, no actor), so it works on any machine that can reach the
ledger's directory or bucket, and on a ledger whose budget is not running.
"""

from __future__ import annotations

import json
import time

from raydp_train.privacy.budget import (
    BudgetBook,
    BudgetError,
    BudgetTerms,
    check_same_terms,
    replay,
)
from raydp_train.privacy.ledger import BudgetLedger, as_uri

HISTORY_COLUMNS = ("seq", "time", "kind", "owner", "mechanism", "sampling_rate",
                   "noise_multiplier", "steps", "releases", "running_epsilon")


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
    return {"ledger": reader.uri, "fragments": len(rows),
            "chained": sum(row["prev_hash"] is not None for row in rows),
            "head": None if head is None else f"fragment {head[0]} (sha256 {head[1][:12]}...)"}


def budget_status(name: str, ledger: str) -> dict:
    rows = ledger_rows(name, ledger)
    return replay(rows).status()


def book_of(config) -> BudgetBook:
    """A pipeline's budget (its `budget` section) as its ledger has it now, read without Ray:
    a fresh book if it has no ledger yet; other terms than it was created with are refused,
    as its accountant would."""
    terms = BudgetTerms(config.name, config.epsilon, config.delta, config.accountant)
    rows = BudgetLedger(as_uri(config.ledger), config.name, create=False).rows()
    book = replay(rows, terms)
    check_same_terms(terms, book.terms)
    return book


def status_text(status: dict) -> str:
    lines = [
        (f"budget {status['name']}: epsilon {status['epsilon_counted']:.4f} of "
         f"{status['epsilon']:g} counted, {status['epsilon_remaining']:.4f} remaining "
         f"(delta {status['delta']:g}, {status['accountant'].upper()})"),
        f"steps spent {status['steps_spent']}, reserved (open) {status['steps_reserved']}",
    ]
    if status["resets"]:
        lines.append(f"reset {status['resets']} time(s): spending settled before the last "
                     "reset is not counted (see `budget history`)")
    width = max([len("owner"), *map(len, status["owners"])])
    lines.append(f"{'owner':<{width}} {'spent':>8} {'reserved':>9} {'releases':>9} {'open':>5}")
    for owner, entry in sorted(status["owners"].items()):
        lines.append(f"{owner:<{width}} {entry['steps_spent']:>8} {entry['steps_reserved']:>9} "
                     f"{entry['releases']:>9} {entry['open_reservations']:>5}")
    return "\n".join(lines)


def history_text(rows: list[dict]) -> str:
    owner_width = max([len("epsilon=1e+06 delta=1e-05"), *(len(r["owner"]) for r in rows)])
    widths = (4, 19, 7, owner_width, 15, 13, 16, 6, 8, 15)
    lines = ["  ".join(f"{c:<{w}}" for c, w in zip(HISTORY_COLUMNS, widths, strict=True))]
    for row in rows:
        cells = {**row, "time": time.strftime("%Y-%m-%d %H:%M:%S",
                                               time.localtime(row["timestamp"]))}
        if row["kind"] == "open":
            cells.update(owner=f"epsilon={row['budget_epsilon']:g} delta={row['budget_delta']:g}",
                         mechanism=row["accountant"], sampling_rate="", noise_multiplier="",
                         steps="", releases="")
        elif row["kind"] == "reset":
            cells.update(mechanism="", sampling_rate="", noise_multiplier="", steps="",
                         releases="")
        lines.append("  ".join(_cell(cells[c], w) for c, w in zip(HISTORY_COLUMNS, widths,
                                                                   strict=True)))
    return "\n".join(lines)


def as_json(value) -> str:
    return json.dumps(value, indent=2, default=str)


def _cell(value, width: int) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    return f"{text:<{width}}"
