"""An attempt's release log (train/charges.py): rank 0 appends "step s" before step s's noisy
gradient leaves it and "release e" before epoch e's noisy metric, each line on disk before
the release. Every line carries its running count and a hash chained to the line before, so
a log whose lines do not chain (cut inside a line, a line removed, edited, or written by a
version before the chain) reads as lost, and the charges it would settle count in full. A log
cut exactly at a line boundary still chains: the reader takes the larger of it and the other
evidence it has (the step the next attempt resumed at, from its checkpoint)."""

from __future__ import annotations

import hashlib
import os

from pyarrow import fs

RELEASE_LOG = "released-{attempt}.log"  # one per attempt, beside the charges
MARKS = ("step", "release")


def line_digest(before: str, kind: str, number: int, count: int) -> str:
    """The chain: a line's hash covers what it marks, its running count and the line before."""
    return hashlib.sha256(f"{before}|{kind} {number} {count}".encode()).hexdigest()[:16]


class ReleaseLog:
    """This attempt's log, appended to and synced line by line (a local file system)."""

    def __init__(self, path: str):
        self._descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._count, self._digest = 0, ""

    def mark(self, kind: str, number: int) -> None:
        self._count += 1
        self._digest = line_digest(self._digest, kind, number, self._count)
        os.write(self._descriptor, f"{kind} {number} {self._count} {self._digest}\n".encode())
        os.fdatasync(self._descriptor)  # on disk before the release: a power cut loses no mark

    def close(self) -> None:
        os.close(self._descriptor)


def read_marks(filesystem: fs.FileSystem, path: str) -> tuple[list[int], list[int]] | None:
    """(steps, epochs of metric releases) a log marks; None if it is missing, unreadable or
    its lines do not chain: then what it would settle counts in full."""
    try:
        with filesystem.open_input_stream(path) as stream:
            text = stream.read().decode()
    except (OSError, UnicodeDecodeError):
        return None
    if text and not text.endswith("\n"):
        return None  # cut inside a line
    marks: dict[str, list[int]] = {kind: [] for kind in MARKS}
    digest = ""
    for count, line in enumerate(text.splitlines(), start=1):
        fields = line.split(" ")
        if (len(fields) != 4 or fields[0] not in MARKS or not fields[1].isdigit()
                or fields[2] != str(count)):
            return None
        digest = line_digest(digest, fields[0], int(fields[1]), count)
        if fields[3] != digest:
            return None
        marks[fields[0]].append(int(fields[1]))
    return marks["step"], marks["release"]
