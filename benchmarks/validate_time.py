"""`raydp-train validate`'s wall time on the shipped SST-2 pipelines (issue 16: under 5 s,
without Ray): each pipeline validated 3 times in fresh processes, as a user types it, then once
with `--check-model` (the model built too), each pipeline starting from an empty
`$RAYDP_TRAIN_CACHE` so that no earlier model check is remembered.

    .venv/bin/python benchmarks/validate_time.py            (a few minutes)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pipeline_runs import ROOT
from step_overhead import write_section

PIPELINES = ("dpsgd", "lsg", "lora", "nonprivate", "probe", "sweep")
REPEATS = 3
TITLE = "## `validate`'s time on the SST-2 pipelines (benchmarks/validate_time.py)"


def timed_validate(pipeline: Path, cache: str, *options: str) -> float:
    """Seconds of one `raydp-train validate`, from the outside; it must pass."""
    command = [str(Path(sys.executable).with_name("raydp-train")), "validate", str(pipeline),
               *options]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False,
                          env={**os.environ, "RAYDP_TRAIN_CACHE": cache})
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{pipeline.name}: validate failed: {done.stderr.strip()}")
    return wall


def measure(name: str) -> dict:
    pipeline = ROOT / "pipelines" / f"sst2_minilm_{name}.yaml"
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as cache:
        plain = [timed_validate(pipeline, cache) for _ in range(REPEATS)]
        built = timed_validate(pipeline, cache, "--check-model")
    return {"name": name, "plain": plain, "built": built, "load": load}


def section(rows: list[dict]) -> str:
    lines = [TITLE, "",
             (f"`raydp-train validate pipelines/sst2_minilm_<x>.yaml`, {REPEATS} times in fresh "
             "processes, then once with `--check-model`, each pipeline from an empty "
             f"`$RAYDP_TRAIN_CACHE`; {os.cpu_count()} cores; *load*: the 1-minute load "
             "average before each pipeline."), "",
             "| pipeline | validate (3 runs) | with --check-model | load |",
             "|---|---:|---:|---:|"]
    for row in rows:
        plain = " / ".join(f"{s:.2f} s" for s in row["plain"])
        lines.append(f"| {row['name']} | {plain} | {row['built']:.2f} s | {row['load']:.1f} |")
    slowest = max(s for row in rows for s in row["plain"])
    lines += [
        "",
        (f"- **validate: at most {slowest:.2f} s ({'met' if slowest < 5 else 'NOT met'}: "
        "under 5 s, without Ray).** It checks a pretrained model's files (`config.json`, the "
        "weights, `last_k_layers` against the layers), not its structure, so it imports "
        "neither torch nor transformers (tests/test_validate.py)."),
        ("- **--check-model** also builds the model on the meta device and checks what trains. "
        "Its floor is importing torch and transformers' model classes (5.6-5.9 s on this "
        "machine: `python -c \"import torch, transformers; "
        "transformers.BertForSequenceClassification\"`), run in a forked process beside the "
        "data checks. `run` always makes these checks before anything is spent."),
        ("- Before (session 9), validate built the model every time: 6.2-8.1 s for a model's "
         "first validate, 2.1-3.8 s when its check had passed before (`checks/passed.py`)."),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    rows = []
    for name in PIPELINES:
        rows.append(measure(name))
        print(rows[-1], flush=True)
    write_section(ROOT / "benchmarks" / "RESULTS.md", section(rows))


if __name__ == "__main__":
    main()
