"""AdamW's cost in a private step: the package's own single-tensor AdamW (optim/updates.py,
chosen to spare each worker torch's optimizer import) against torch's `AdamW(foreach=True)`,
on the Llama decoder of benchmarks/llama_step.py and the pretrained MiniLM of
benchmarks/hf_minilm.py.

    .venv/bin/python benchmarks/optimizer_step.py          (minutes on 2 quiet cores)

Per model, two timings, each round-robin in this one process (benchmarks/step_overhead.py):
the whole private step (forward, backward, clipping, noise, update) with each optimizer, and
the update alone (`optimizer.step()` on a fixed gradient). `uptime`'s load averages before
and after are recorded with the table: the machine's 2 cores are shared.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import Tensor, nn

from raydp_train.optim.updates import AdamW
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.noise import make_generator, noise_std
from raydp_train.train.step import cross_entropy_loss, private_step

sys.path.insert(0, str(Path(__file__).parent))
from hf_minilm import minilm_workload
from llama_step import LOSS, llama_workload
from step_overhead import CLIP_NORM, NOISE_MULTIPLIER, machine_facts, time_variants, write_section

WARMUP, BLOCK, ROUNDS, UPDATES = 1, 2, 4, 60
SECTION = "## Optimizer step: our single-tensor AdamW vs torch's foreach AdamW (benchmarks/optimizer_step.py)"
OPTIMIZERS = {"ours (single-tensor AdamW)": lambda params: AdamW(params, lr=1e-4),
              "torch AdamW(foreach=True)": lambda params: torch.optim.AdamW(params, lr=1e-4,
                                                                            foreach=True)}


def private_block(make_optimizer, loss):
    def build(model: nn.Module, features: Tensor, labels: Tensor):
        clipper = PerExampleClipper(model, CLIP_NORM)
        optimizer = make_optimizer([{"params": [p for p in model.parameters()
                                                if p.requires_grad]}])
        generator, _ = make_generator(0)
        std, batch = noise_std(NOISE_MULTIPLIER, CLIP_NORM), [(features, labels)]

        def block(k: int) -> None:
            for _ in range(k):
                private_step(model, clipper, optimizer, batch, loss, std, labels.shape[0],
                             generator)

        return block

    return build


def update_times(model: nn.Module) -> dict[str, list[float]]:
    """Seconds of one `optimizer.step()` on a fixed random gradient, round-robin blocks."""
    steppers = {}
    for name, make in OPTIMIZERS.items():
        params = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
        for param in params:
            param.grad = torch.randn_like(param) * 1e-3
        optimizer = make([{"params": params}])
        optimizer.step()  # state allocated, imports done
        steppers[name] = optimizer
    times = {name: [] for name in steppers}
    for _ in range(UPDATES // 3):
        for name, optimizer in steppers.items():
            start = time.perf_counter()
            for _ in range(3):
                optimizer.step()
            times[name].append((time.perf_counter() - start) / 3)
    return times


def rows(name: str, steps: dict, updates: dict, parameters: int, tensors: int) -> list[str]:
    ours, theirs = (statistics.median(steps[k]) for k in OPTIMIZERS)
    lines = []
    for key in OPTIMIZERS:
        step, update = statistics.median(steps[key]), statistics.median(updates[key])
        lines.append(f"| {name} ({parameters / 1e6:.1f}M numbers, {tensors} tensors) | {key} | "
                     f"{1e3 * step:.0f} | {1e3 * min(steps[key]):.0f} | {1e3 * update:.1f} |")
    lines.append(f"| | torch's minus ours | {1e3 * (theirs - ours):+.0f} | | "
                 f"{1e3 * (statistics.median(updates[list(OPTIMIZERS)[1]]) - statistics.median(updates[next(iter(OPTIMIZERS))])):+.1f} |")
    return lines


FIRST_USE = """
import time, torch
{setup}
parameter = torch.nn.Parameter(torch.zeros(8))
parameter.grad = torch.ones(8)
start = time.process_time()
optimizer = {make}
optimizer.step()
print(time.process_time() - start)
"""
FIRST_USES = {"ours (single-tensor AdamW)": ("from raydp_train.optim.updates import AdamW",
                                             "AdamW([{'params': [parameter]}])"),
              "torch AdamW(foreach=True)": ("", "torch.optim.AdamW([parameter], foreach=True)")}


def first_use_cpu_seconds(repeats: int = 3) -> dict[str, float]:
    """CPU seconds of a fresh process's first optimizer (built and stepped once), torch and
    the package already imported: what each worker of a run pays once."""
    seconds = {}
    for name, (setup, make) in FIRST_USES.items():
        code = FIRST_USE.format(setup=setup, make=make)
        runs = [float(subprocess.run([sys.executable, "-c", code], check=True,
                                     capture_output=True, text=True).stdout)
                for _ in range(repeats)]
        seconds[name] = statistics.median(runs)
    return seconds


def uptime() -> str:
    return subprocess.run(["uptime"], check=True, capture_output=True, text=True).stdout.strip()


def main() -> None:
    torch.set_num_threads(2)
    load_before = uptime()
    lines = [("| model | optimizer | private step, median (ms) | fastest (ms) | update alone, "
             "median (ms) |"), "|---|---|---:|---:|---:|"]
    for name, workload, loss in (("Llama", llama_workload(), LOSS),
                                 ("MiniLM", minilm_workload(), cross_entropy_loss)):
        workload.steps = ROUNDS * BLOCK
        builders = {key: private_block(make, loss) for key, make in OPTIMIZERS.items()}
        steps, contention = time_variants(workload, WARMUP, BLOCK, list(builders), builders)
        updates = update_times(workload.model)
        trained = [p for p in workload.model.parameters() if p.requires_grad]
        lines += rows(name, steps, updates, sum(p.numel() for p in trained), len(trained))
        print("\n".join(lines[-3:]), f"(contention {contention:.0%})", flush=True)
    first_use = first_use_cpu_seconds()
    load_after = uptime()
    text = "\n".join([
        SECTION, "", f"Machine: {machine_facts()}, {os.cpu_count()} cores seen.",
        f"Load (`uptime`) before: `{load_before}`; after: `{load_after}`.", "",
        (f"Method: per model, {WARMUP} warm-up steps per optimizer, then {ROUNDS} blocks of "
        f"{BLOCK} private steps round-robin (C {CLIP_NORM}, sigma {NOISE_MULTIPLIER}, "
        f"lr 1e-4); the update alone: {UPDATES} `optimizer.step()` calls each on a fixed "
        "gradient, in blocks of 3, round-robin."), "", *lines, "",
        "A fresh process's first optimizer, built and stepped once (CPU s, median of 3; torch "
        "and this package already imported): " + ", ".join(
            f"{name} {value:.2f}" for name, value in first_use.items()) + "."])
    write_section(Path(__file__).with_name("RESULTS.md"), text)
    print(text)


if __name__ == "__main__":
    main()
