"""The budget ledger: an append-only directory of immutable one-row Parquet fragments.

Each change to a budget (opened, reserved, settled, reset) is one fragment
``<ledger>/<budget>/<seq>.parquet``. The ledger itself arbitrates between writers: a fragment
is committed by an EXCLUSIVE create of its sequence number, so of two writers (two actors, two
clusters, two embedded runs) that decided row n on the same view, exactly one commits it and
the other is told so (`FragmentTaken`), reads what it missed and decides again. A plain
rename would let the second replace or duplicate the first: the overspend this prevents.

How the exclusive create is made, and where it holds:

- local disk: the row is written to a hidden temporary file, flushed to disk, and hard-linked
  to its final name; link(2) fails if the name exists, and the fragment is complete the moment
  its name is visible.
- NFS (v3 and v4, close-to-open consistency, the default): link(2) is exclusive on the server,
  but a retransmitted link may report "exists" for a link that succeeded, so a failed link is
  judged by the temporary file's link count (the recipe of open(2)). Missed fragments are read
  by name, not from a possibly cached directory listing.
- object stores (s3://, gs://, ...): only a conditional put ("create if absent") is exclusive,
  and pyarrow's filesystems do not expose one: such a ledger is refused for writing. They can
  still be read (`raydp-train budget status`).

Reading checks every fragment: an unreadable one, a gap in the sequence or a duplicate number
is an error that names the file, never a row silently dropped. Fragments named
``<seq>-<kind>-<id>.parquet`` (written before exclusive creates) are read alike.

The ledger is tamper-evident. Each fragment carries the SHA-256 of the row before it
(`prev_hash`: a hash chain), so a fragment edited, replaced or moved breaks the link to the
next one; and after each commit the writer points the head marker ``HEAD`` (the newest
sequence number and its row's hash, replaced atomically, never moved back) at it, so a
missing tail (the newest fragments deleted, a backup restored) is noticed: fewer fragments
than the marker names. Each commit also advances a witness kept OUTSIDE the ledger's folder
(``<ledger>.witness/<budget>.json``, budget/ledger_marks.py), so a ledger restored from an
older copy, or its tail deleted together with its marker, is older than its witness. Once a
row is chained, a missing marker or an unchained row after it is damage. Each fails closed,
naming the fragment and the marker or witness (budget/ledger_chain.py). What it cannot
notice: a writer who rewrites the ledger, its witness and the run records together, or an
unchained (pre-chain) ledger rewritten whole where no witness was ever written.
"""

from __future__ import annotations

import io
import os
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pyarrow import fs

from raydp_train.budget.exclusive_files import (
    NO_HARD_LINKS,
    link_exclusively,
    remove_quietly,
    sync_directory,
    write_durably,
)
from raydp_train.budget.ledger_chain import (
    LedgerCorruptError,
    LedgerError,
    check_link,
    check_rows,
)
from raydp_train.budget.ledger_marks import Mark, MarkUnreadable, witness_of
from raydp_train.budget.ledger_schema import (
    KINDS,
    LEDGER_SCHEMA,
    SEQ_DIGITS,
    UNCHAINED_SCHEMA,
    UNIT_SCHEMA,
    fragment_name,
    row_hash,
    schema_of,
)

HEAD = "HEAD"  # the head marker: {"seq": newest, "hash": its row's hash}
__all__ = ["BudgetLedger", "FragmentTaken", "LedgerCorruptError", "LedgerError", "as_uri"]


class FragmentTaken(LedgerError):
    """Another writer committed this sequence number first: read its row, then decide again."""


def check_ledger_location(root: str) -> None:
    """Refuse a ledger whose filesystem cannot create a fragment exclusively (see above).

    Looks at the location only (no filesystem is contacted), so it can run before anything
    is created or reserved."""
    scheme = root.split("://", 1)[0].lower() if "://" in root else "file"
    if scheme != "file":
        raise LedgerError(
            f"budget.ledger: {root}: a {scheme}:// ledger cannot create a fragment "
            "exclusively (an object store needs a conditional put, which pyarrow does not "
            "offer), so two writers could both spend the same budget. Use a local directory, "
            "or a shared POSIX file system (NFS) mounted at the same path on every node")


MAX_BUDGET_NAME = 200  # its witness, lock and temporary files stay within 255 bytes a name


