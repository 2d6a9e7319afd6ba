"""Searchers and schedulers at one fixed total budget, on digits: the best test accuracy a
`raydp-train tune` sweep of `pipelines/sweep_digits.yaml` reaches with random search, Optuna,
ASHA and PBT (each on a fresh budget of the same epsilon, 3 seeds), and the sweep's wall time;
and random search over sigma and lr alone with adaptive or automatic clipping (no C to search)
against the same search over sigma, lr and C with fixed clipping ("random").
Each sweep runs in a fresh process (its embedded Ray), timed from the outside, with the
1-minute load average before it.

    .venv/bin/python benchmarks/sweep_search.py [--seeds 3] [--epsilon 8] > rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "pipelines/sweep_digits.yaml"
SPACE = ("{privacy.noise_multiplier: {choice: [1.5, 2.0]}, privacy.clip_norm: {choice: "
         "[0.5, 1.0, 2.0]}, training.lr: {loguniform: [0.003, 0.03]}}")
NO_C_SPACE = ("{privacy.noise_multiplier: {choice: [1.5, 2.0]}, training.lr: {loguniform: "
              "[0.003, 0.03]}}")
METHODS = {
    "random": ["tune.search=random", "tune.scheduler=fifo"],
    "optuna": ["tune.search=optuna", "tune.scheduler=fifo"],
    "asha": ["tune.search=random", "tune.scheduler=asha"],
    "pbt": ["tune.search=random", "tune.scheduler=pbt"],
    "adaptive": ["tune.search=random", "tune.scheduler=fifo", "privacy.clipping=adaptive"],
    "automatic": ["tune.search=random", "tune.scheduler=fifo", "privacy.clipping=automatic"],
}
NO_C = ("adaptive", "automatic")  # C is not searched


def sweep(method: str, seed: int, epsilon: float, samples: int, epochs: int) -> dict:
    """One sweep on a fresh budget: its best trial's test accuracy, the epsilon counted, the
    trials that ran, the wall time and the load before it."""
    load = os.getloadavg()[0]
    overrides = METHODS[method]
    with tempfile.TemporaryDirectory() as scratch:
        settings = [f"run.output_dir={scratch}/runs", f"budget.ledger={scratch}/budgets",
                    f"budget.name=bench-{method}-{seed}", f"budget.epsilon={epsilon}",
                    f"run.seed={seed}", f"tune.num_samples={samples}",
                    f"training.epochs={epochs}", "tune.max_concurrent_trials=2",
                    f"tune.search_space={NO_C_SPACE if method in NO_C else SPACE}", *overrides]
        command = [str(Path(sys.executable).with_name("raydp-train")), "tune", str(SWEEP),
                   *(x for s in settings for x in ("--set", s))]
        started = time.perf_counter()
        done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - started
        found = list(Path(scratch, "runs").glob("sweep-*/sweep.json"))
        if not found:
            return {"method": method, "seed": seed, "error": done.stdout[-500:] +
                    done.stderr[-500:], "wall_s": wall, "load": load}
        summary = json.loads(found[0].read_text())
    best = summary["best"] or {}
    return {"method": method, "seed": seed, "best_test_accuracy": best.get("test_accuracy"),
            "epsilon": summary["privacy"]["epsilon"], "trials": len(summary["trials"]),
            "wall_s": round(wall, 1), "load": round(load, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    args = parser.parse_args()
    rows = []
    for method in args.methods:
        for seed in range(args.seeds):
            rows.append(sweep(method, seed, args.epsilon, args.samples, args.epochs))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    for method in args.methods:
        scores = [r["best_test_accuracy"] for r in rows
                  if r["method"] == method and r.get("best_test_accuracy") is not None]
        walls = [r["wall_s"] for r in rows if r["method"] == method]
        if scores:
            print(f"{method}: best test accuracy mean {statistics.mean(scores):.3f} "
                  f"(min {min(scores):.3f}, max {max(scores):.3f}), wall {statistics.mean(walls):.0f} s",
                  file=sys.stderr)
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
