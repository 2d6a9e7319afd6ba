"""The step-time cost of `run.noise: secure` on MiniLM: private steps with fast and secure
noise in turn, and the noise draw alone over MiniLM's trainable parameters.

    .venv/bin/python benchmarks/noise_cost.py          (a few minutes on 2 cores)

Same workload as benchmarks/hf_minilm.py (B = 32 SST-2 sentences at T = 64 tokens, all
parameters trained). Blocks of steps alternate between the modes in one process, so a load
that comes and goes on a shared machine falls on both; the 1-minute load average is reported.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import torch

from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.noise import fill_gaussian_noise_, make_noise_generator, noise_std
from raydp_train.train.step import cross_entropy_loss, private_step

sys.path.insert(0, str(Path(__file__).parent))
from hf_minilm import minilm_workload
from step_overhead import CLIP_NORM, NOISE_MULTIPLIER, machine_facts, write_section

MODES = ("fast", "secure")
ROUNDS, BLOCK, DRAWS = 4, 2, 3


def timed(run, repeats: int) -> float:
    """Seconds per call of `run`, over `repeats` consecutive calls."""
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - started) / repeats


def step_times(workload) -> dict[str, list[float]]:
    """Per mode: seconds per private step, one entry per block; blocks alternate modes."""
    model = workload.model.train()
    clipper = PerExampleClipper(model, CLIP_NORM)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    std, batch = noise_std(NOISE_MULTIPLIER, CLIP_NORM), [(workload.features, workload.labels)]
    generators = {mode: make_noise_generator(mode, None)[0] for mode in MODES}

    def step(mode: str) -> None:
        private_step(model, clipper, optimizer, batch, cross_entropy_loss, std,
                     workload.labels.shape[0], generators[mode])

    for mode in MODES:  # warm-up
        step(mode)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(ROUNDS):
        for mode in MODES:
            times[mode].append(timed(partial(step, mode), BLOCK))
    return times


def draw_times(entries: int) -> dict[str, float]:
    """Per mode: median seconds for one noise draw over `entries` float32 numbers; after one
    warm-up draw per mode, the modes alternate draw by draw."""
    buffer = torch.empty(entries)
    std = noise_std(NOISE_MULTIPLIER, CLIP_NORM)
    draws = {mode: partial(fill_gaussian_noise_, buffer, std, make_noise_generator(mode, None)[0])
             for mode in MODES}
    for draw in draws.values():
        draw()
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(DRAWS):
        for mode, draw in draws.items():
            seconds[mode].append(timed(draw, 1))
    return {mode: statistics.median(values) for mode, values in seconds.items()}


def main() -> None:
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")
    workload = minilm_workload()
    trainable = sum(p.numel() for p in workload.model.parameters() if p.requires_grad)
    load_before = os.getloadavg()[0]
    steps = {mode: statistics.median(values) for mode, values in step_times(workload).items()}
    draws = draw_times(trainable)
    load_after = os.getloadavg()[0]
    added = steps["secure"] - steps["fast"]
    lines = [
        "## Secure noise: step-time cost on MiniLM (benchmarks/noise_cost.py)", "",
        (f"Machine: {machine_facts()}. 1-minute load average {load_before:.1f} before, "
         f"{load_after:.1f} after: the machine is shared with other benchmarks, so absolute "
         "times carry that load; the modes alternate in one process so both see it."), "",
        (f"{workload.description}; {trainable:,} trainable parameters (all). Private steps: one "
         f"warm-up per mode, then {ROUNDS} rounds of {BLOCK} steps per mode, alternating; "
         f"median step time. Noise draw alone: one warm-up, then {DRAWS} draws per mode "
         f"over {trainable:,} float32 entries, alternating; median."), "",
        "| noise | step (s) | noise draw alone (s) |", "|---|---:|---:|",
        *(f"| {mode} | {steps[mode]:.3f} | {draws[mode]:.3f} |" for mode in MODES), "",
        (f"**Secure noise adds {added:.2f} s per step ({steps['secure'] / steps['fast']:.2f}x "
         f"the fast step); its draw alone takes {draws['secure'] / draws['fast']:.0f}x the fast "
         "draw.**"),
    ]
    print("\n".join(lines), flush=True)
    write_section(Path(__file__).with_name("RESULTS.md"), "\n".join(lines))


if __name__ == "__main__":
    main()
