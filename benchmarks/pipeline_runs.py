"""One shipped pipeline run as a user runs it: `raydp-train run` in a fresh process (the
embedded Ray) with `run.seed` set, timed from the outside, into a scratch output folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_pipeline(pipeline: Path, overrides: list[str], seed: int) -> dict:
    """{"record": the run's record.json, "wall_s", "load"}, or {"error": stderr's last line,
    "wall_s", "load"} when the run fails; *load* is the 1-minute load average before it."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as output_dir:
        command = [str(Path(sys.executable).with_name("raydp-train")), "run", str(pipeline),
                   "--set", f"run.output_dir={output_dir}", "--set", f"run.seed={seed}"]
        command += [x for override in overrides for x in ("--set", override)]
        started = time.perf_counter()
        done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if done.returncode != 0:
            return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1],
                    "wall_s": wall, "load": load}
        (run_dir,) = [d for d in Path(output_dir).iterdir() if d.is_dir()]
        record = json.loads((run_dir / "record.json").read_text())
    return {"record": record, "wall_s": wall, "load": load}
