"""SST-2 test accuracy of the shipped MiniLM pipelines: non-private, DP-SGD, LSG, DP-LoRA and
the private linear probe (the floor fine-tuning must beat), 3 seeds at epsilon 3 and one at
epsilon 8.

    .venv/bin/python benchmarks/sst2_accuracy.py                 (hours on 2 cores)
    .venv/bin/python benchmarks/sst2_accuracy.py --only probe-eps3 lsg-eps3

Each run is one `raydp-train run` of a pipelines/sst2_minilm_*.yaml (a fresh process, the
embedded Ray) with `run.seed` set, timed from the outside. Every finished run is kept in
benchmarks/sst2_accuracy.json and RESULTS.md's section is rewritten from it after each run,
so an interrupted benchmark still reports what finished, and `--only` reruns some variants
while the others keep what their own runs measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from pipeline_runs import ROOT, run_pipeline
from step_overhead import write_section

RUNS_FILE = Path(__file__).with_name("sst2_accuracy.json")
EPS1, EPS3, EPS8 = (["privacy.target_epsilon=1"], ["privacy.target_epsilon=3"],
                    ["privacy.target_epsilon=8"])
SEEDS3, SEED1 = (0, 1, 2), (0,)
# Every encoder layer + head (the embeddings frozen), no prefix to cache, 8 epochs.
ALL_LAYERS = ["model.trainable={last_k_layers: 6}", "training.cache_frozen_prefix=false",
              "training.epochs=8"]
TRIM = ["training.trim_padding=true"]
# The DP-SGD and LSG pipelines on the last layer + head (the frozen prefix cached), 20 epochs,
# the new head at lr 1.0: the last-layer recipes (DP-LoRA's adds LORA_R16).
LAST_LAYER = ["model.trainable={last_k_layers: 1}", "training.cache_frozen_prefix=true",
              "training.epochs=20", "model.head_init=default", "model.label_texts=null",
              "training.trim_padding=false", 'training.param_groups=[{params: ["classifier.*"], lr: 1.0}]']
LORA_R8 = ["privacy.lora.rank=8", "privacy.lora.alpha=16"]
LORA_R16 = ["privacy.lora.rank=16", "privacy.lora.alpha=32"]
# AdamW as Yu et al. train DP-LoRA: lr 1e-3, the new head's 1e-2.
ADAMW = ["training.optimizer=adamw", "training.momentum=0", "training.lr=1e-3",
         "training.param_groups[0].lr=1e-2"]
# The head starts as a zero-shot classifier (texts chosen on dev among 5 pairs: 0.72 there).
LABEL_HEAD = ["model.head_init=label_texts",
              "model.label_texts=[I hated this movie, I loved this movie]"]
# Rank-4 adapters on every layer's query and value only (Hu et al.'s placement): 37,634
# numbers trained, a ninth of lora-all's, so a third of its noise norm per step.
QV_AND_HEAD = '["*attention.self.query.*", "*attention.self.value.*", "classifier.*"]'
LORA_QV = [f"model.trainable={QV_AND_HEAD}", "training.cache_frozen_prefix=false",
           "training.epochs=8", "privacy.lora.rank=4", "privacy.lora.alpha=8",
           'privacy.lora.layers=["*query", "*value"]']
FULL_FT = ["model.trainable=all", "training.cache_frozen_prefix=false", "training.batch_size=32",
           "training.max_physical_batch=32", "training.epochs=3"]
# name: (pipeline, overrides, seeds)
VARIANTS = {
    "non-private-last": ("sst2_minilm_nonprivate.yaml", [], SEED1),
    "probe-eps3": ("sst2_minilm_probe.yaml", EPS3, SEEDS3),
    "probe-eps8": ("sst2_minilm_probe.yaml", EPS8, SEED1),
    "dpsgd-eps3": ("sst2_minilm_dpsgd.yaml", EPS3, SEEDS3),
    "dpsgd-eps8": ("sst2_minilm_dpsgd.yaml", EPS8, SEED1),
    "dpsgd-pld-eps1": ("sst2_minilm_dpsgd.yaml", [*EPS1, "privacy.accountant=pld"], SEED1),
    # The last-layer recipes (every row below of these pipelines starts from them).
    "dpsgd-last-eps3": ("sst2_minilm_dpsgd.yaml", EPS3, SEEDS3),
    "dpsgd-last-eps8": ("sst2_minilm_dpsgd.yaml", EPS8, SEED1),
    "lsg-eps3": ("sst2_minilm_lsg.yaml", EPS3, SEEDS3),
    "lsg-last-eps3": ("sst2_minilm_lsg.yaml", EPS3, SEEDS3),
    "lsg-last-eps8": ("sst2_minilm_lsg.yaml", EPS8, SEED1),
    "lora-eps3": ("sst2_minilm_lora.yaml", EPS3, SEEDS3),
    "lora-last-eps3": ("sst2_minilm_lora.yaml", EPS3, SEEDS3),
    "lora-last-eps8": ("sst2_minilm_lora.yaml", EPS8, SEED1),
    # DP-LoRA on a bf16 frozen base: seed 2 is lora-last-eps3's LoraLinear seed, its fp32 twin.
    "lora-last-bf16-eps3": ("sst2_minilm_lora.yaml", [*EPS3, "model.frozen_dtype=bf16"], (2,)),
    "probe-eps1": ("sst2_minilm_probe.yaml", EPS1, SEED1),
    "lora-last-eps1": ("sst2_minilm_lora.yaml", EPS1, SEED1),
    # Recipes tried on dev: adapters or DP-SGD on every layer.
    "lora-all-eps3": ("sst2_minilm_lora.yaml",
                      [*EPS3, *ALL_LAYERS, *LORA_R8], SEED1),
    "lora-all-adamw-eps3": ("sst2_minilm_lora.yaml",
                            [*EPS3, *ALL_LAYERS, *LORA_R8, *ADAMW], SEED1),
    "lora-all-label-eps3": ("sst2_minilm_lora.yaml",
                            [*EPS3, *ALL_LAYERS, *LORA_R8, *LABEL_HEAD], SEED1),
    # ... the label-text head at the adapters' lr (it starts trained), and smaller expected
    # batches (more steps for the same epochs and time) at lower lrs.
    **{f"lora-all-label-b{batch}-lr{lr}-eps3": (
        "sst2_minilm_lora.yaml", [*EPS3, *ALL_LAYERS, *LORA_R8, *LABEL_HEAD, *TRIM,
                                  f"training.batch_size={batch}", f"training.lr={lr}",
                                  f"training.param_groups[0].lr={lr}"], SEED1)
       for batch, lr in ((1024, 0.3), (512, 0.3), (256, 0.15), (1024, 0.6))},
    "lora-all-label-b512-lr0.3-linear-eps3": (
        "sst2_minilm_lora.yaml", [*EPS3, *ALL_LAYERS, *LORA_R8, *LABEL_HEAD, *TRIM,
                                  "training.batch_size=512", "training.lr=0.3",
                                  "training.param_groups[0].lr=0.3", "training.schedule=linear"],
        SEED1),
    # The adapters' A matrices kept at their random start (a learning rate of 1e-9; FFA-LoRA,
    # Sun et al. 2024): the noise then enters the update B A through B alone, not also as
    # the product of two noisy matrices.
    **{f"lora-all-label-b{batch}-lr{lr}-frozen-a-eps3": (
        "sst2_minilm_lora.yaml", [*EPS3, *ALL_LAYERS, *LORA_R8, *LABEL_HEAD, *TRIM,
                                  f"training.batch_size={batch}", f"training.lr={lr}",
                                  (f"training.param_groups=[{{params: [classifier.*], lr: {lr}}}, "
                                   "{params: ['*lora_A'], lr: 1e-9}]")], SEED1)
       for batch, lr in ((1024, 0.3), (512, 0.3), (1024, 0.6))},
    # The epsilon-3 choice on dev at epsilon 8 and 1.
    **{f"lora-all-label-lr0.3-eps{eps}": (
        "sst2_minilm_lora.yaml", [f"privacy.target_epsilon={eps}", *ALL_LAYERS, *LORA_R8,
                                  *LABEL_HEAD, *TRIM, "training.lr=0.3",
                                  "training.param_groups[0].lr=0.3"], SEED1)
       for eps in (8, 1)},
    # The dev choice without noise (clipped at C only): how far its 54 steps can go at all.
    "lora-all-label-lr0.3-noiseless": (
        "sst2_minilm_lora.yaml", ["privacy.target_epsilon=null", "privacy.noise_multiplier=0.001",
                                  *ALL_LAYERS, *LORA_R8, *LABEL_HEAD, *TRIM, "training.lr=0.3",
                                  "training.param_groups[0].lr=0.3"], SEED1),
    "lora-qv-label-eps3": ("sst2_minilm_lora.yaml", [*EPS3, *LORA_QV, *LABEL_HEAD], SEED1),
    "dpsgd-all-eps3": ("sst2_minilm_dpsgd.yaml", [*EPS3, *ALL_LAYERS], SEED1),
    # DP-SGD on every layer with the label-text head, all at the pretrained layers' lr.
    "dpsgd-all-label-eps3": ("sst2_minilm_dpsgd.yaml",
                             [*EPS3, *ALL_LAYERS, *LABEL_HEAD, *TRIM,
                              "training.param_groups[0].lr=0.1"], SEED1),
    **{f"dpsgd-all-label-lr{lr}-eps{eps}": (
        "sst2_minilm_dpsgd.yaml", [f"privacy.target_epsilon={eps}", *ALL_LAYERS, *LABEL_HEAD,
                                   *TRIM, f"training.lr={lr}", f"training.param_groups[0].lr={lr}"],
        SEED1)
       for lr, eps in ((0.2, 3), (0.1, 8))},
    # ... twice the epochs (108 steps, sigma 2.541): epsilon 8 read like epsilon 3 after
    # every epoch, so the steps, not the noise, held it back.
    "dpsgd-all-label-e16-eps3": (
        "sst2_minilm_dpsgd.yaml", [*EPS3, *ALL_LAYERS, *LABEL_HEAD, *TRIM,
                                   "training.param_groups[0].lr=0.1", "training.epochs=16"],
        SEED1),
    # ... with sigma calibrated by PLD (7% less noise than RDP's at the same epsilon).
    "dpsgd-all-label-lr0.1-pld-eps1": (
        "sst2_minilm_dpsgd.yaml", [*EPS1, "privacy.accountant=pld", *ALL_LAYERS, *LABEL_HEAD,
                                   *TRIM, "training.param_groups[0].lr=0.1"], SEED1),
    # ... decaying linearly from lr 0.2 (which rose faster than 0.1 and ended lower); with
    # Adam at Li et al.'s lr for full private fine-tuning.
    "dpsgd-all-label-lr0.2-linear-eps3": (
        "sst2_minilm_dpsgd.yaml", [*EPS3, *ALL_LAYERS, *LABEL_HEAD, *TRIM, "training.lr=0.2",
                                   "training.param_groups[0].lr=0.2", "training.schedule=linear"],
        SEED1),
    "dpsgd-all-label-adamw-lr5e-4-eps3": (
        "sst2_minilm_dpsgd.yaml", [*EPS3, *ALL_LAYERS, *LABEL_HEAD, *TRIM,
                                   "training.optimizer=adamw", "training.momentum=0",
                                   "training.lr=5e-4", "training.param_groups[0].lr=5e-4"],
        SEED1),
    # LSG on the same trainable set as dpsgd-all-label (its rank-16 carriers on every layer).
    "lsg-all-label-eps3": ("sst2_minilm_lsg.yaml",
                           [*EPS3, *ALL_LAYERS, *LABEL_HEAD, *TRIM, "training.lr=0.3",
                            "training.param_groups[0].lr=0.3"], SEED1),
    # The honest reference: every layer trained without privacy, its lr searched on dev (one
    # seed each); the chosen lr is sst2_minilm_full_nonprivate.yaml's, run on 3 seeds (its seed
    # 0 is the search's run at that lr: the same configuration).
    "full-nonprivate": ("sst2_minilm_full_nonprivate.yaml", [], SEEDS3),
    **{f"full-ft-lr{lr}": ("sst2_minilm_nonprivate.yaml", [*FULL_FT, f"training.lr={lr}"], SEED1)
       for lr in ("2e-5", "5e-5", "1e-4")},
}
# The shipped recipes: each pipeline as it is. Every other row of these three pipelines was
# run on top of the earlier last-layer recipes, so its overrides start from them.
SHIPPED = {"dpsgd-eps3", "dpsgd-eps8", "dpsgd-pld-eps1", "lsg-eps3", "lora-eps3"}
EARLIER = {"sst2_minilm_dpsgd.yaml": LAST_LAYER, "sst2_minilm_lsg.yaml": LAST_LAYER,
           "sst2_minilm_lora.yaml": [*LAST_LAYER, *LORA_R16]}
VARIANTS.update({name: (pipeline, [*EARLIER[pipeline], *overrides], seeds)
                 for name, (pipeline, overrides, seeds) in VARIANTS.items()
                 if name not in SHIPPED and pipeline in EARLIER})
BEFORE = (
    "Before issue 15 (0.1.0's recipes: [CLS] pooler, last 2 layers + head, expected batch 256, "
    "3 epochs, AdamW 1e-3 for everything, no prefix cache), one seed: non-private 0.8424, "
    "DP-SGD 0.5206 at epsilon 3 and 0.7792 at 8, LSG 0.4992 at epsilon 3 and 0.5036 at 8, the "
    "pooler + head alone 0.7326 at epsilon 3 and 0.7468 at 8 (11-12 minutes per run).")
LR_SEARCH = "full-ft-lr"
EPOCH_ON_DEV = "full-"  # variants whose epoch count is chosen on dev, read per epoch
TITLE = "## SST-2 accuracy of the pretrained MiniLM (benchmarks/sst2_accuracy.py)"


def run_once(pipeline: str, overrides: list[str], seed: int) -> dict:
    """One `raydp-train run`; its record's final numbers, wall time and the load before it."""
    run = run_pipeline(ROOT / "pipelines" / pipeline, overrides, seed)
    if "error" in run:
        return {"seed": seed, **run}
    record = run["record"]
    last = record["metrics"][-1]
    return {"seed": seed, "wall_s": run["wall_s"], "load": run["load"],
            "test_accuracy": last["test_accuracy"],
            "validation_accuracy": last.get("validation_accuracy"),
            "epsilon": record["privacy"]["epsilon"], "steps": record["privacy"]["steps"],
            "sigma": record["privacy"]["noise_multiplier"],
            "trained": record["training"]["trained_numbers_per_step"],
            "per_epoch": [{"test": m["test_accuracy"], "dev": m.get("validation_accuracy")}
                          for m in record["metrics"]]}


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def scored(name: str, run: dict) -> tuple[float, float, int]:
    """(test, dev, epochs) a run reports: its last epoch, or for the reference rows the epoch
    with the best dev accuracy (at a constant lr, exactly a run of that many epochs)."""
    epochs = run.get("per_epoch")
    if not name.startswith(EPOCH_ON_DEV) or not epochs:
        return run["test_accuracy"], run["validation_accuracy"], len(epochs or []) or None
    best = max(range(len(epochs)), key=lambda i: (epochs[i]["dev"], -i))
    return epochs[best]["test"], epochs[best]["dev"], best + 1


