"""Creating a file exclusively and durably on a local or NFS file system, as the ledger
commits a fragment (budget/ledger.py): written to a hidden temporary file, flushed, then
hard-linked to its final name, which fails if the name exists."""

from __future__ import annotations

import errno
import os

# Errors of link(2) that mean "this filesystem has no hard links", not "the disk failed".
NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK}


def write_durably(path: str, data: bytes) -> None:
    with open(path, "xb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())


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
