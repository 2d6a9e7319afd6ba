"""Files that name a ledger row, {"seq": n, "hash": that row's SHA-256}: the head marker
``HEAD`` inside a budget's directory, and the witness kept outside it, beside the ledger
(``<ledger>.witness/<budget>.json``). Each is replaced durably and never moved back; writers
take turns on it through a lock beside it. A ledger older than either (fewer fragments than
the row it names, or another row there) is refused (budget/ledger_chain.py)."""

from __future__ import annotations

import json
import os
import uuid

from pyarrow import fs

from raydp_train.budget.exclusive_files import held_lock, remove_quietly, replace_durably

WITNESS_FOLDER = "{root}.witness"  # beside the ledger's root folder, outside every budget's


class MarkUnreadable(ValueError):
    """The mark's file exists but does not name a row."""


class Mark:
    """One file naming the newest ledger row a writer committed (as far as it knows)."""

    def __init__(self, filesystem: fs.FileSystem, path: str, shown: str):
        self.filesystem, self.path, self.shown = filesystem, path, shown

    def read(self) -> tuple[int, str] | None:
        """(sequence number, row hash), or None if there is no such file."""
        try:
            if self.filesystem.get_file_info(self.path).type == fs.FileType.NotFound:
                return None
            with self.filesystem.open_input_stream(self.path) as stream:
                marked = json.loads(stream.read())
            return int(marked["seq"]), str(marked["hash"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise MarkUnreadable(f"{self.shown} is unreadable: {error}") from error

    def advance(self, seq: int, digest: str) -> None:
        """Name row `seq`, unless the mark already names a newer one (a writer that lost the
        race to a newer commit must not move it back). Local files only; raises OSError."""
        folder = os.path.dirname(self.path)
        os.makedirs(folder, exist_ok=True)
        temporary = f"{folder}/.{os.path.basename(self.path)}.{uuid.uuid4().hex}.tmp"
        try:
            with held_lock(f"{folder}/.{os.path.basename(self.path)}.lock"):
                current = self.read()
                if current is not None and current[0] >= seq:
                    return
                replace_durably(temporary, self.path,
                                json.dumps({"seq": seq, "hash": digest}).encode())
        finally:
            remove_quietly(temporary)


def witness_of(filesystem: fs.FileSystem, root: str, budget: str) -> Mark | None:
    """The witness of a budget's ledger under the local folder `root`; None where the ledger
    is not a local folder (an object store: read-only, no witness written) or is `/`."""
    root = root.rstrip("/")
    if not isinstance(filesystem, fs.LocalFileSystem) or not root:
        return None
    path = f"{WITNESS_FOLDER.format(root=root)}/{budget}.json"
    return Mark(filesystem, path, f"the witness {path}")
