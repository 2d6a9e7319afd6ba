"""Step times on one device (benchmarks/gpu_check.sh): non-private, our DP-SGD and DP-LoRA
steps and Opacus's ghost clipping, on MiniLM (SST-2, B = 32, T = 64) and the Llama decoder
of benchmarks/llama_step.py (B = 16, T = 128), in fp32 and bf16 (Opacus: fp32 only).

    .venv/bin/python benchmarks/gpu_step.py --device cuda
    .venv/bin/python benchmarks/gpu_step.py --device cpu --dry-run      (2 rows, 16 tokens, 1 step)

Every variant trains its own copy of the same initial model on the same batch; each step is
timed alone, between device synchronizations. Before timing, one DP-SGD step checks that
every gradient, the noise and the optimizer state are on the device.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from hf_minilm import minilm_workload
from llama_step import LOSS as LLAMA_LOSS
from llama_step import llama_workload
from llama_step import opacus_variant as llama_opacus
from lora_step import RANK
from step_overhead import CLIP_NORM, LEARNING_RATE, NOISE_MULTIPLIER, Workload
from step_overhead import opacus_variant as classifier_opacus

from raydp_train.config.pipeline import LoraConfig
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.mechanism import LowRankAdapters
from raydp_train.privacy.noise import make_generator, noise_std
from raydp_train.train.step import cross_entropy_loss, in_precision, private_step

Step = Callable[[], None]


def plain_step(model: nn.Module, loss, batch, precision: str, device: torch.device) -> Step:
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    compute_losses = in_precision(loss, precision, device.type)

    def step() -> None:
        optimizer.zero_grad()
        compute_losses(model, *batch).mean().backward()
        optimizer.step()

    return step


def our_step(model: nn.Module, loss, batch, precision: str, device: torch.device,
             lora: bool = False) -> Step:
    mechanism = None
    if lora:
        mechanism = LowRankAdapters(SimpleNamespace(lora=LoraConfig(rank=RANK)),
                                    torch.Generator().manual_seed(0))
        clipper = mechanism.attach(model, CLIP_NORM)
    else:
        clipper = PerExampleClipper(model, CLIP_NORM)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                lr=LEARNING_RATE)
    generator, _ = make_generator(0, device)
    std, rows = noise_std(NOISE_MULTIPLIER, CLIP_NORM), batch[1].shape[0]
    options = {"mechanism": mechanism} if mechanism else {}

    def step() -> None:
        private_step(model, clipper, optimizer, [batch], loss, std, rows, generator,
                     precision=precision, **options)

    step.clipper = clipper
    return step


def opacus_ghost_step(workload: Workload) -> Callable:
    """Opacus's ghost clipping (its make_private over the same batch); fp32 only: it has no
    precision option of ours."""
    build = (llama_opacus if workload.name == "llama" else classifier_opacus)("ghost")

    def make(model: nn.Module, batch, precision: str, device: torch.device) -> Step | None:
        if precision != "fp32":
            return None
        block = build(model, *batch)
        return lambda: block(1)

    return make


def variants(workload: Workload, loss) -> dict[str, Callable]:
    """name -> (model, batch, precision, device) -> Step (None: not in this precision)."""
    return {
        "non-private": lambda m, b, p, d: plain_step(m, loss, b, p, d),
        "ours DP-SGD": lambda m, b, p, d: our_step(m, loss, b, p, d),
        f"ours DP-LoRA (rank {RANK})": lambda m, b, p, d: our_step(m, loss, b, p, d, lora=True),
        "Opacus ghost": opacus_ghost_step(workload),
    }


def workloads(dry_run: bool) -> list[tuple[Workload, object]]:
    chosen = [(minilm_workload(), cross_entropy_loss), (llama_workload(), LLAMA_LOSS)]
    if dry_run:  # the same code on a sliver of each batch
        for workload, _ in chosen:
            workload.features, workload.labels = workload.features[:2, ..., :16], workload.labels[:2]
    return chosen


def check_on_device(workload: Workload, loss, device: torch.device) -> None:
    """One DP-SGD step: every gradient, the optimizer state and the parameters stay on `device`."""
    model = copy.deepcopy(workload.model).to(device).train()
    batch = (workload.features.to(device), workload.labels.to(device))
    step = our_step(model, loss, batch, "fp32", device)
    step()
    flat = step.clipper.flat_grad
    stray = [name for name, p in model.named_parameters()
             if p.device.type != device.type or (p.grad is not None and p.grad.device.type != device.type)]
    if stray or flat.device.type != device.type:
        raise AssertionError(f"left {device}: {stray[:5] or 'the gradient buffer'}")
    step.clipper.close()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(workload: Workload, loss, device: torch.device, precision: str, warmup: int,
               steps: int) -> dict[str, float | None]:
    """Median seconds per step of each variant (None: not run in this precision)."""
    batch = (workload.features.to(device), workload.labels.to(device))
    medians: dict[str, float | None] = {}
    for name, build in variants(workload, loss).items():
        model = copy.deepcopy(workload.model).to(device).train()
        step = build(model, batch, precision, device)
        if step is None:
            medians[name] = None
            continue
        for _ in range(warmup):
            step()
        times = []
        for _ in range(steps):
            synchronize(device)
            start = time.perf_counter()
            step()
            synchronize(device)
            times.append(time.perf_counter() - start)
        medians[name] = statistics.median(times)
        print(f"  {workload.name} {precision} {name}: {1e3 * medians[name]:.1f} ms", flush=True)
    return medians


def table(rows: list[tuple[str, str, dict]]) -> list[str]:
    names = list(rows[0][2])
    lines = ["| model | precision | " + " | ".join(f"{n} (ms)" for n in names)
             + " | ours DP-SGD / non-private |", "|---|---|" + "---:|" * (len(names) + 1)]
    for model, precision, medians in rows:
        cells = ["-" if t is None else f"{1e3 * t:.1f}" for t in medians.values()]
        ratio = medians["ours DP-SGD"] / medians["non-private"]
        lines.append(f"| {model} | {precision} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="2 rows, 16 tokens, 1 step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, help="write the table here (markdown)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    device = torch.device(args.device)
    warmup, steps = (0, 1) if args.dry_run else (3, args.steps)
    rows = []
    for workload, loss in workloads(args.dry_run):
        check_on_device(workload, loss, device)
        for precision in ("fp32", "bf16"):
            rows.append((workload.name, precision,
                         time_steps(workload, loss, device, precision, warmup, steps)))
    text = "\n".join(table(rows))
    print(text, flush=True)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
