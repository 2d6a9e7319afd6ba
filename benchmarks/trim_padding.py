"""`training.trim_padding`'s step time on SST-2: DP-LoRA (rank 8 on every encoder Linear of
the pretrained MiniLM, as benchmarks/lora_step.py) over Poisson samples of the 6,920 training
sentences padded to 48 tokens, cut into micro-batches of 64, with and without trimming.

    .venv/bin/python benchmarks/trim_padding.py          (about 5 minutes on 2 cores)

Both samplers draw from the same seed, so round k times the same sample both ways; the
variants alternate round by round in one process.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import torch

from raydp_train.config.pipeline import LoraConfig
from raydp_train.models.hf import build_hf_model
from raydp_train.models.hf_files import load_tokenizer
from raydp_train.privacy.mechanism import LowRankAdapters
from raydp_train.privacy.noise import make_generator, noise_std
from raydp_train.train.length_batches import token_counts
from raydp_train.train.samplers import MemorySampler
from raydp_train.train.step import cross_entropy_loss, private_step

sys.path.insert(0, str(Path(__file__).parent))
from hf_minilm import MODEL, SST2
from lora_step import freeze_embeddings
from step_overhead import cpu_wait_seconds, machine_facts, write_section

MAX_LENGTH, BATCH, PHYSICAL, ROUNDS = 48, 256, 64, 6
TITLE = "## Trimming padding: DP-LoRA step time on SST-2 (benchmarks/trim_padding.py)"


def sst2_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    table = pq.read_table(SST2)
    encoded = load_tokenizer(MODEL)(table.column("sentence").to_pylist(), padding="max_length",
                                    truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
    tokens = torch.stack([encoded["input_ids"], encoded["attention_mask"]], dim=1)
    return tokens, torch.tensor(table.column("label").to_pylist())


def step_runner(tokens, labels, trim: bool):
    """One private step per call on the sampler's next sample; returns the widths it ran."""
    torch.manual_seed(0)
    model = build_hf_model(MODEL, num_labels=2).train()
    freeze_embeddings(model)
    mechanism = LowRankAdapters(SimpleNamespace(lora=LoraConfig(rank=8)),
                                torch.Generator().manual_seed(0))
    clipper = mechanism.attach(model, 1.0)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    local = SimpleNamespace(train_features=tokens, train_labels=labels, num_train=len(labels))
    sampler = MemorySampler(local, None, torch.Generator().manual_seed(1), BATCH / len(labels),
                            PHYSICAL, "cpu", trim_padding=trim)
    generator, _ = make_generator(0)

    def step() -> list[int]:
        batches = list(sampler.step_batches())
        private_step(model, clipper, optimizer, batches, cross_entropy_loss,
                     noise_std(1.0, 1.0), BATCH, generator, mechanism=mechanism)
        return [features.shape[-1] for features, _ in batches]

    return step


def main() -> None:
    torch.set_num_threads(2)
    tokens, labels = sst2_tokens()
    steps = {"padded to 48": step_runner(tokens, labels, False),
             "trimmed": step_runner(tokens, labels, True)}
    times = {name: [] for name in steps}
    widths = {name: [] for name in steps}
    for name, step in steps.items():
        step()  # warm-up
    wall, pressure = time.perf_counter(), cpu_wait_seconds()
    for index in range(ROUNDS):
        for name, step in steps.items():
            start = time.perf_counter()
            widths[name] += step()
            times[name].append(time.perf_counter() - start)
        print(f"  round {index + 1}/{ROUNDS}: "
              + ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items()), flush=True)
    contention = (cpu_wait_seconds() - pressure) / (time.perf_counter() - wall)
    base = statistics.median(times["padded to 48"])
    rows = [f"| {name} | {statistics.mean(widths[name]):.1f} | {statistics.median(t):.2f} | "
            f"{statistics.median(t) / base:.2f}x |" for name, t in times.items()]
    mean_tokens = token_counts(tokens).double().mean().item()
    lines = [TITLE, "", (f"Machine: {machine_facts()}; CPU contention during the timing "
                         f"{contention:.0%}."), "",
             (f"Expected batch {BATCH} of the {len(labels):,} sentences (mean {mean_tokens:.1f} "
              f"tokens, padded to {MAX_LENGTH}), micro-batches of {PHYSICAL}, DP-LoRA rank 8 on "
              f"every encoder Linear; median of {ROUNDS} steps each, the same samples both "
              "ways:"), "",
             "| micro-batches | mean width (tokens) | median step (s) | vs padded |",
             "|---|---:|---:|---:|", *rows]
    print("\n".join(lines), flush=True)
    write_section(Path(__file__).with_name("RESULTS.md"), "\n".join(lines))


if __name__ == "__main__":
    main()