def check_budget_name(budget: str) -> None:
    """A budget name is one folder name, short enough for the files named after it."""
    if "/" in budget or budget in ("", ".", "..") or len(os.fsencode(budget)) > MAX_BUDGET_NAME:
        raise LedgerError(f"budget name {budget[:24]!r}{'...' if len(budget) > 24 else ''}: "
                          f"must be one folder name of at most {MAX_BUDGET_NAME} bytes "
                          f"(letters, digits, '_', '.', '-'), got {len(os.fsencode(budget))}")


class BudgetLedger:
    """The fragments of one budget under a ledger root (directory or URI).

    `create=True` (a writer) needs a filesystem with exclusive creates; reading needs none.
    """

    def __init__(self, root: str, budget: str, create: bool = True):
        check_budget_name(budget)
        self.uri = f"{root.rstrip('/')}/{budget}"
        if create:
            check_ledger_location(root)
        self.filesystem, base = _location(root)
        self.directory = f"{base.rstrip('/')}/{budget}"
        if create:
            self._make_directory()
        self._newest: tuple[int, str] | None = None  # (seq, hash) of the newest row seen
        self._head = Mark(self.filesystem, f"{self.directory}/{HEAD}", f"the head marker {HEAD}")
        self.witness = witness_of(self.filesystem, base, budget)
        self._head_written = False  # known to exist: this writer wrote it

    def append(self, row: dict) -> None:
        """Durably commit `row` as fragment number row['seq'].

        Raises FragmentTaken if another writer committed that number first (this row is then
        not in the ledger), LedgerError if the row could not be made durable (the caller
        grants nothing; should its fragment have landed all the same, a writer reads it the
        next time the number is taken, and it counts, conservatively)."""
        name = fragment_name(row["seq"])
        row["prev_hash"] = self._hash_before(row["seq"])
        if not self._head_written and self.head() is None:
            # A chained row never stands without a head marker: name the row before it first.
            self._advance(self._head, row["seq"] - 1, row["prev_hash"])
        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist([row], schema=schema_of(row)), buffer)
        temporary = f"{self.directory}/.{name}.{uuid.uuid4().hex}.tmp"
        try:
            write_durably(temporary, buffer.getvalue())
            committed = link_exclusively(temporary, f"{self.directory}/{name}")
            if committed:
                sync_directory(self.directory)
        except OSError as error:
            raise LedgerError(self._write_problem(name, error)) from error
        finally:
            remove_quietly(temporary)
        if not committed:
            raise FragmentTaken(f"ledger {self.uri}: fragment {name} was committed by another "
                                "writer")
        self._newest = (row["seq"], row_hash(row))
        self._move_head(*self._newest)
        if self.witness is not None:
            self._advance(self.witness, *self._newest)

    def rows(self) -> list[dict]:
        """Every committed row in sequence order, after checking each fragment, the chain
        of hashes that links them, the head marker and the witness beside the ledger."""
        # The marks before the listing: a writer commits a fragment before it advances the
        # head, and the head before the witness, so a row appended while we read can never
        # look like a deleted one.
        witness = self._read_mark(self.witness) if self.witness is not None else None
        head = self.head()
        rows = [self._read(info.path, info.base_name) for info in self._fragments()]
        check_rows(self.uri, rows, head,
                   () if witness is None else ((witness, self.witness.shown),))
        if rows and rows[-1]["prev_hash"] is not None:
            self._newest = (rows[-1]["seq"], row_hash(rows[-1]))
        return rows

    def head(self) -> tuple[int, str] | None:
        """The head marker: (newest sequence number, its row's hash), or None if there is none."""
        return self._read_mark(self._head)

    def _read_mark(self, mark: Mark) -> tuple[int, str] | None:
        try:
            return mark.read()
        except MarkUnreadable as error:
            raise LedgerCorruptError(f"ledger {self.uri}: {error}") from error

    def _fragments(self) -> list[fs.FileInfo]:
        """The fragment files in name order; anything else there (a directory where a
        fragment should be) is an error that names it."""
        selector = fs.FileSelector(self.directory, allow_not_found=True)
        try:
            infos = self.filesystem.get_file_info(selector)
        except OSError as error:  # e.g. a file where the budget's directory should be
            raise LedgerCorruptError(f"budget.ledger: cannot read {self.uri}: it is not a "
                                     "directory of ledger fragments") from error
        fragments = []
        for info in sorted(infos, key=lambda i: i.base_name):
            if info.base_name.startswith(".") or info.base_name == HEAD:
                continue
            if info.type != fs.FileType.File or not info.base_name.endswith(".parquet"):
                raise LedgerCorruptError(f"ledger {self.uri}: {info.base_name} is not a "
                                         "fragment file: the ledger was altered")
            fragments.append(info)
        return fragments

    def hash_of(self, seq: int) -> str:
        """The hash of row `seq`."""
        return self._hash_before(seq + 1)

    def _hash_before(self, seq: int) -> str:
        """The hash of row `seq - 1` ("" for the first), as the chain needs it."""
        if seq == 0:
            return ""
        if self._newest is not None and self._newest[0] == seq - 1:
            return self._newest[1]
        name = fragment_name(seq - 1)
        return row_hash(self._read(f"{self.directory}/{name}", name))

    def _move_head(self, seq: int, digest: str) -> None:
        """Point the head marker at fragment `seq`, unless it already names a newer one."""
        self._advance(self._head, seq, digest)
        self._head_written = True

    def _advance(self, mark: Mark, seq: int, digest: str) -> None:
        try:
            mark.advance(seq, digest)
        except (OSError, MarkUnreadable) as error:
            raise LedgerError(f"ledger {self.uri}: cannot write {mark.shown}: {error}") from error

    def rows_from(self, seq: int) -> list[dict]:
        """The rows committed from number `seq` on (what a writer that lost a race missed).

        Read by name, one after the other, so a stale directory listing (NFS) cannot hide one."""
        rows: list[dict] = []
        # Written by this version, or read whole before: whether the row before is chained.
        chained = seq > 0 and self._newest is not None
        while True:
            name = fragment_name(seq + len(rows))
            path = f"{self.directory}/{name}"
            if self.filesystem.get_file_info(path).type != fs.FileType.File:
                return rows
            row = self._read(path, name)
            hash_before = row_hash(rows[-1]) if rows else self._hash_before(seq)
            chained = check_link(self.uri, hash_before, row, chained)
            rows.append(row)
            if chained:
                self._newest = (row["seq"], row_hash(row))

    def _read(self, path: str, name: str) -> dict:
        shown = f"{self.uri}/{name}"
        try:
            with self.filesystem.open_input_file(path) as stream:
                table = pq.read_table(stream)
        except (OSError, pa.ArrowInvalid) as error:
            raise LedgerCorruptError(f"ledger fragment {shown} is unreadable: {error}") from error
        chained = table.schema.equals(LEDGER_SCHEMA) or table.schema.equals(UNIT_SCHEMA)
        if not (chained or table.schema.equals(UNCHAINED_SCHEMA)) or table.num_rows != 1:
            raise LedgerCorruptError(
                f"ledger fragment {shown} does not hold exactly one row of the ledger schema"
            )
        row = table.to_pylist()[0]
        row.setdefault("prev_hash", None)
        if row["seq"] is None or not name.startswith(f"{row['seq']:0{SEQ_DIGITS}d}"):
            raise LedgerCorruptError(f"ledger fragment {shown} holds row number {row['seq']}")
        if row["kind"] not in KINDS:
            raise LedgerCorruptError(f"ledger fragment {shown} has kind {row['kind']!r}, not "
                                     f"one of {', '.join(KINDS)}")
        row["fragment"] = name
        return row

    def _make_directory(self) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as error:
            raise LedgerError(f"budget.ledger: cannot use {self.uri}: {error}") from error

    def _write_problem(self, name: str, error: OSError) -> str:
        if error.errno in NO_HARD_LINKS:
            return (f"budget.ledger: the filesystem of {self.uri} has no hard links, so a "
                    f"fragment cannot be created exclusively ({error}); use a local directory "
                    "or NFS")
        return f"cannot write ledger fragment {self.uri}/{name}: {error}"


def as_uri(path: str) -> str:
    """A local path as a file:// URI; URIs (s3://...) pass unchanged."""
    return path if "://" in path else Path(path).resolve().as_uri()


def _location(root: str) -> tuple[fs.FileSystem, str]:
    try:
        return fs.FileSystem.from_uri(as_uri(root))
    except (OSError, pa.ArrowInvalid) as error:
        raise LedgerError(f"budget.ledger: cannot use {root}: {error}") from error
