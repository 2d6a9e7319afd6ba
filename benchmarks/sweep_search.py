"""Searchers and schedulers at one fixed total budget, on digits or SST-2: the best test accuracy a
`raydp-train tune` sweep of `pipelines/sweep_digits.yaml` (or of the SST-2 linear probe on
all-MiniLM-L6-v2's frozen features, `--task sst2`: `SST2_PROBE` below, its features computed
once by benchmarks/sst2_probe_features.py) reaches with random search, Optuna,
ASHA and PBT (each on a fresh budget of the same epsilon, 3 seeds), and the sweep's wall time;
and random search over sigma and lr alone with adaptive or automatic clipping (no C to search)
against the same search over sigma, lr and C with fixed clipping ("random").
Each sweep runs in a fresh process (its embedded Ray), timed from the outside, with the
1-minute load average before it.

    .venv/bin/python benchmarks/sweep_search.py [--seeds 3] [--epsilon 8] > rows.json
    .venv/bin/python benchmarks/sweep_search.py --task sst2 --features DIR --epsilon 5 \
        --samples 6 --epochs 5 > rows.json
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
# The private linear probe of pipelines/sst2_minilm_probe.yaml (its classifier on the frozen
# encoder's mean-pooled, normalised embedding), on that embedding read from Parquet.
SST2_PROBE = """name: sweep-sst2-probe
data:
  source: parquet
  path: {features}/train.parquet
  test_path: {features}/test.parquet
  tensor_column: features
  label_column: label
  validation: {{path: {features}/dev.parquet, private: false}}
model: {{kind: logistic, num_classes: 2}}
privacy: {{mechanism: dpsgd, clip_norm: 1.0, noise_multiplier: 2.0, delta: 1e-5}}
training: {{epochs: 5, batch_size: 1024, optimizer: sgd, momentum: 0.9, lr: 1.0}}
budget: {{name: sst2-probe-sweep, epsilon: 5.0, delta: 1e-5}}
tune:
  num_samples: 6
  max_concurrent_trials: 2
  metric: validation_accuracy
  mode: max
  search_space: {{training.lr: {{loguniform: [0.1, 3.0]}}}}
"""
SST2_SPACE = ("{privacy.noise_multiplier: {choice: [2.0, 3.0]}, privacy.clip_norm: {choice: "
              "[0.25, 0.5, 1.0]}, training.lr: {loguniform: [0.1, 3.0]}}")
SST2_NO_C_SPACE = ("{privacy.noise_multiplier: {choice: [2.0, 3.0]}, training.lr: {loguniform: "
                   "[0.1, 3.0]}}")
SPACES = {"digits": (SPACE, NO_C_SPACE), "sst2": (SST2_SPACE, SST2_NO_C_SPACE)}
METHODS = {
    "random": ["tune.search=random", "tune.scheduler=fifo"],
    "optuna": ["tune.search=optuna", "tune.scheduler=fifo"],
    "asha": ["tune.search=random", "tune.scheduler=asha"],
    "pbt": ["tune.search=random", "tune.scheduler=pbt"],
    "adaptive": ["tune.search=random", "tune.scheduler=fifo", "privacy.clipping=adaptive"],
    "automatic": ["tune.search=random", "tune.scheduler=fifo", "privacy.clipping=automatic"],
}
NO_C = ("adaptive", "automatic")  # C is not searched


def sweep(method: str, seed: int, epsilon: float, samples: int, epochs: int,
          task: str = "digits", features: Path | None = None) -> dict:
    """One sweep on a fresh budget: its best trial's test accuracy, the epsilon counted, the
    trials that ran, the wall time and the load before it."""
    load = os.getloadavg()[0]
    overrides = METHODS[method]
    space, no_c_space = SPACES[task]
    with tempfile.TemporaryDirectory() as scratch:
        pipeline = SWEEP
        if task == "sst2":
            pipeline = Path(scratch, "sweep_sst2_probe.yaml")
            pipeline.write_text(SST2_PROBE.format(features=Path(features).resolve()))
        settings = [f"run.output_dir={scratch}/runs", f"budget.ledger={scratch}/budgets",
                    f"budget.name=bench-{method}-{seed}", f"budget.epsilon={epsilon}",
                    f"run.seed={seed}", f"tune.num_samples={samples}",
                    f"training.epochs={epochs}", "tune.max_concurrent_trials=2",
                    f"tune.search_space={no_c_space if method in NO_C else space}", *overrides]
        command = [str(Path(sys.executable).with_name("raydp-train")), "tune", str(pipeline),
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
    searched = [k for k in summary["trials"][0] if k.startswith(("privacy.", "training."))] \
        if summary["trials"] else []
    return {"task": task, "method": method, "seed": seed, "best_test_accuracy": best.get("test_accuracy"),
            "epsilon": summary["privacy"]["epsilon"], "trials": len(summary["trials"]),
            "wall_s": round(wall, 1), "load": round(load, 1),
            "drawn": [[t.get(k) for k in searched] for t in summary["trials"]],
            "ran": [[t["epochs"], t["stop_reason"][:20], t["validation_accuracy"],
                     t["test_accuracy"]] for t in summary["trials"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--methods", nargs="*", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--task", choices=list(SPACES), default="digits")
    parser.add_argument("--features", type=Path, help="sst2: benchmarks/sst2_probe_features.py's "
                        "output folder")
    args = parser.parse_args()
    if args.task == "sst2" and args.features is None:
        parser.error("--task sst2 needs --features (benchmarks/sst2_probe_features.py OUT)")
    rows = []
    # Seed by seed, every method at each: a run cut short still compares them all.
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for method in args.methods:
            rows.append(sweep(method, seed, args.epsilon, args.samples, args.epochs,
                              args.task, args.features))
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
