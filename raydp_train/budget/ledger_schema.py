"""A ledger row as stored: the one-row Parquet schema of a fragment (with the hash chain's
`prev_hash`, and the schema of ledgers written before it), the row kinds, a fragment's
name, and the SHA-256 of a row that links it to the next (budget/ledger.py)."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa

LEDGER_SCHEMA = pa.schema([
    ("seq", pa.int64()),  # 0, 1, 2, ... in the order the accountant decided
    ("budget", pa.string()),
    ("kind", pa.string()),  # open | reserve | settle | reset
    ("request_id", pa.string()),  # the caller's id: a retried call is answered, not redone
    ("owner", pa.string()),  # run or trial spending
    ("reservation", pa.string()),  # id of the reservation a settle row closes
    ("mechanism", pa.string()),  # dpsgd | lsg | ... ("random_stopping" in old ledgers)
    ("sampling_rate", pa.float64()),
    ("noise_multiplier", pa.float64()),
    ("steps", pa.int64()),  # reserve: steps asked; settle: steps actually run
    ("release_noise_multiplier", pa.float64()),  # noisy metric releases (0: none)
    ("releases", pa.int64()),
    ("mean_trials", pa.float64()),  # random_stopping only
    ("shape", pa.float64()),
    ("budget_epsilon", pa.float64()),  # the budget's fixed terms, on every row
    ("budget_delta", pa.float64()),
    ("accountant", pa.string()),
    ("timestamp", pa.float64()),
    ("running_epsilon", pa.float64()),  # epsilon of everything counted after this row
    ("prev_hash", pa.string()),  # SHA-256 of the row before ("" for the first): the chain
])
# Ledgers written before the chain: read alike, their rows linked by no hash.
UNCHAINED_SCHEMA = pa.schema([f for f in LEDGER_SCHEMA if f.name != "prev_hash"])
# A per-user budget's rows (privacy.unit user) carry its unit; a per-example budget's rows are
# written as before it existed, so older ledgers read and hash unchanged.
UNIT_SCHEMA = pa.schema([*LEDGER_SCHEMA, ("unit", pa.string())])
KINDS = ("open", "reserve", "settle", "reset")
SEQ_DIGITS = 12


def schema_of(row: dict) -> pa.Schema:
    """The schema a row is stored in: with its unit only for a per-user budget."""
    return UNIT_SCHEMA if row.get("unit") is not None else LEDGER_SCHEMA


def row_hash(row: dict) -> str:
    """SHA-256 of a row's recorded fields (its link to the row before included)."""
    schema = schema_of(row)
    fields = {field.name: _as_stored(field.type, row.get(field.name)) for field in schema}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _as_stored(kind: pa.DataType, value):
    """A value as Parquet gives it back (1 written to a float column reads as 1.0)."""
    if value is None:
        return None
    if pa.types.is_floating(kind):
        return float(value)
    return int(value) if pa.types.is_integer(kind) else str(value)


def fragment_name(seq: int) -> str:
    return f"{seq:0{SEQ_DIGITS}d}.parquet"
