"""Wall time of one training step: non-private vs our DP-SGD vs Opacus (hooks, ghost).

    .venv/bin/python benchmarks/step_overhead.py          # full run, minutes on 2 cores
    .venv/bin/python benchmarks/step_overhead.py --quick  # smoke run; prints, writes nothing
    .venv/bin/python benchmarks/step_overhead.py --models vit lstm transformer  # their section

Every variant starts from a copy of the same initial model and sees the same batch. Timed
blocks of consecutive steps run round-robin (one block of each variant in turn), so load
from other processes hits all variants alike. Our engine is first checked against the plain summed gradient, so a
broken engine is never benchmarked. The full run rewrites its own section of
benchmarks/RESULTS.md and keeps every other section.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import opacus
import torch
import transformers
from opacus.validators import ModuleValidator
from step_models import vision_and_sequence_workloads
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.noise import make_generator, noise_std
from raydp_train.train.step import cross_entropy_loss, private_step

LEARNING_RATE = 0.01
NOISE_MULTIPLIER = 1.0
CLIP_NORM = 1.0
SECTION = "## Step overhead (benchmarks/step_overhead.py)"
SECTION_VISION_SEQUENCE = ("## Step overhead: ViT-tiny, LSTM, nn.TransformerEncoder "
                           "(benchmarks/step_overhead.py)")
RESULTS = Path(__file__).with_name("RESULTS.md")
MODELS = ["mlp", "cnn", "bert", "vit", "lstm", "transformer"]
VISION_SEQUENCE = ("vit", "lstm", "transformer")
CORES = len(os.sched_getaffinity(0))
TARGET = "our DP-SGD step <= 1.2x the non-private step on the BERT-style encoder"
VISION_SEQUENCE_ANALYSIS = (
    "Where the time goes. TransformerEncoder: the attention's projections are Linear calls "
    "whose output gradients the model's own backward brings (its forward is computed from its"
    ' parts inside the hooks); what is left over non-private is the ghost norms (T = 64) and '
    'clipped sums of the Linear layers and the noise. An earlier run of this section, with '
    "the projections' gradients recomputed (one more forward of the projections and attention"
    ' and one backward of the attention per call, about 110 ms of a 627 ms micro-batch in a '
    "profile), measured 1.47x. ViT: HF's attention is made of Linear layers (their rule); the"
    ' extra time is mostly the per-example path of `vit.embeddings` (cls token and position '
    'embeddings: the embeddings module, patch convolution included, recomputed per example '
    'under vmap). LSTM: its rule recomputes the recurrence step by step in Python (32 steps) '
    'and backpropagates it once, most of its ~6x of a fused-kernel step; before the rule the '
    "LSTM took the per-example path, one example at a time (vmap cannot batch torch's LSTM), "
    'about 1.1 s per micro-batch on this machine, some 20x non-private. Absolute times are '
    'inflated several times by the load (CPU contention near 100%, load average 16-36 on 2 '
    'cores): read the ratios, measured round-robin in one process; a rerun moves them by '
    'about 0.1-0.2x.'
)
OVERHEAD_ANALYSIS = (
    "Where our extra time goes on the encoder, per step (about 100 ms over a ~300 ms "
    "non-private step, profiled section by section): the single Gaussian draw for 11.2M "
    "parameters, 25-30 ms (torch's `normal_` runs on one thread; we split it into one chunk "
    "per torch thread, each from its own generator seeded by the step's generator); the "
    "per-example norms, about 40 ms, of which the ghost-norm Gram matrices of the Linear "
    "layers are about 30 ms (2 GMAC, about 10% of the ~20 GMAC of a non-private forward and "
    "backward, as small batched matmuls; Q, K and V share one input Gram), LayerNorm "
    "per-example gradients about 7 ms; and the forward hooks, about 8 ms. The clipped weight "
    "sums cost no more than non-private weight gradients (autograd skips those: ghost "
    "differentiation), and in the last layer only the [CLS] position has a gradient for Q, "
    "the attention output and the FFN, so those are formed from one token. Noise (~9%) plus "
    "the Gram matrices (~10%) alone put the floor of this method near 1.2x on these 2 vCPUs. "
    "On the small MLP the noise draw (670k parameters) costs about as much as a whole "
    "non-private step, which is most of the gap."
)


@dataclass
class Workload:
    name: str
    description: str
    model: nn.Module  # the initial model; every variant trains a deep copy
    features: Tensor
    labels: Tensor
    steps: int


class BertClassifier(nn.Module):
    """BertForSequenceClassification on token ids, returning logits.

    HF BERT's default position ids have shape [1, T] (broadcast over the batch); per-example
    clipping needs every layer's leading dimension to be the example dimension, so position
    and token type ids are passed as [B, T], contiguous (Opacus ghost `.view`s Embedding ids).
    """

    def __init__(self, config: transformers.BertConfig):
        super().__init__()
        self.bert = transformers.BertForSequenceClassification(config)

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        positions, types = positions.repeat(input_ids.shape[0], 1), torch.zeros_like(input_ids)
        return self.bert(input_ids=input_ids, position_ids=positions, token_type_ids=types).logits


def conv_block(in_channels: int, out_channels: int) -> list[nn.Module]:
    # GroupNorm, not BatchNorm: BatchNorm mixes examples, which DP-SGD cannot clip.
    conv = nn.Conv2d(in_channels, out_channels, 3, padding=1)
    return [conv, nn.GroupNorm(4, out_channels), nn.ReLU(), nn.MaxPool2d(2)]


def make_workloads(steps: int | None, names: list[str]) -> list[Workload]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                        nn.Linear(512, 10))
    cnn = nn.Sequential(*conv_block(1, 16), *conv_block(16, 32), nn.Flatten(), nn.Linear(1568, 10))
    config = transformers.BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=1024, num_labels=2,
                                     attn_implementation="sdpa")
    tokens = torch.randint(0, config.vocab_size, (32, 64))
    workloads = vision_and_sequence_workloads(Workload, steps) + [
        Workload("mlp", "MLP 784-512-512-10, B=64", mlp,
                 torch.randn(64, 784), torch.randint(0, 10, (64,)), steps or 20),
        Workload("cnn", "CNN 2x(Conv3x3/GroupNorm/ReLU/MaxPool) 16-32ch + Linear, 1x28x28, B=64",
                 cnn, torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,)), steps or 20),
        Workload("bert", "BERT-style encoder (hidden 256, 4 layers, 4 heads, FFN 1024, "
                 "vocab 30522, 2 labels), B=32, T=64", BertClassifier(config), tokens,
                 torch.randint(0, 2, (32,)), steps or 20),
    ]
    return [w for w in workloads if w.name in names]


Block = Callable[[int], None]  # a variant: runs k consecutive training steps


def plain_loop(model: nn.Module, optimizer, criterion, features: Tensor, labels: Tensor) -> Block:
    """Non-private and Opacus steps: Opacus's hooks and DPOptimizer work inside these calls."""

    def block(k: int) -> None:
        for _ in range(k):
            optimizer.zero_grad()
            criterion(model(features), labels).backward()
            optimizer.step()

    return block


