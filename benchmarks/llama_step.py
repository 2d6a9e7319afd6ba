"""Step time of a small Llama decoder (causal LM, issue 18): non-private vs our DP-SGD step vs
Opacus (hooks, ghost), B = 16 sequences of T = 128 tokens.

    .venv/bin/python benchmarks/llama_step.py          (a few minutes on 2 cores)

The model is built from a Llama config as a pipeline builds it (`model.config`,
`model.task: causal_lm`): RMSNorm, rotary positions, SwiGLU, grouped-query attention, an
untied LM head over a 32,000-token vocabulary. Every token is real (no padding), so no method
saves work on padded positions. Each sequence's loss is the mean of its next-token
cross-entropies (`model.lm_loss: mean`; Opacus's ghost clipping takes the same per-sequence
mean through its `shape` argument). Round-robin timing of benchmarks/step_overhead.py; our
engine is first checked against the plain summed gradient.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import opacus
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.models.hf_causal import (
    IGNORED,
    build_causal_lm,
    causal_lm_loss,
    next_token_targets,
)
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.noise import make_generator, noise_std
from raydp_train.train.step import private_step

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import (
    CLIP_NORM,
    LEARNING_RATE,
    NOISE_MULTIPLIER,
    Workload,
    check_engine,
    machine_facts,
    table,
    time_variants,
    write_section,
)

BATCH, TOKENS, STEPS, WARMUP, BLOCK = 16, 128, 24, 2, 3
LLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 256,
         "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False}
LOSS = causal_lm_loss("mean")
TARGET = "ours <= 1.3x the non-private step"


def llama_workload() -> Workload:
    torch.manual_seed(0)
    section = pipeline_from_dict({
        "name": "llama-step",
        "data": {"source": "parquet", "path": "unused.parquet", "text_column": "text"},
        "model": {"kind": "hf", "config": LLAMA, "task": "causal_lm", "lm_loss": "mean"},
        "privacy": {"noise_multiplier": NOISE_MULTIPLIER}}).model
    model = build_causal_lm(section)
    ids = torch.randint(0, LLAMA["vocab_size"], (BATCH, TOKENS))
    tokens = torch.stack([ids, torch.ones_like(ids)], dim=1)  # [B, 2, T]: ids and mask
    parameters = sum(p.numel() for p in model.parameters())
    return Workload("llama", f"Llama decoder from a config (hidden 256, 4 layers, 4 heads / 2 "
                    f"KV heads, SwiGLU 688, vocab 32,000, untied head; {parameters / 1e6:.1f}M "
                    f"parameters), B={BATCH}, T={TOKENS}, every token real", model, tokens,
                    torch.zeros(BATCH, dtype=torch.long), STEPS)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)


def non_private(model: nn.Module, tokens: Tensor, labels: Tensor):
    optimizer = sgd(model)

    def block(k: int) -> None:
        for _ in range(k):
            optimizer.zero_grad()
            LOSS(model, tokens, labels).mean().backward()
            optimizer.step()

    return block


def ours(model: nn.Module, tokens: Tensor, labels: Tensor):
    clipper, optimizer = PerExampleClipper(model, CLIP_NORM), sgd(model)
    generator, _ = make_generator(0)
    std, batch = noise_std(NOISE_MULTIPLIER, CLIP_NORM), [(tokens, labels)]

    def block(k: int) -> None:
        for _ in range(k):
            private_step(model, clipper, optimizer, batch, LOSS, std, BATCH, generator)

    return block


def opacus_variant(mode: str):
    def build(model: nn.Module, tokens: Tensor, labels: Tensor):
        loader = DataLoader(TensorDataset(tokens, labels), batch_size=BATCH)
        criterion = nn.CrossEntropyLoss(ignore_index=IGNORED)
        made = opacus.PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=sgd(model), criterion=criterion, data_loader=loader,
            poisson_sampling=False, noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=CLIP_NORM,
            grad_sample_mode=mode)
        module, optimizer = made[0], made[1]  # ghost also returns its loss wrapper
        targets = next_token_targets(tokens)

        def block(k: int) -> None:
            for _ in range(k):
                optimizer.zero_grad()
                logits = module(tokens)[:, :-1]
                flat = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
                if mode == "ghost":  # per-sequence means, then its two backward passes
                    loss = made[2](*flat, shape=logits.shape)
                else:
                    loss = criterion(*flat)
                loss.backward()
                optimizer.step()

        return block

    return build


def main() -> None:
    torch.set_num_threads(2)
    workload = llama_workload()
    error = check_engine(workload, LOSS)
    print(f"engine check: relative error {error:.2e}", flush=True)
    assert error < 1e-4, "our engine disagrees with the plain gradient: not benchmarking it"
    times, contention = time_variants(
        workload, WARMUP, BLOCK, ["non-private", "ours", "Opacus hooks", "Opacus ghost"],
        more={"non-private": non_private, "ours": ours, "Opacus hooks": opacus_variant("hooks"),
              "Opacus ghost": opacus_variant("ghost")})
    print("\n".join(table(times)), flush=True)
    ratio = statistics.median(times["ours"]) / statistics.median(times["non-private"])
    lines = ["## Llama decoder: private step time (benchmarks/llama_step.py)", "",
             f"Machine: {machine_facts()}; CPU contention during the timing {contention:.0%}.", "",
             (f"{workload.description}; SGD, C = {CLIP_NORM}, sigma = {NOISE_MULTIPLIER}. "
              f"Our engine's clipped sum (C huge) vs the plain gradient: relative error "
              f"{error:.1e}. Median step times:"), "", *table(times), "",
             f"Ours / non-private: **{ratio:.2f}x** (issue 18's target: {TARGET})."]
    write_section(Path(__file__).with_name("RESULTS.md"), "\n".join(lines))


if __name__ == "__main__":
    main()
