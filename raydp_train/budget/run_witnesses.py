"""Run records as witnesses of their budget's ledger. A run's `record.json` keeps, under
`budget`, the ledger row its accountant had reached when the run ended (`ledger_head`: seq and
hash) and the steps and releases it charged as `owner`. A ledger that lacks that row is older
than the run (restored from an older copy) and is refused before anything is granted; `budget
verify --runs DIR` also compares what each run charged with what the ledger counts for it."""

from __future__ import annotations

import json
from pathlib import Path

from raydp_train.budget.ledger import BudgetLedger, LedgerCorruptError, as_uri
from raydp_train.budget.ledger_chain import check_mark

RECORD = "record.json"


def budget_witness(name: str, ledger: str, owner: str, charged: tuple[int, int],
                   head: tuple[int, str]) -> dict:
    """What a run record keeps of its budget (under the key `budget`)."""
    return {"name": name, "ledger": as_uri(ledger), "owner": owner,
            "steps_charged": int(charged[0]), "releases_charged": int(charged[1]),
            "ledger_head": {"seq": int(head[0]), "hash": head[1]}}


def run_records(folder: str, name: str, ledger: str, deep: bool = False) -> list[tuple[Path, dict]]:
    """(record path, its `budget` entry) of each run record under `folder` (its run
    directories, or any depth with `deep`) that spent from budget `name` in `ledger`."""
    if "://" in folder or not Path(folder).is_dir():
        return []
    pattern = f"**/{RECORD}" if deep else f"*/{RECORD}"
    found = []
    for path in sorted(Path(folder).glob(pattern)):
        entry = _budget_entry(path)
        if entry and entry.get("name") == name and entry.get("ledger") == as_uri(ledger):
            found.append((path, entry))
    return found


def check_against_runs(name: str, ledger: str, folder: str) -> list[dict]:
    """The ledger's rows, refused (LedgerCorruptError naming the record) if a run record
    under `folder` saw a row the ledger does not hold."""
    reader = BudgetLedger(as_uri(ledger), name, create=False)
    rows = reader.rows()
    for path, entry in run_records(folder, name, ledger):
        check_mark(reader.uri, rows, _head_of(entry), f"the run record {path}")
    return rows


def differences_with_runs(name: str, ledger: str, folder: str) -> tuple[int, list[str]]:
    """(run records compared, one line per difference between them and the ledger)."""
    reader = BudgetLedger(as_uri(ledger), name, create=False)
    rows = reader.rows()
    counted = counted_per_owner(rows)
    records = run_records(folder, name, ledger, deep=True)
    differences = []
    for path, entry in records:
        try:
            check_mark(reader.uri, rows, _head_of(entry), f"the run record {path}")
        except LedgerCorruptError as error:
            differences.append(str(error))
        owner, charged = entry["owner"], (entry["steps_charged"], entry["releases_charged"])
        if owner not in counted:
            differences.append(f"run record {path}: {owner} charged {charged[0]} steps, but the "
                               "ledger has no reservation of it")
        elif counted[owner] != charged:
            differences.append(
                f"run record {path}: {owner} charged {charged[0]} steps and {charged[1]} "
                f"releases, the ledger counts {counted[owner][0]} and {counted[owner][1]}")
    return len(records), differences


def counted_per_owner(rows: list[dict]) -> dict[str, tuple[int, int]]:
    """(steps, releases) each owner's reservations count over the whole ledger, resets
    ignored: settled ones what they used, open ones in full."""
    held: dict[str, tuple[str, int, int]] = {}
    for row in rows:
        if row["kind"] in ("reserve", "settle"):
            held[row["reservation"]] = (row["owner"], row["steps"], row["releases"])
    counted: dict[str, tuple[int, int]] = {}
    for owner, steps, releases in held.values():
        before = counted.get(owner, (0, 0))
        counted[owner] = (before[0] + steps, before[1] + releases)
    return counted


def _budget_entry(path: Path) -> dict | None:
    try:
        entry = json.loads(path.read_text()).get("budget")
        _head_of(entry)
        return entry
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None  # unreadable, or written before records kept their budget's head


def _head_of(entry: dict) -> tuple[int, str]:
    return int(entry["ledger_head"]["seq"]), str(entry["ledger_head"]["hash"])
