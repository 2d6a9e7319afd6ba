"""DP-LoRA with its frozen base in fp32 and in bf16 (`model.frozen_dtype`,
models/frozen_precision.py): the bytes of the weights, the peak resident memory of a process
that builds the model and takes steps, and the median step time, on the real pretrained MiniLM
(SST-2, B = 32, T = 64) and the Llama decoder config of benchmarks/llama_step.py (B = 16,
T = 128). Rank-8 adapters on every Linear layer, everything else frozen
(`lora.train_other: freeze`). Each variant runs in a fresh spawned process, one after another.

    .venv/bin/python benchmarks/frozen_precision.py      (a few minutes on 2 cores)
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

from raydp_train.config.pipeline import LoraConfig
from raydp_train.models.frozen_precision import keep_frozen_in
from raydp_train.privacy.mechanism import LowRankAdapters
from raydp_train.privacy.noise import make_generator, noise_std
from raydp_train.train.step import cross_entropy_loss, private_step

sys.path.insert(0, str(Path(__file__).parent))
from hf_minilm import _status_kb, minilm_workload
from llama_step import LOSS, llama_workload
from step_overhead import CLIP_NORM, LEARNING_RATE, NOISE_MULTIPLIER, machine_facts, write_section

STEPS, WARMUP, RANK = 5, 1, 8
WORKLOADS = {"MiniLM": (minilm_workload, cross_entropy_loss), "Llama": (llama_workload, LOSS)}


def measure(workload_name: str, frozen_dtype: str, queue) -> None:
    """In a fresh process: (weight MiB, frozen MiB, peak RSS MiB, median step seconds)."""
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore")
    make, loss = WORKLOADS[workload_name]
    workload = make()
    model = workload.model.train()
    mechanism = LowRankAdapters(
        SimpleNamespace(lora=LoraConfig(rank=RANK, train_other="freeze")),
        torch.Generator().manual_seed(0))
    clipper = mechanism.attach(model, CLIP_NORM)
    keep_frozen_in(model, frozen_dtype)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                lr=LEARNING_RATE)
    generator, _ = make_generator(0)
    std, batch = noise_std(NOISE_MULTIPLIER, CLIP_NORM), [(workload.features, workload.labels)]
    seconds = []
    for _ in range(WARMUP + STEPS):
        start = time.perf_counter()
        private_step(model, clipper, optimizer, batch, loss, std, workload.labels.shape[0],
                     generator, mechanism=mechanism)
        seconds.append(time.perf_counter() - start)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    queue.put((weights / 2**20, frozen / 2**20, _status_kb("VmHWM") / 1024,
               statistics.median(seconds[WARMUP:])))


def run(workload_name: str, frozen_dtype: str):
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=measure, args=(workload_name, frozen_dtype, queue))
    process.start()
    process.join()
    result = queue.get() if process.exitcode == 0 else None
    print(f"  {workload_name} {frozen_dtype}: {result}", flush=True)
    return result


def main() -> None:
    rows = [("| model | frozen base | weights (MiB) | of them frozen (MiB) | peak RSS (MiB) | "
            "median step (s) |"), "|---|---|---:|---:|---:|---:|"]
    for name in WORKLOADS:
        for frozen_dtype in ("fp32", "bf16"):
            result = run(name, frozen_dtype)
            rows.append(f"| {name} | {frozen_dtype} | " + (
                " | ".join(f"{v:.0f}" for v in result[:3]) + f" | {result[3]:.2f} |"
                if result else "failed | - | - | - |"))
    print("\n".join(rows))
    load = os.getloadavg()[0]
    lines = ["## DP-LoRA on a bf16 frozen base (benchmarks/frozen_precision.py)", "",
             (f"Machine: {machine_facts()}; 1-minute load {load:.1f} at the end (the step "
             "times include other work on the 2 cores)."), "", __doc__.split("\n\n")[0], "",
             *rows]
    write_section(Path(__file__).with_name("RESULTS.md"), "\n".join(lines))


if __name__ == "__main__":
    main()