def non_private(model: nn.Module, features: Tensor, labels: Tensor) -> Block:
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    return plain_loop(model, optimizer, nn.CrossEntropyLoss(), features, labels)


def ours(model: nn.Module, features: Tensor, labels: Tensor, precision: str = "fp32") -> Block:
    clipper = PerExampleClipper(model, CLIP_NORM)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    generator, _ = make_generator(0)
    std, batch = noise_std(NOISE_MULTIPLIER, CLIP_NORM), [(features, labels)]

    def block(k: int) -> None:
        for _ in range(k):
            private_step(model, clipper, optimizer, batch, cross_entropy_loss,
                         std, labels.shape[0], generator, precision=precision)

    return block


def opacus_variant(mode: str) -> Callable[[nn.Module, Tensor, Tensor], Block]:
    def build(model: nn.Module, features: Tensor, labels: Tensor) -> Block:
        if ModuleValidator.validate(model, strict=False):
            # What an Opacus user does: nn.MultiheadAttention -> DPMultiheadAttention,
            # nn.LSTM -> DPLSTM (same parameters, its own layers).
            model = ModuleValidator.fix(model)
        # One batch of B examples; no Poisson sampling, so expected batch size = B.
        loader = DataLoader(TensorDataset(features, labels), batch_size=labels.shape[0])
        made = opacus.PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=LEARNING_RATE),
            criterion=nn.CrossEntropyLoss(), data_loader=loader, poisson_sampling=False,
            noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=CLIP_NORM, grad_sample_mode=mode,
        )
        # Ghost clipping wraps the loss: its backward() runs the two backward passes.
        criterion = made[2] if mode == "ghost" else nn.CrossEntropyLoss()
        return plain_loop(made[0], made[1], criterion, features, labels)

    return build


