"""Steps per second of the MLP pipeline with 1 vs 2 Ray Train workers, and the all-reduce size.

    .venv/bin/python benchmarks/distributed_scaling.py     # about a minute on 2 cores

Both runs use the same pipeline (MLP on sklearn digits, DP-SGD) on one embedded local Ray,
measured in this process one after the other; the per-step all-reduce is one flat buffer
holding every trainable parameter's gradient. Rewrites its section of RESULTS.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import ray
import torch

from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.data.sources import load_data
from raydp_train.models.builders import build_model
from raydp_train.train.plan import make_plan
from raydp_train.train.trainer import ensure_ray, fit

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import write_section

SECTION = "## Distributed scaling (benchmarks/distributed_scaling.py)"
RESULTS = Path(__file__).with_name("RESULTS.md")


def pipeline(workers: int):
    return pipeline_from_dict({
        "name": f"scaling-{workers}",
        "data": {"source": "sklearn_digits"},
        "model": {"kind": "mlp", "hidden_sizes": [256, 256]},
        "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-5},
        "training": {"epochs": 8, "batch_size": 256, "lr": 0.1, "workers": workers},
    })


def measure(workers: int, run_root: Path) -> dict:
    config = pipeline(workers)
    data = load_data(config.data)
    plan = make_plan(config, data.num_train)
    parameters = sum(p.numel() for p in build_model(config.model, data.feature_shape, 10).parameters())
    rows: list[dict] = []
    started = time.perf_counter()
    result = fit(config, plan, run_root / f"workers-{workers}", on_epoch=rows.append)
    wall = time.perf_counter() - started
    # Epoch 1 includes warm-up; time the steady state from its end to the last epoch's end.
    steps = rows[-1]["steps"] - rows[0]["steps"]
    seconds = rows[-1]["elapsed_s"] - rows[0]["elapsed_s"]
    return {
        "workers": workers,
        "steps": result.steps_done,
        "steps_per_s": steps / seconds,
        "wall_s": wall,
        "accuracy": rows[-1]["test_accuracy"],
        "allreduce_numbers": parameters,
        "allreduce_bytes": parameters * torch.finfo(torch.float32).bits // 8,
    }


def main() -> None:
    import tempfile

    ensure_ray(None, num_cpus=4)
    with tempfile.TemporaryDirectory() as root:
        results = [measure(w, Path(root)) for w in (1, 2)]
    ray.shutdown()
    base = results[0]["steps_per_s"]
    lines = [
        SECTION, "",
        "Command: `.venv/bin/python benchmarks/distributed_scaling.py` (from the repository root)",
        "",
        (
            f"MLP 64-256-256-10 on sklearn digits (1,438 training examples), expected batch 256, "
            f"{results[0]['steps']} DP-SGD steps; embedded local Ray (4 logical CPUs, 2 cores), "
            "one worker per Ray CPU. Steady-state steps/s from the end of epoch 1 to the end of "
            "the run (per-epoch checkpoints included)."
        ),
        "",
        "| workers | steps/s | vs 1 worker | wall time (s) | test accuracy | all-reduce per step |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['workers']} | {r['steps_per_s']:.1f} | {r['steps_per_s'] / base:.2f}x "
            f"| {r['wall_s']:.1f} | {r['accuracy']:.3f} | {r['allreduce_numbers']:,} float32 "
            f"({r['allreduce_bytes'] / 1e6:.2f} MB), 1 collective |"
        )
    lines += ["", (
        "With 1 worker the all-reduce runs over a group of one. On 2 cores, 2 workers share "
        "the cores with each other and with Ray, so no speed-up is expected here; the point is "
        "what the distributed path costs over the single worker."
    )]
    text = "\n".join(lines)
    print(text)
    write_section(RESULTS, text)


if __name__ == "__main__":
    main()
