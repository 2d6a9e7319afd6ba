"""SST-2 test accuracy of the shipped MiniLM pipelines: non-private, DP-SGD, LSG, DP-LoRA and
the private linear probe (the floor fine-tuning must beat), at epsilon 1, 3 and 8, and every
recipe tried on the dev split: the variants of benchmarks/sst2_variants.py.

    .venv/bin/python benchmarks/sst2_accuracy.py                 (a day on 2 cores)
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
from sst2_variants import VARIANTS
from step_overhead import write_section

RUNS_FILE = Path(__file__).with_name("sst2_accuracy.json")
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
              "tokens, mean pooling), delta 1e-5, sigma calibrated to the target epsilon (by RDP; "
              "by PLD in the shipped DP-SGD pipeline's rows and the *-pld-* rows), "
              "1 Ray Train worker on this 2-core machine. Each variant is a shipped pipeline "
              "(`raydp-train run pipelines/<file> --set privacy.target_epsilon=E --set "
              "run.seed=S`) with the variant's overrides (benchmarks/sst2_accuracy.py): "
              "*dpsgd-eps3*, *dpsgd-eps8*, *lsg-eps3* and *lora-eps3* are the pipelines as "
              "shipped, recipes in their headers (*dpsgd-e5-eps1*: the header's epsilon-1 "
              "recipe, 5 epochs; *dpsgd-ema0.9-eps3*: with a moving average of its weights, "
              "`training.ema_decay` 0.9; *dpsgd-lr0.015-eps3*: lr 0.015; *dpsgd-b2048-lr0.02-eps3*: "
              "an expected batch of 2,048 at lr 0.02; *dpsgd-b2048-e16-eps3*: an expected "
              "batch of 2,048 for 16 epochs); the *dpsgd-c10-*, "
              "*dpsgd-c1-*, *dpsgd-nodrop-*, *dpsgd-lr0.02-eps8* and *dpsgd-pld-* rows are the "
              "shipped DP-SGD "
              "pipeline as it was before (RDP's sigma, the model's dropout 0.1) with the named "
              "change (*c1*: C 1 and lr 0.1, its first recipe; *nodrop*: dropout off; *pld*: "
              "PLD's sigma); *lsg-c1-eps3* is the shipped LSG pipeline at its first C 1 and lr "
              "0.3; the other DP-SGD, LSG and DP-LoRA rows start from the earlier "
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