VARIANTS = {"non-private": non_private, "ours (private_step)": ours,
            "Opacus hooks": opacus_variant("hooks"), "Opacus ghost": opacus_variant("ghost")}


def check_engine(workload: Workload, per_example_loss=cross_entropy_loss) -> float:
    """Relative error of our clipped sum (no clipping in effect) vs the plain gradient of the
    summed per-example losses."""
    reference = copy.deepcopy(workload.model).eval()  # eval: dropout off, both runs identical
    per_example_loss(reference, workload.features, workload.labels).sum().backward()
    model = copy.deepcopy(workload.model).eval()
    clipper = PerExampleClipper(model, clip_norm=1e12)
    clipper.accumulate(lambda: per_example_loss(model, workload.features, workload.labels))
    clipper.close()
    ours_sum = torch.cat([p.grad.flatten() for p in model.parameters()])
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()])
    return ((ours_sum - expected).norm() / expected.norm()).item()


def cpu_wait_seconds() -> float:
    """Seconds some task waited for a CPU since boot (Linux PSI); nan where unavailable."""
    psi = Path("/proc/pressure/cpu")
    return float(psi.read_text().split("total=")[1].split()[0]) / 1e6 if psi.exists() else math.nan


def time_variants(workload: Workload, warmup: int, block: int,
                  variants: list[str] | None = None, more: dict | None = None) -> tuple[dict, float]:
    """Per variant (all, or the named ones; `more`: other name -> builder): step times in
    seconds (each a block's time / its steps), or 'n/a (reason)' if it cannot run; and the
    fraction of the timed wall time during which some task waited for a CPU. Blocks of
    consecutive steps run round-robin."""
    known = {**VARIANTS, **(more or {})}
    chosen = {name: known[name] for name in (variants or known)}
    blocks: dict[str, Block] = {}
    failures: dict[str, str] = {}
    for name, build in chosen.items():
        try:
            model = copy.deepcopy(workload.model).train()
            blocks[name] = build(model, workload.features, workload.labels)
            blocks[name](warmup)
        except Exception as error:  # an Opacus limitation is a result; ours failing is not
            if not name.startswith("Opacus"):
                raise
            message = " ".join(f"{type(error).__name__}: {error}".replace("|", "/").split())
            failures[name] = f"n/a ({message[:120]})"
            print(f"  {name}: {failures[name]}", flush=True)
            blocks.pop(name, None)
    times: dict[str, list[float]] = {name: [] for name in blocks}
    wall, pressure = time.perf_counter(), cpu_wait_seconds()
    rounds = max(1, workload.steps // block)
    for index in range(rounds):
        for name, run_block in blocks.items():
            start = time.perf_counter()
            run_block(block)
            times[name].append((time.perf_counter() - start) / block)
        line = ", ".join(f"{name} {1e3 * t[-1]:.1f} ms" for name, t in times.items())
        print(f"  block {index + 1}/{rounds} ({block} steps): {line}", flush=True)
    contention = (cpu_wait_seconds() - pressure) / (time.perf_counter() - wall)
    return {name: failures.get(name) or times[name] for name in chosen}, contention


def table(results: dict[str, str | list[float]]) -> list[str]:
    """Median and fastest step per variant, each also as a ratio to the non-private step."""
    base = results["non-private"]
    lines = ["| variant | median step (ms) | vs non-private | fastest step (ms) | vs non-private |",
             "|---|---:|---:|---:|---:|"]
    for name, value in results.items():
        if isinstance(value, str):
            lines.append(f"| {name} | {value} | - | - | - |")
            continue
        median, fastest = statistics.median(value), min(value)
        lines.append(f"| {name} | {1e3 * median:.1f} | {median / statistics.median(base):.2f}x "
                     f"| {1e3 * fastest:.1f} | {fastest / min(base):.2f}x |")
    return lines


def machine_facts() -> str:
    return (f"{CORES} CPU cores, torch.set_num_threads({torch.get_num_threads()}), "
            f"Python {sys.version.split()[0]}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, opacus {opacus.__version__}")


def method_text(warmup: int, block: int, dropout: str) -> str:
    return (
        f"Method: {warmup} warm-up steps per variant, then timed blocks of {block} consecutive "
        "steps round-robin (one block of each variant in turn); a step's time is its block's "
        f"time / {block}. A step: forward, backward, clipping, noise, SGD update; "
        f"sigma {NOISE_MULTIPLIER}, C {CLIP_NORM}, one micro-batch = the batch. Same initial "
        f"weights and batch for all; train mode ({dropout}), attention "
        '"sdpa". Opacus: `make_private(..., poisson_sampling=False)`, its DPOptimizer clips and '
        "adds noise. *CPU contention*: share of the timed wall time some task waited for a CPU "
        "(Linux PSI); when high, other processes inflated the times (trust the fastest step)."
    )


def section(workloads: list[Workload], results: dict, contention: dict, command: str,
            warmup: int, block: int) -> str:
    lines = [SECTION, "", f"Command: `{command}` (from the repository root)", "",
             f"Machine: {machine_facts()}.", "",
             method_text(warmup, block, "BERT dropout at its HF default 0.1"), "",
             f"Target: {TARGET} (Opacus hooks is about 3.7x there).", ""]
    for workload in workloads:
        parameters = sum(p.numel() for p in workload.model.parameters())
        facts = (f"{parameters:,} trainable parameters, {workload.steps} timed steps, "
                 f"CPU contention {contention[workload.name]:.0%}.")
        lines += [f"### {workload.name}: {workload.description}", "", facts, "",
                  *table(results[workload.name]), ""]
    if "bert" in results and not isinstance(results["bert"].get("ours (private_step)"), str):
        ratio = (statistics.median(results["bert"]["ours (private_step)"])
                 / statistics.median(results["bert"]["non-private"]))
        status = (f"**Status against the target: {'met' if ratio <= 1.2 else 'not met'}** "
                  f"({ratio:.2f}x median on the BERT-style encoder vs the 1.2x goal).")
        lines += [status, "", OVERHEAD_ANALYSIS]
    return "\n".join(lines)


def per_example_path_modules(workload: Workload) -> list[str]:
    """The modules of the workload's model that take the per-example path (no native rule)."""
    clipper = PerExampleClipper(copy.deepcopy(workload.model), CLIP_NORM)
    clipper.close()
    return clipper.per_example_path


def load_average() -> str:
    return "load average {:.2f}, {:.2f}, {:.2f}".format(*os.getloadavg())


def vision_sequence_section(workloads: list[Workload], results: dict, contention: dict,
                            loads: dict, command: str, warmup: int, block: int) -> str:
    """The section of the ViT, LSTM and TransformerEncoder workloads, with the status of each
    against its targets."""
    lines = [SECTION_VISION_SEQUENCE, "", f"Command: `{command}` (from the repository root)", "",
             (f"Machine: {machine_facts()}; the 2 cores are shared with other work: the load "
             "average (`uptime`) before and after each model is given."), "",
             method_text(warmup, block, "dropout 0: a module's dropout inside the per-example "
                         "recomputation is refused"), "",
             ("Opacus cannot train `nn.MultiheadAttention` or `nn.LSTM` as they are; it runs on "
             "`ModuleValidator.fix`'s copy (DPMultiheadAttention, DPLSTM), as its users do."), "",
             ("Targets: ours faster than every Opacus variant on each model; at most 1.3x the "
             "non-private step where only native rules are used."), ""]
    for workload in workloads:
        parameters = sum(p.numel() for p in workload.model.parameters())
        path = per_example_path_modules(workload)
        facts = (f"{parameters:,} trainable parameters, {workload.steps} timed steps, "
                 f"CPU contention {contention[workload.name]:.0%}; before: "
                 f"{loads[workload.name][0]}, after: {loads[workload.name][1]}. Per-example "
                 f"path: {', '.join(f'`{n}`' for n in path) or 'none (native rules only)'}.")
        lines += [f"### {workload.name}: {workload.description}", "", facts, "",
                  *table(results[workload.name]), "", status_line(results[workload.name], path),
                  ""]
    return "\n".join([*lines, VISION_SEQUENCE_ANALYSIS])


def status_line(results: dict, path: list[str]) -> str:
    ours_median = statistics.median(results["ours (private_step)"])
    ratio = ours_median / statistics.median(results["non-private"])
    opacus = {name: statistics.median(value) for name, value in results.items()
              if name.startswith("Opacus") and not isinstance(value, str)}
    ahead = all(ours_median < value for value in opacus.values())
    parts = [(f"ours {'ahead of' if ahead else 'NOT ahead of'} "
             f"{', '.join(opacus) or 'no Opacus variant that runs'} (median)"),
             f"{ratio:.2f}x non-private"]
    if not path:
        parts.append(f"1.3x target {'met' if ratio <= 1.3 else 'not met'}")
    return "Status: " + "; ".join(parts) + "."


def write_section(path: Path, text: str) -> None:
    """Replace the section `text` starts with (its `## ` line) or append it; keep the rest."""
    title = text.split("\n", 1)[0]
    header = (f"# Benchmark results\n\nResults are ratios measured in one process on this machine: "
              f"{CORES} CPU cores, torch {torch.__version__}, {datetime.date.today()}.\n")
    old = path.read_text() if path.exists() else header
    start = old.find(title)
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = old.find("\n## ", start + len(title))
        rest = old[end + 1:] if end >= 0 else ""
        new = old[:start] + text.rstrip("\n") + ("\n\n" + rest if rest else "")
    path.write_text(new.rstrip("\n") + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="timed steps per variant (default 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--block", type=int, default=4, help="consecutive steps timed together")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=MODELS[:3], choices=MODELS)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 warm-up and 2 timed steps; RESULTS.md is not written")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.block = 2, 1, 1
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message="Secure RNG turned off")  # Opacus, expected
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # Opacus, harmless
    print(f"Machine: {machine_facts()}", flush=True)

    workloads = make_workloads(args.steps, args.models)
    for workload in workloads:
        error = check_engine(workload)
        print(f"{workload.name}: engine check, relative error {error:.2e}", flush=True)
        if not error < 1e-4:
            sys.exit(f"ABORT: on '{workload.name}' our clipped sum (sigma 0, clip norm 1e12) is "
                     f"{error:.2e} (relative) off the summed gradient: the engine is broken")

    results, contention, loads = {}, {}, {}
    for workload in workloads:
        print(f"{workload.name}: {workload.description}", flush=True)
        before = load_average()
        results[workload.name], contention[workload.name] = time_variants(workload, args.warmup, args.block)
        loads[workload.name] = (before, load_average())
        print("\n".join(table(results[workload.name])), flush=True)
        print(f"  CPU contention while timing: {contention[workload.name]:.0%}; "
              f"{loads[workload.name]}", flush=True)

    if not args.quick:
        command = " ".join([os.path.relpath(sys.executable), *sys.argv])
        classic = [w for w in workloads if w.name not in VISION_SEQUENCE]
        newer = [w for w in workloads if w.name in VISION_SEQUENCE]
        if classic:
            write_section(RESULTS, section(classic, results, contention, command, args.warmup,
                                           args.block))
        if newer:
            write_section(RESULTS, vision_sequence_section(newer, results, contention, loads,
                                                           command, args.warmup, args.block))
        print(f"wrote {RESULTS}", flush=True)


if __name__ == "__main__":
    main()
