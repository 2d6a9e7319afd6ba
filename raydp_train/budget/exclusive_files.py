"""Creating a file exclusively and durably on a local or NFS file system, as the ledger
commits a fragment (budget/ledger.py): written to a hidden temporary file, flushed, then
hard-linked to its final name, which fails if the name exists."""

from __future__ import annotations

import errno
import fcntl
import os
from contextlib import contextmanager

# Errors of link(2) that mean "this filesystem has no hard links", not "the disk failed".
NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK}


def write_durably(path: str, data: bytes) -> None:
    with open(path, "xb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())


def replace_durably(temporary: str, final: str, data: bytes) -> None:
    """`data` at `final`, on disk under its name (written to `temporary`, then renamed)."""
    write_durably(temporary, data)
    os.replace(temporary, final)
    sync_directory(os.path.dirname(final))


def link_exclusively(temporary: str, final: str) -> bool:
    """link(2) `final` to the written `temporary`: True if this call created `final`."""
    try:
        os.link(temporary, final)
        return True
    except FileExistsError:
        # NFS: a retransmitted link that had succeeded answers "exists"; our file then has
        # two links.
        return os.stat(temporary).st_nlink > 1


def sync_directory(directory: str) -> None:
    """Make the new name itself durable (the data already is), as a write-ahead log must."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def remove_quietly(path: str) -> None:
    """Drop a temporary file; one left behind is hidden and never read, so not an error."""
    try:
        os.unlink(path)
    except OSError:
        pass


@contextmanager
def held_lock(path: str):
    """An exclusive lock on `path` (created if need be) for the block: writers that read a
    file and then replace it take turns, so none replaces it with what it read before."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # drops the lock
