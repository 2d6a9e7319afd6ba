"""Why LSG stayed at chance on SST-2: small in-process runs of the shipped SST-2 pipelines with
one knob changed at a time, scored on the public dev split (never the test split).

Each variant is a list of `--set` overrides on top of a pipeline on its last layer + head (the
recipe the diagnosis was run on: sst2_variants.EARLIER); every run uses the first
--rows training sentences, training.cache_frozen_prefix, seed 0, world size 1, no Ray. Besides
dev accuracy it reports how the adapted weights moved: the spectral norm of the update
||W_T - W_0||_2 and its stable rank ||.||_F^2 / ||.||_2^2 (a rank-r update has stable rank <= r),
averaged over the trained Linear weights of the encoder.

    .venv/bin/python benchmarks/lsg_diagnosis.py --variants lsg-adamw sgd-momentum
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from prefix_cache import tokenized
from sst2_variants import EARLIER

from raydp_train.config.pipeline import load_pipeline
from raydp_train.data.sources import Dataset
from raydp_train.models.builders import build_model
from raydp_train.optim.optimizer import named_trainable
from raydp_train.train.context import LocalContext
from raydp_train.train.plan import make_plan
from raydp_train.train.worker import train

ROOT = Path(__file__).resolve().parents[1]
LSG, DPSGD = "pipelines/sst2_minilm_lsg.yaml", "pipelines/sst2_minilm_dpsgd.yaml"
HEAD = "classifier.*"
# SGD with momentum 0.9: adapted (encoder) weights at lr_w, the head at lr_h.
SGD = ["training.optimizer=sgd", "training.momentum=0.9"]


def _head_lr(lr: float) -> str:
    return f"training.param_groups=[{{params: ['{HEAD}'], lr: {lr}}}]"


def _sgd(lr_w: float, lr_h: float) -> list[str]:
    return [*SGD, f"training.lr={lr_w}", _head_lr(lr_h)]


# The LSG recipe before this diagnosis: AdamW at 1e-3 for every trained parameter.
ADAMW = ["training.optimizer=adamw", "training.momentum=0", "training.lr=0.001",
         "training.param_groups=[]"]
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "lsg-sgdm (shipped): encoder 0.1, head 1": (LSG, []),
    "lsg-adamw (old recipe)": (LSG, ADAMW),
    "dpsgd-adamw (shipped)": (DPSGD, []),
    "head only, adamw 1e-2": (DPSGD, [f"model.trainable=['{HEAD}']", "training.lr=0.01"]),
    "head only, sgdm 1": (DPSGD, [f"model.trainable=['{HEAD}']", *SGD, "training.lr=1.0"]),
    "lsg-adamw, encoder lr 1e-5, head 1e-2": (LSG, [*ADAMW, "training.lr=1e-5", _head_lr(0.01)]),
    "lsg-sgdm, encoder 0.5, head 1": (LSG, _sgd(0.5, 1.0)),
    "lsg-sgdm, encoder 0.02, head 1": (LSG, _sgd(0.02, 1.0)),
    "lsg-sgdm, encoder 0.1, head 1, refresh 10": (
        LSG, _sgd(0.1, 1.0) + ["privacy.lsg.refresh_every=10"]),
    "lsg-sgdm, encoder 0.1, head 1, rank 16": (LSG, _sgd(0.1, 1.0) + ["privacy.lsg.rank=16"]),
    "lsg-sgdm, encoder 0.1, head 1, sparsity 0": (
        LSG, _sgd(0.1, 1.0) + ["privacy.lsg.sparsity=0"]),
    "dpsgd-sgdm, encoder 0.1, head 1": (DPSGD, _sgd(0.1, 1.0)),
    "lsg-sgdm, encoder 0.3, head 1": (LSG, _sgd(0.3, 1.0)),
    "lsg-sgdm, encoder 0.3, head 1, rank 16, sparsity 0": (
        LSG, _sgd(0.3, 1.0) + ["privacy.lsg.rank=16", "privacy.lsg.sparsity=0"]),
}


def weight_update_stats(model: torch.nn.Module, reference: torch.nn.Module) -> tuple[float, float]:
    """Mean spectral norm and mean stable rank of W_T - W_0 over the trained encoder Linears."""
    before = dict(named_trainable(reference))
    norms, ranks = [], []
    for name, weight in named_trainable(model):
        if weight.dim() != 2 or name.startswith("classifier"):
            continue
        delta = (weight.detach() - before[name].detach()).double()
        spectral = torch.linalg.matrix_norm(delta, ord=2).item()
        norms.append(spectral)
        ranks.append((delta.square().sum().item() / spectral**2) if spectral > 0 else 0.0)
    if not norms:
        return float("nan"), float("nan")
    return sum(norms) / len(norms), sum(ranks) / len(ranks)


def run_variant(path: str, overrides: list[str], args, dataset: Dataset) -> dict:
    pipeline = load_pipeline(path, [
        *EARLIER[Path(path).name], f"training.epochs={args.epochs}", "data.validation=null",
        "run.seed=0",
        "training.cache_frozen_prefix=true", f"privacy.target_epsilon={args.epsilon}",
        f"training.batch_size={args.batch}",
        f"training.threads_per_worker={os.environ.get('THREADS', 'auto')}", *overrides,
        *args.set])
    plan = make_plan(pipeline, dataset.num_train)
    torch.manual_seed(0)
    reference = build_model(pipeline.model, dataset.feature_shape, dataset.num_classes)
    started = time.perf_counter()
    rows = []
    result = train(pipeline, plan, LocalContext(on_epoch=rows.append), dataset=dataset)
    # With --test the dataset's test split is the test split and dev is its validation split;
    # otherwise its "test" split is the public dev split (the test split stays unseen).
    dev = [row.get("validation_accuracy", row["test_accuracy"]) for row in rows]
    spectral, stable_rank = weight_update_stats(result.model, reference)
    return {"dev": dev, "test": rows[-1]["test_accuracy"] if args.test else None, "steps": result.steps_done, "sigma": plan.noise_multiplier,
            "trained": result.trained_per_step, "spectral": spectral,
            "stable_rank": stable_rank, "wall_s": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048, help="training sentences used")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256, help="expected batch size")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--test", action="store_true",
                        help="also score the test split (confirmation runs only)")
    parser.add_argument("--set", action="append", default=[],
                        help="an override applied to every variant, after its own")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS),
                        help="names (or unique prefixes) of VARIANTS")
    args = parser.parse_args()
    os.chdir(ROOT)
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))  # tokenizing; the loop sets its own
    pipeline = load_pipeline(LSG)
    features, labels = tokenized(pipeline, pipeline.data.path, args.rows)
    dev_features, dev_labels = tokenized(pipeline, pipeline.data.validation.path, 10_000)
    if args.test:
        test_features, test_labels = tokenized(pipeline, pipeline.data.test_path, 10_000)
        dataset = Dataset(features, labels, test_features, test_labels, 2, dev_features,
                          dev_labels)
    else:
        dataset = Dataset(features, labels, dev_features, dev_labels, 2)
    print(f"rows {args.rows}, epochs {args.epochs}, expected batch {args.batch}, "
          f"epsilon {args.epsilon}, delta 1e-5, seed 0")
    print("| variant | dev acc (final) | dev acc per epoch | steps | sigma | numbers all-reduced "
          "| update spectral norm | update stable rank | wall s |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for wanted in args.variants:
        name = next(v for v in VARIANTS if v.startswith(wanted))
        path, overrides = VARIANTS[name]
        row = run_variant(path, overrides, args, dataset)
        print(f"| {name} | {row['dev'][-1]:.4f} | {' '.join(f'{a:.3f}' for a in row['dev'])} "
              f"| {row['steps']} | {row['sigma']:.3f} | {row['trained']:,} "
              f"| {row['spectral']:.3f} | {row['stable_rank']:.1f} | {row['wall_s']:.0f} |"
              + (f" test acc {row['test']:.4f}" if args.test else ""),
              flush=True)


if __name__ == "__main__":
    main()
