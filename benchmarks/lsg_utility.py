"""Utility of LSG vs DP-SGD vs non-private on sklearn digits at epsilon 3, and LSG's step time.

    .venv/bin/python benchmarks/lsg_utility.py        # about a minute on 2 cores

Runs in one process (world size 1, no Ray) from pipelines/digits_dpsgd.yaml and
pipelines/digits_lsg.yaml: same data, model, q, steps and calibrated sigma for every private
variant (so the same epsilon), a small grid of LSG rank r and sparsity p, and the same model
trained without privacy by minibatch Adam for the same number of steps. Step times are the
training loop's wall time per step. Rewrites its section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from raydp_train.config.pipeline import load_pipeline
from raydp_train.data.sources import load_data
from raydp_train.models.builders import build_model
from raydp_train.optim.optimizer import make_optimizer
from raydp_train.train.context import LocalContext
from raydp_train.train.evaluation import accuracy
from raydp_train.train.plan import make_plan
from raydp_train.train.worker import train

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import write_section

ROOT = Path(__file__).parents[1]
SECTION = "## LSG utility on digits (benchmarks/lsg_utility.py)"
RESULTS = Path(__file__).with_name("RESULTS.md")
GRID = [(4, 0.0), (4, 0.5), (16, 0.0), (16, 0.25), (16, 0.5), (32, 0.25)]
SEEDS = (0, 1)


def non_private(pipeline, steps: int, seed: int) -> tuple[float, float]:
    data = load_data(pipeline.data).to_torch()
    torch.manual_seed(seed)
    model = build_model(pipeline.model, data.feature_shape, data.num_classes)
    optimizer = make_optimizer(model, pipeline.training)
    batch = pipeline.training.batch_size
    started = time.perf_counter()
    for _ in range(steps):
        index = torch.randint(0, data.num_train, (batch,))
        optimizer.zero_grad()
        F.cross_entropy(model(data.train_features[index]), data.train_labels[index]).backward()
        optimizer.step()
    seconds = (time.perf_counter() - started) / steps
    return accuracy(model, data.test_features, data.test_labels), seconds


def private(pipeline, seed: int) -> tuple[float, float, object]:
    pipeline = pipeline.model_copy(update={"run": pipeline.run.model_copy(update={"seed": seed})})
    data = load_data(pipeline.data)
    plan = make_plan(pipeline, data.num_train)
    started = time.perf_counter()
    result = train(pipeline, plan, LocalContext(on_epoch=lambda row: None))
    seconds = (time.perf_counter() - started) / plan.steps
    return result.metrics[-1]["test_accuracy"], seconds, result


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def main() -> None:
    torch.set_num_threads(2)
    in_process = ["training.workers=1", "training.threads_per_worker=2"]  # as the baseline
    dpsgd = load_pipeline(ROOT / "pipelines" / "digits_dpsgd.yaml", in_process)
    lsg = load_pipeline(ROOT / "pipelines" / "digits_lsg.yaml", in_process)
    plan = make_plan(dpsgd, load_data(dpsgd.data).num_train)
    rows = []
    base = [non_private(dpsgd, plan.steps, s) for s in SEEDS]
    base_time = mean(t for _, t in base)
    rows.append(("non-private (Adam, same steps)", mean(a for a, _ in base), base_time, None))
    print(rows[-1], flush=True)
    runs = [private(dpsgd, s) for s in SEEDS]
    rows.append(("DP-SGD", mean(a for a, _, _ in runs), mean(t for _, t, _ in runs), runs[0][2]))
    print(rows[-1][:3], flush=True)
    for rank, sparsity in GRID:
        config = lsg.privacy.lsg.model_copy(update={"rank": rank, "sparsity": sparsity})
        variant = lsg.model_copy(update={"privacy": lsg.privacy.model_copy(update={"lsg": config})})
        runs = [private(variant, s) for s in SEEDS]
        rows.append((f"LSG r={rank}, p={sparsity}", mean(a for a, _, _ in runs),
                     mean(t for _, t, _ in runs), runs[0][2]))
        print(rows[-1][:3], flush=True)
    lines = [
        SECTION, "",
        "Command: `.venv/bin/python benchmarks/lsg_utility.py` (from the repository root)", "",
        (f"sklearn digits (1,438 train / 359 test), MLP 64-256-256-10, Adam lr "
         f"{dpsgd.training.lr}, expected batch {plan.expected_batch_size}, {plan.steps} steps; "
         f"private variants at epsilon {plan.epsilon():.2f} (delta {plan.delta:g}, RDP), sigma "
         f"{plan.noise_multiplier:.3f}, C {plan.clip_norm:g}; LSG sparsity from epoch "
         f"{lsg.privacy.lsg.sparsity_start_epoch + 1}, other parameters by DP-SGD. Test accuracy "
         f"is the mean over seeds {list(SEEDS)}; step time is in-process, 2 torch threads."),
        "",
        "| variant | test accuracy | trained numbers per step | step (ms) | vs non-private |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, acc, seconds, result in rows:
        trained = "all 85,002" if result is None else f"{result.trained_per_step:,}"
        lines.append(f"| {name} | {acc:.3f} | {trained} | {1e3 * seconds:.1f} "
                     f"| {seconds / base_time:.2f}x |")
    lines += ["", (
        "LSG trains and all-reduces far fewer numbers per step than DP-SGD at the same epsilon; "
        "on this small MLP its step is not faster: the per-step carrier refresh (two QR "
        "factorizations per adapted layer) and the two virtual layers cost more than the "
        "smaller noise draw saves at 85k parameters. Its gain here is communication volume. "
        "Timings on 2 shared vCPUs vary by about 20% between runs."
    )]
    text = "\n".join(lines)
    print(text)
    write_section(RESULTS, text)


if __name__ == "__main__":
    main()
