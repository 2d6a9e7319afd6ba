"""DP-LoRA's step time on the real pretrained MiniLM next to DP-SGD's and non-private's: B = 32
SST-2 sentences at T = 64 tokens (the workload of benchmarks/hf_minilm.py).

    .venv/bin/python benchmarks/lora_step.py          (a few minutes on 2 cores)

DP-SGD trains all 22.7M parameters; DP-LoRA (privacy/lora.py) puts rank-8 adapters on every
Linear layer with min(in, out) > 8 (the 2-output head trains as in DP-SGD), base weights
frozen. Same round-robin timing as benchmarks/step_overhead.py, in one process.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from raydp_train.config.pipeline import LoraConfig
from raydp_train.privacy.mechanism import LowRankAdapters
from raydp_train.privacy.noise import make_generator, noise_std
from raydp_train.train.step import cross_entropy_loss, private_step

sys.path.insert(0, str(Path(__file__).parent))
from hf_minilm import BLOCK, WARMUP, minilm_workload
from step_overhead import (
    CLIP_NORM,
    LEARNING_RATE,
    NOISE_MULTIPLIER,
    machine_facts,
    table,
    time_variants,
    write_section,
)

RANK = 8


def dp_lora(model, features, labels):
    mechanism = LowRankAdapters(SimpleNamespace(lora=LoraConfig(rank=RANK)),
                                torch.Generator().manual_seed(0))
    clipper = mechanism.attach(model, CLIP_NORM)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                lr=LEARNING_RATE)
    generator, _ = make_generator(0)
    std, batch = noise_std(NOISE_MULTIPLIER, CLIP_NORM), [(features, labels)]

    def block(k: int) -> None:
        for _ in range(k):
            private_step(model, clipper, optimizer, batch, cross_entropy_loss, std,
                         labels.shape[0], generator, mechanism=mechanism)

    return block


def main() -> None:
    torch.set_num_threads(2)
    workload = minilm_workload()
    name = f"ours DP-LoRA (rank {RANK})"
    times, contention = time_variants(workload, WARMUP, BLOCK,
                                      ["non-private", "ours (private_step)", name],
                                      more={name: dp_lora})
    print("\n".join(table(times)), flush=True)
    lora, dpsgd = statistics.median(times[name]), statistics.median(times["ours (private_step)"])
    lines = ["## DP-LoRA step time on MiniLM (benchmarks/lora_step.py)", "",
             f"Machine: {machine_facts()}; CPU contention during the timing {contention:.0%}.", "",
             (f"{workload.description}. DP-SGD trains every parameter; DP-LoRA rank-{RANK} "
              "adapters on every Linear layer with min(in, out) > 8 (base weights frozen, the "
              "2-output head as in DP-SGD). Median step times:"), "",
             *table(times), "",
             f"DP-LoRA / DP-SGD step time: **{lora / dpsgd:.2f}x**."]
    write_section(Path(__file__).with_name("RESULTS.md"), "\n".join(lines))


if __name__ == "__main__":
    main()
