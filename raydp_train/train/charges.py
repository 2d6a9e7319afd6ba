"""The run's write-ahead record of privacy spent: steps are charged BEFORE they run.

One small immutable JSON file per charge under `<run_dir>/charges/`, written to a temporary
name and renamed, through pyarrow's filesystem layer (a local directory or a URI such as
s3://...). A crash never loses a charge: a worker group that restarts from a checkpoint
charges the repeated steps again, so epsilon counts every step that was ever run.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

from pyarrow import fs


class ChargeLedger:
    def __init__(self, run_dir: str):
        self.filesystem, root = fs.FileSystem.from_uri(_as_uri(run_dir))
        self.directory = f"{root.rstrip('/')}/charges"
        self.filesystem.create_dir(self.directory, recursive=True)
        self._total: int | None = None  # read from the files once, then kept up to date

    def charge(self, steps: int) -> int:
        """Durably record `steps` as spent; returns the total charged by the run so far."""
        before = self.total()  # read before writing, so the new charge counts once
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}.json"
        temporary, final = f"{self.directory}/.{name}.tmp", f"{self.directory}/{name}"
        with self.filesystem.open_output_stream(temporary) as stream:
            stream.write(json.dumps({"steps": steps, "time": time.time()}).encode())
        self.filesystem.move(temporary, final)
        self._total = before + steps
        return self._total

    def total(self) -> int:
        """Every charge on record, earlier attempts of the run included."""
        if self._total is None:
            self._total = self._read_total()
        return self._total

    def _read_total(self) -> int:
        selector = fs.FileSelector(self.directory, allow_not_found=True)
        total = 0
        for info in self.filesystem.get_file_info(selector):
            if info.base_name.endswith(".json") and not info.base_name.startswith("."):
                with self.filesystem.open_input_stream(info.path) as stream:
                    total += json.loads(stream.read())["steps"]
        return total


def _as_uri(path: str) -> str:
    return path if "://" in path else Path(path).resolve().as_uri()
