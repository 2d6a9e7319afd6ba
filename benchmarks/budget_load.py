"""Load on one global budget: 8 concurrent Tune trials for 10 minutes, the accountant killed
every minute. Checks, from the ledger alone, that nothing was overspent, nothing lost and
nothing granted twice, and that the sweep never stalled.

    .venv/bin/python benchmarks/budget_load.py             # 10 minutes + start-up
    .venv/bin/python benchmarks/budget_load.py --minutes 2 # shorter; prints, writes nothing

The sweep is `pipelines/sweep_digits.yaml` (MLP on digits, noisy validation releases) with
8 concurrent one-worker trials of 2 epochs on an embedded Ray of 8 logical CPUs (2 cores), a
budget sized to run out part-way (so grants and refusals both happen under load), and
`tune.time_budget_s` ending the sweep, which stops trials mid-epoch (their open reservations
must stay counted in full).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import ray
import yaml

from raydp_train.budget.actor import actor_name
from raydp_train.budget.book import NAMESPACE, replay
from raydp_train.budget.ledger_reading import ledger_rows
from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.sweeps.runner import run_sweep

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import write_section

PIPELINE = Path(__file__).parents[1] / "pipelines" / "sweep_digits.yaml"
CONCURRENT_TRIALS = 8
BUDGET_EPSILON = 15.0
KILL_EVERY_S = 60.0
STALL_LIMIT_S = 60.0  # longer than this without a ledger row, before the end: a stall


def _overrides(root: Path, minutes: float, name: str) -> list[str]:
    return [f"run.output_dir={root}/runs", f"budget.ledger={root}/budgets", f"budget.name={name}",
            f"budget.epsilon={BUDGET_EPSILON}", "training.epochs=2", "tune.num_samples=100000",
            f"tune.max_concurrent_trials={CONCURRENT_TRIALS}",
            f"tune.time_budget_s={minutes * 60:g}"]


def load_pipeline_under_load(root: Path, minutes: float, name: str):
    raw = yaml.safe_load(PIPELINE.read_text())
    # Larger noise than the shipped sweep: cheaper trials, so the budget lasts a while.
    raw["tune"]["search_space"]["privacy.noise_multiplier"] = {"choice": [2.0, 3.0, 4.0]}
    return pipeline_from_dict(raw, _overrides(root, minutes, name), source=str(PIPELINE))


def _kill_periodically(name: str, stop: threading.Event, kills: list) -> None:
    while not stop.wait(KILL_EVERY_S):
        try:
            ray.kill(ray.get_actor(actor_name(name), namespace=NAMESPACE), no_restart=False)
            kills.append(time.time())
        except ValueError:  # not created yet
            pass


def check_ledger(name: str, ledger: str, trials: list[dict], started: float,
                 ended: float) -> dict:
    rows = ledger_rows(name, ledger)  # raises on a gap, a duplicate or an unreadable fragment
    book = replay(rows)  # raises unless the events recompose to the recorded epsilon
    status = book.status()
    request_ids = [r["request_id"] for r in rows if r["request_id"]]
    # Per owner: settled steps, or the full reservation while it is open.
    counted = {owner: entry["steps_spent"] + entry["steps_reserved"]
               for owner, entry in status["owners"].items()}
    mismatched = [t["trial"] for t in trials
                  if t["stop_reason"] in ("completed", "budget exhausted")
                  and counted.get(_owner(rows, t["trial"]), 0) != t["steps_charged"]]
    times = [started] + [r["timestamp"] for r in rows if r["kind"] == "reserve"] + [ended]
    exhausted_at = next((r["timestamp"] for r in rows
                         if r["running_epsilon"] > BUDGET_EPSILON * 0.97), None)
    busy = [t for t in times if exhausted_at is None or t <= exhausted_at]
    gaps = [b - a for a, b in itertools.pairwise(busy)]
    return {
        "rows": len(rows),
        "reserves": sum(r["kind"] == "reserve" for r in rows),
        "settles": sum(r["kind"] == "settle" for r in rows),
        "open": status["steps_reserved"],
        "max_running_epsilon": max(r["running_epsilon"] for r in rows),
        "final_epsilon": book.epsilon,
        "duplicate_requests": len(request_ids) - len(set(request_ids)),
        "mismatched_trials": mismatched,
        "longest_gap_s": max(gaps) if gaps else 0.0,
        "median_gap_s": statistics.median(gaps) if gaps else 0.0,
        "exhausted_after_s": None if exhausted_at is None else exhausted_at - started,
    }


def _owner(rows: list[dict], trial: str) -> str:
    return next((r["owner"] for r in rows if r["owner"].endswith("/" + trial)), "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=CONCURRENT_TRIALS, include_dashboard=False,
             log_to_driver=False)
    name = f"load-{int(time.time())}"
    with tempfile.TemporaryDirectory() as root:
        pipeline = load_pipeline_under_load(Path(root), args.minutes, name)
        stop, kills = threading.Event(), []
        killer = threading.Thread(target=_kill_periodically, args=(name, stop, kills), daemon=True)
        started = time.time()
        killer.start()
        try:
            sweep = run_sweep(pipeline, connect=lambda: None, on_line=lambda line: None)
        finally:
            stop.set()
            killer.join()
        ended = time.time()
        trials = pq.read_table(sweep.directory / "results.parquet").to_pylist()
        result = check_ledger(name, f"{root}/budgets", trials, started, ended)
    ray.shutdown()
    stops = {}
    for trial in trials:
        stops[trial["stop_reason"]] = stops.get(trial["stop_reason"], 0) + 1
    result.update(wall_s=ended - started, trials=len(trials), stops=stops, kills=len(kills))
    print(result)
    verdict = _verdict(result, args.minutes)
    print(verdict)
    if args.minutes == 10.0:
        write_section(Path(__file__).with_name("RESULTS.md"), _section(result, verdict))


def _verdict(result: dict, minutes: float) -> str:
    problems = []
    if result["max_running_epsilon"] > BUDGET_EPSILON:
        problems.append(f"OVERSPENT: epsilon {result['max_running_epsilon']:.4f}")
    if result["duplicate_requests"] or result["mismatched_trials"]:
        problems.append(f"ledger vs trials: {result['duplicate_requests']} duplicate requests, "
                        f"mismatched trials {result['mismatched_trials']}")
    if result["longest_gap_s"] > STALL_LIMIT_S or result["wall_s"] > minutes * 60 + 120:
        problems.append(f"STALLED: longest gap {result['longest_gap_s']:.0f} s, wall "
                        f"{result['wall_s']:.0f} s")
    return "PASS: no overspend, no stall, ledger consistent" if not problems else (
        "FAIL: " + "; ".join(problems))


def _section(r: dict, verdict: str) -> str:
    exhausted = ("not exhausted" if r["exhausted_after_s"] is None
                 else f"exhausted after {r['exhausted_after_s']:.0f} s")
    stops = ", ".join(f"{count} {reason}" for reason, count in sorted(r["stops"].items()))
    return "\n".join([
        "## Global budget under load (benchmarks/budget_load.py)",
        "",
        (f"`raydp-train tune` of `pipelines/sweep_digits.yaml` (2 epochs per trial, noisy "
         f"validation releases) with {CONCURRENT_TRIALS} concurrent trials for 10 minutes "
         f"(`tune.time_budget_s`) on an embedded Ray of {CONCURRENT_TRIALS} logical CPUs on "
         f"2 cores, one budget of epsilon {BUDGET_EPSILON:g}, and the accountant actor killed "
         f"every {KILL_EVERY_S:.0f} s (Ray restarts it from its ledger)."),
        "",
        "| measure | value |",
        "|---|---:|",
        f"| wall time of the sweep | {r['wall_s']:.0f} s |",
        f"| trials | {r['trials']} ({stops}) |",
        f"| accountant kills (restarts) | {r['kills']} |",
        f"| ledger rows: reserve / settle / all | {r['reserves']} / {r['settles']} / {r['rows']} |",
        f"| steps left counted in full (trials stopped mid-epoch) | {r['open']} |",
        (f"| highest epsilon ever counted (budget {BUDGET_EPSILON:g}) | "
        f"{r['max_running_epsilon']:.4f} |"),
        f"| budget | {exhausted} |",
        f"| requests recorded twice | {r['duplicate_requests']} |",
        (f"| finished trials whose ledger steps differ from their own count | "
        f"{len(r['mismatched_trials'])} |"),
        (f"| time between reservations before exhaustion (from the sweep's start): median / longest | {r['median_gap_s']:.2f} s / "
        f"{r['longest_gap_s']:.1f} s |"),
        "",
        (f"**{verdict}.** The ledger replays (no gap, no duplicate, recomposes to the epsilon it "
        "recorded); every trial that finished or was refused counts exactly the steps it "
        "charged; trials stopped by the time limit keep their open epoch counted in full."),
    ])


if __name__ == "__main__":
    main()
