"""The budget ledger: an append-only directory of immutable one-row Parquet fragments.

Each change to a budget (opened, reserved, settled, reset) is one fragment
``<ledger>/<budget>/<seq>-<kind>-<id>.parquet``, written to a hidden temporary name and then
renamed, through pyarrow's filesystem layer (a local directory or a URI such as s3://...).
A fragment is complete once its name is visible, so a reservation is durable before the
accountant grants it. Reading checks every fragment: an unreadable one, a gap in the sequence
or a duplicate number is an error that names the file, never a row silently dropped.
"""

from __future__ import annotations

import io
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs

LEDGER_SCHEMA = pa.schema([
    ("seq", pa.int64()),  # 0, 1, 2, ... in the order the accountant decided
    ("budget", pa.string()),
    ("kind", pa.string()),  # open | reserve | settle | reset
    ("request_id", pa.string()),  # the caller's id: a retried call is answered, not redone
    ("owner", pa.string()),  # run or trial spending
    ("reservation", pa.string()),  # id of the reservation a settle row closes
    ("mechanism", pa.string()),  # dpsgd | random_stopping
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
])


class LedgerError(RuntimeError):
    """The ledger cannot be read or written; the message names the path."""


class LedgerCorruptError(LedgerError):
    """A fragment is unreadable or the sequence has a gap: the budget refuses to run on it."""


class BudgetLedger:
    """The fragments of one budget under a ledger root (directory or URI)."""

    def __init__(self, root: str, budget: str, create: bool = True):
        self.uri = f"{root.rstrip('/')}/{budget}"
        try:
            self.filesystem, base = fs.FileSystem.from_uri(as_uri(root))
            self.directory = f"{base.rstrip('/')}/{budget}"
            if create:
                self.filesystem.create_dir(self.directory, recursive=True)
        except (OSError, pa.ArrowInvalid) as error:
            raise LedgerError(f"budget.ledger: cannot use {self.uri}: {error}") from error

    def append(self, row: dict) -> None:
        """Durably add `row` (all LEDGER_SCHEMA fields); raises LedgerError if not written."""
        name = f"{row['seq']:012d}-{row['kind']}-{uuid.uuid4().hex[:8]}.parquet"
        temporary, final = f"{self.directory}/.{name}.tmp", f"{self.directory}/{name}"
        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist([row], schema=LEDGER_SCHEMA), buffer)
        try:
            with self.filesystem.open_output_stream(temporary) as stream:
                stream.write(buffer.getvalue())
            self.filesystem.move(temporary, final)
        except OSError as error:
            raise LedgerError(f"cannot write ledger fragment {self.uri}/{name}: {error}") from error

    def rows(self) -> list[dict]:
        """Every committed row in sequence order, after checking each fragment."""
        selector = fs.FileSelector(self.directory, allow_not_found=True)
        infos = [i for i in self.filesystem.get_file_info(selector)
                 if i.type == fs.FileType.File and not i.base_name.startswith(".")]
        rows = [self._read(info) for info in sorted(infos, key=lambda i: i.base_name)]
        for expected, row in enumerate(rows):
            if row["seq"] != expected:
                raise LedgerCorruptError(
                    f"ledger {self.uri}: expected fragment number {expected}, found "
                    f"{row['seq']} ({row['fragment']}): a fragment is missing or duplicated"
                )
        return rows

    def _read(self, info: fs.FileInfo) -> dict:
        path = f"{self.uri}/{info.base_name}"
        try:
            with self.filesystem.open_input_file(info.path) as stream:
                table = pq.read_table(stream)
        except (OSError, pa.ArrowInvalid) as error:
            raise LedgerCorruptError(f"ledger fragment {path} is unreadable: {error}") from error
        if not table.schema.equals(LEDGER_SCHEMA) or table.num_rows != 1:
            raise LedgerCorruptError(
                f"ledger fragment {path} does not hold exactly one row of the ledger schema"
            )
        row = table.to_pylist()[0]
        if not info.base_name.startswith(f"{row['seq']:012d}-"):
            raise LedgerCorruptError(f"ledger fragment {path} holds row number {row['seq']}")
        row["fragment"] = info.base_name
        return row


def as_uri(path: str) -> str:
    """A local path as a file:// URI; URIs (s3://...) pass unchanged."""
    return path if "://" in path else Path(path).resolve().as_uri()