def best_non_private(runs: dict[str, list[dict]]) -> tuple[str, float] | None:
    """The non-private variant with the best mean dev accuracy, and its mean test accuracy
    (the lr search's one-seed rows stand behind the reference they chose)."""
    means = {}
    for name, variant_runs in runs.items():
        if name.startswith(LR_SEARCH):
            continue
        good = [scored(name, r) for r in variant_runs if "error" not in r and r["sigma"] == 0]
        if good:
            means[name] = (statistics.mean(d for _, d, _ in good),
                           statistics.mean(t for t, _, _ in good))
    if not means:
        return None
    name = max(means, key=lambda n: means[n][0])
    return name, means[name][1]


def row(name: str, runs: list[dict], reference: float | None) -> str:
    seeds = len(VARIANTS[name][2])
    good = [r for r in runs if "error" not in r]
    if not good:
        return f"| {name} | failed: {runs[-1]['error'][:80]} | | | | | | | | | |"
    first = good[0]
    tests, devs, epochs = zip(*(scored(name, r) for r in good))
    gap = "" if reference is None else f"{100 * (statistics.mean(tests) - reference):+.2f}"
    chosen = "/".join(str(e) for e in epochs) if name.startswith(EPOCH_ON_DEV) else "last"
    # * a run of the same worker loop in-process (benchmarks/lsg_diagnosis.py), not via the CLI
    walls = " / ".join(f"{r['wall_s'] / 60:.1f}{'*' if 'harness' in r else ''}" for r in good)
    loads = " / ".join("?" if r["load"] is None else f"{r['load']:.1f}" for r in good)
    done = f"{len(good)}" + ("" if len(good) == seeds else f" of {seeds}")
    return (f"| {name} | {_mean_std(list(tests))} | {_mean_std(list(devs))} | {gap} | {done} | "
            f"{chosen} | {first['epsilon']:.2f} | {first['sigma']:.3f} | {first['steps']} | "
            f"{first['trained']:,} | {walls} min | {loads} |")


