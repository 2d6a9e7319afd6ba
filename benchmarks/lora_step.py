"""DP-LoRA's step time on the real pretrained MiniLM next to DP-SGD's and non-private's: B = 32
SST-2 sentences at T = 64 tokens (the workload of benchmarks/hf_minilm.py).

    .venv/bin/python benchmarks/lora_step.py          (a few minutes on 2 cores)

DP-SGD trains all 22.7M parameters (full fine-tuning), or the encoder layers + head with the
embeddings frozen; DP-LoRA (privacy/lora.py, as Yu et al. 2022 fine-tune) puts rank-8
adapters on every encoder Linear layer, base weights and embeddings frozen, the LayerNorms and
the head trained as in DP-SGD. Same round-robin timing as benchmarks/step_overhead.py, in one
process.
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
    ours,
    table,
    time_variants,
    write_section,
)

RANK = 8
LORA, ENCODER = f"ours DP-LoRA (rank {RANK})", "ours DP-SGD (encoder + head)"


def freeze_embeddings(model) -> None:
    for name, parameter in model.named_parameters():
        if ".embeddings." in name or ".pooler." in name:
            parameter.requires_grad_(False)


def dp_sgd_encoder(model, features, labels):
    freeze_embeddings(model)
    return ours(model, features, labels)


def dp_lora(model, features, labels):
    freeze_embeddings(model)
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
    times, contention = time_variants(workload, WARMUP, BLOCK,
                                      ["non-private", "ours (private_step)", ENCODER, LORA],
                                      more={LORA: dp_lora, ENCODER: dp_sgd_encoder})
    print("\n".join(table(times)), flush=True)
    lora, dpsgd = statistics.median(times[LORA]), statistics.median(times["ours (private_step)"])
    encoder = statistics.median(times[ENCODER])
    lines = ["## DP-LoRA step time on MiniLM (benchmarks/lora_step.py)", "",
             f"Machine: {machine_facts()}; CPU contention during the timing {contention:.0%}.", "",
             (f"{workload.description}. *ours (private_step)*: DP-SGD on every parameter; "
              "*encoder + head*: DP-SGD with the embeddings frozen; DP-LoRA: rank-"
              f"{RANK} adapters on every encoder Linear layer (their base weights and the "
              "embeddings frozen; LayerNorms and the 2-output head as in DP-SGD). Median step "
              "times:"), "",
             *table(times), "",
             (f"DP-LoRA / DP-SGD step time: **{lora / dpsgd:.2f}x** (full fine-tuning), "
              f"{lora / encoder:.2f}x (DP-SGD on the same encoder + head).")]
    write_section(Path(__file__).with_name("RESULTS.md"), "\n".join(lines))


if __name__ == "__main__":
    main()
