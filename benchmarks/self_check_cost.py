"""What `privacy.self_check` costs at its defaults (2 examples; the first step of each worker
process, then 1% of steps), issue 27's target: < 2% of a run.

    .venv/bin/python benchmarks/self_check_cost.py        (about 10 minutes on 2 cores)

1. MiniLM on SST-2: pipelines/sst2_minilm_dpsgd.yaml with the last layer + head trained, for
   2 epochs (`raydp-train run`, embedded Ray); the record's engine_self_checks_per_worker
   gives the checks' own seconds (two whole runs differ by more than that: run-to-run noise).
2. The Llama decoder of benchmarks/llama_step.py (B 16, T 128, every token real), in this
   process: the median private step with and without the check, alternating (the check's
   full pass is the step's own micro-batch, so the difference is what it adds); the share of
   a run of that benchmark's 24 steps and of longer runs.
Writes its section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from llama_step import BATCH, LOSS, STEPS, llama_workload
from pipeline_runs import ROOT, run_pipeline
from sst2_variants import EARLIER
from step_overhead import CLIP_NORM, NOISE_MULTIPLIER, machine_facts, write_section

from raydp_train.config.privacy import SelfCheckConfig
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.noise import make_generator, noise_std
from raydp_train.train.engine_checks import EngineChecks
from raydp_train.train.step import private_step

SST2 = ROOT / "pipelines" / "sst2_minilm_dpsgd.yaml"
# The recipe the section measured: sst2_variants.EARLIER's last-layer DP-SGD, 20 epochs of
# q = 1024 / 6920 (135 steps; 23.6 min in RESULTS.md, seed 1, quiet).
SST2_EPOCHS, LAST_LAYER_STEPS = 2, 135
ROUNDS = 6


def expected_checks(steps: int, fraction: float = 0.01) -> float:
    """The first step, then each later one with probability `fraction`."""
    return 1 + fraction * (steps - 1)


def minilm_run() -> dict:
    run = run_pipeline(SST2, [*EARLIER[SST2.name], f"training.epochs={SST2_EPOCHS}"], seed=0)
    print(f"SST-2 run: {run.get('wall_s', 0):.1f} s {run.get('error', '')}", flush=True)
    return run


def llama_times() -> tuple[list[float], list[float]]:
    """Median-ready lists: the private step alone, and the private step with the check."""
    workload = llama_workload()
    model, tokens, labels = workload.model, workload.features, workload.labels
    clipper = PerExampleClipper(model, CLIP_NORM)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator, _ = make_generator(0)
    std = noise_std(NOISE_MULTIPLIER, CLIP_NORM)
    every_step = EngineChecks(SelfCheckConfig(step_fraction=1.0), 0, lambda verdict: [verdict])

    def timed(checks) -> float:
        started = time.perf_counter()
        private_step(model, clipper, optimizer, [(tokens, labels)], LOSS, std, BATCH, generator,
                     engine_checks=checks)
        return time.perf_counter() - started

    steps, checked = [], []
    for round_index in range(ROUNDS + 1):
        step, with_check = timed(None), timed(every_step)
        if round_index:  # the first round warms up
            steps.append(step)
            checked.append(with_check)
        print(f"llama: step {step:.2f} s, step with the check {with_check:.2f} s", flush=True)
    return steps, [with_check - step for step, with_check in zip(steps, checked)]


def section(on: dict, steps: list[float], checks: list[float], load: float) -> str:
    per_worker = on["record"]["training"]["engine_self_checks_per_worker"]
    count = sum(w["checks"] for w in per_worker)
    seconds = sum(w["seconds"] for w in per_worker)
    run_steps = on["record"]["metrics"][-1]["steps"]
    per_check = seconds / max(count, 1)
    step, check = statistics.median(steps), statistics.median(checks)
    last_layer_run = 23.6 * 60  # RESULTS.md: the 20-epoch last-layer DP-SGD run, seed 1, quiet
    lines = [
        "## Engine self-check: its cost at the defaults (benchmarks/self_check_cost.py)", "",
        (f"Machine: {machine_facts()}; 1-minute load before the runs {load:.2f} on "
         f"{os.cpu_count()} cores (other work on the machine shows here). Defaults: 2 examples "
         "drawn at random from the first micro-batch, removed together in one pass and "
         "recomputed by one forward and a backward each, one pass without half the rows; the first step of each worker "
         "process, then 1% of later steps at random. A check's seconds exclude its full pass, "
         "which is the micro-batch's own release."), "",
        (f"**MiniLM, SST-2** (pipelines/sst2_minilm_dpsgd.yaml's last-layer recipe, {SST2_EPOCHS} "
         "epochs, "
         f"{run_steps} steps, expected batch 1,024 in micro-batches "
         f"of 64, `raydp-train run`, one worker): {count} check(s) took {seconds:.2f} s in all "
         f"({per_check:.2f} s each) of a {on['wall_s']:.0f} s run "
         f"(**{seconds / on['wall_s']:.2%}**). Over the 20-epoch last-layer run "
         f"({LAST_LAYER_STEPS} "
         f"steps, {expected_checks(LAST_LAYER_STEPS):.2f} checks expected, 23.6 min measured): "
         f"**{expected_checks(LAST_LAYER_STEPS) * per_check / last_layer_run:.3%}**."), "",
        ("**Llama decoder** (benchmarks/llama_step.py's workload: B 16, T 128, every token "
         f"real; in-process, {ROUNDS} alternating rounds after one warm-up): median private "
         f"step {step:.2f} s, median time the check adds to it {check:.2f} s "
         f"({check / step:.2f} steps). Share of a run of N steps, (1 + 0.01 (N - 1)) checks:"),
        "",
        "| steps N | checks expected | share of the run |", "|---:|---:|---:|",
    ]
    for n in (STEPS, 50, 100, 500):
        share = expected_checks(n) * check / (n * step + expected_checks(n) * check)
        lines.append(f"| {n} | {expected_checks(n):.2f} | {share:.2%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    load = os.getloadavg()[0]
    torch.set_num_threads(os.cpu_count() or 1)
    steps, checks = llama_times()
    run = minilm_run()
    if "error" in run:
        raise SystemExit(f"the SST-2 run failed: {run['error']}")
    text = section(run, steps, checks, load)
    print(text)
    write_section(Path(__file__).with_name("RESULTS.md"), text)


if __name__ == "__main__":
    main()