def section(runs: dict[str, list[dict]]) -> str:
    lines = [TITLE, "",
             ("all-MiniLM-L6-v2 on SST-2 (6,920 train / 872 dev / 1,821 test sentences, 48 "
              "tokens, mean pooling), delta 1e-5, sigma calibrated to the target epsilon (RDP), "
              "1 Ray Train worker on this 2-core machine. Each variant is a shipped pipeline "
              "(`raydp-train run pipelines/<file> --set privacy.target_epsilon=E --set "
              "run.seed=S`) with the variant's overrides (benchmarks/sst2_accuracy.py): "
              "*dpsgd-eps3*, *dpsgd-eps8*, *dpsgd-pld-eps1*, *lsg-eps3* and *lora-eps3* are the "
              "pipelines as shipped, recipes in their headers; the other DP-SGD, LSG and DP-LoRA rows start from the earlier "
              "recipes on the last layer + head (the *-last-* rows); *probe* is the private linear "
              "probe (frozen encoder, only the classifier trains), the floor fine-tuning must "
              "beat. Accuracy: mean ± std over the seeds (0, 1, 2 where 3 are listed; 0 otherwise); "
              "dev is SST-2's public dev split. *load*: the 1-minute load average before each "
              "run (above 2, other processes competed for the cores; wall times then include "
              "waiting). *full-...*: the honest reference, every layer (the embeddings too) "
              "trained without privacy, AdamW, batch 32, 3 epochs, lr 5e-5 (or the named one), "
              "no prefix cache; its *epoch read* is the epoch with the best dev accuracy (at a constant "
              "lr, exactly a run of that many epochs). Other rows read their last epoch. *vs "
              "best non-private*: the row's mean test accuracy minus that of the non-private "
              "variant of any trainable set with the best mean dev accuracy, in points."), "",
             ("| variant | test accuracy | dev accuracy | vs best non-private (points) | seeds | "
              "epoch read | epsilon | sigma | steps | numbers trained per step | "
              "wall time per seed | load |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    reference = best_non_private(runs)
    lines += [row(name, runs[name], reference and reference[1])
              for name in VARIANTS if runs.get(name)]
    harnesses = sorted({r["harness"] for v in runs.values() for r in v if "harness" in r})
    notes = [f"\\* {harness}" for harness in harnesses]
    if reference:
        notes.insert(0, f"Best non-private on dev: {reference[0]} (test {reference[1]:.4f}).")
    return "\n".join([*lines, "", *notes, *([""] if notes else []), BEFORE])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int,
                        help="run only these of each variant's seeds (others keep their runs)")
    args = parser.parse_args()
    for name in args.only:
        pipeline, overrides, seeds = VARIANTS[name]
        for seed in [s for s in seeds if args.seeds is None or s in args.seeds]:
            print(f"{name} seed {seed}: running", flush=True)
            result = run_once(pipeline, overrides, seed)
            print(f"{name} seed {seed}: {result}", flush=True)
            # Read again: another benchmark process may have added runs meanwhile.
            runs = json.loads(RUNS_FILE.read_text()) if RUNS_FILE.exists() else {}
            kept = [r for r in runs.get(name, []) if r["seed"] != seed and r["seed"] in seeds]
            runs[name] = sorted([*kept, result], key=lambda r: r["seed"])
            RUNS_FILE.write_text(json.dumps(runs, indent=1) + "\n")
            write_section(Path(__file__).with_name("RESULTS.md"), section(runs))


if __name__ == "__main__":
    main()
