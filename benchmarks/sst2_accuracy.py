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
EPS3, EPS8 = ["privacy.target_epsilon=3"], ["privacy.target_epsilon=8"]
SEEDS3, SEED1 = (0, 1, 2), (0,)
# name: (pipeline, overrides, seeds)
VARIANTS = {
    "non-private": ("sst2_minilm_nonprivate.yaml", [], SEED1),
    "probe-eps3": ("sst2_minilm_probe.yaml", EPS3, SEEDS3),
    "probe-eps8": ("sst2_minilm_probe.yaml", EPS8, SEED1),
    "dpsgd-eps3": ("sst2_minilm_dpsgd.yaml", EPS3, SEEDS3),
    "dpsgd-eps8": ("sst2_minilm_dpsgd.yaml", EPS8, SEED1),
    "lsg-eps3": ("sst2_minilm_lsg.yaml", EPS3, SEEDS3),
    "lsg-eps8": ("sst2_minilm_lsg.yaml", EPS8, SEED1),
    "lora-eps3": ("sst2_minilm_lora.yaml", EPS3, SEEDS3),
    "lora-eps8": ("sst2_minilm_lora.yaml", EPS8, SEED1),
    # DP-LoRA on a bf16 frozen base: seed 2 is lora-eps3's LoraLinear seed, its fp32 twin.
    "lora-bf16-eps3": ("sst2_minilm_lora.yaml", [*EPS3, "model.frozen_dtype=bf16"], (2,)),
}
BEFORE = (
    "Before issue 15 (0.1.0's recipes: [CLS] pooler, last 2 layers + head, expected batch 256, "
    "3 epochs, AdamW 1e-3 for everything, no prefix cache), one seed: non-private 0.8424, "
    "DP-SGD 0.5206 at epsilon 3 and 0.7792 at 8, LSG 0.4992 at epsilon 3 and 0.5036 at 8, the "
    "pooler + head alone 0.7326 at epsilon 3 and 0.7468 at 8 (11-12 minutes per run).")
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
            "trained": record["training"]["trained_numbers_per_step"]}


def _mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def row(name: str, runs: list[dict]) -> str:
    seeds = len(VARIANTS[name][2])
    good = [r for r in runs if "error" not in r]
    if not good:
        return f"| {name} | failed: {runs[-1]['error'][:80]} | | | | | | | |"
    first = good[0]
    # * a run of the same worker loop in-process (benchmarks/lsg_diagnosis.py), not via the CLI
    walls = " / ".join(f"{r['wall_s'] / 60:.1f}{'*' if 'harness' in r else ''}" for r in good)
    loads = " / ".join("?" if r["load"] is None else f"{r['load']:.1f}" for r in good)
    done = f"{len(good)}" + ("" if len(good) == seeds else f" of {seeds}")
    return (f"| {name} | {_mean_std([r['test_accuracy'] for r in good])} | "
            f"{_mean_std([r['validation_accuracy'] for r in good])} | {done} | "
            f"{first['epsilon']:.2f} | {first['sigma']:.3f} | {first['steps']} | "
            f"{first['trained']:,} | {walls} min | {loads} |")


def section(runs: dict[str, list[dict]]) -> str:
    lines = [TITLE, "",
             ("all-MiniLM-L6-v2 on SST-2 (6,920 train / 872 dev / 1,821 test sentences, 48 "
              "tokens, mean pooling), delta 1e-5, sigma calibrated to the target epsilon (RDP), "
              "1 Ray Train worker on this 2-core machine. Each variant is a shipped pipeline "
              "(`raydp-train run pipelines/<file> --set privacy.target_epsilon=E --set "
              "run.seed=S`), recipes in the pipelines' headers; *probe* is the private linear "
              "probe (frozen encoder, only the classifier trains), the floor fine-tuning must "
              "beat. Accuracy: mean ± std over the seeds (0, 1, 2 at epsilon 3; 0 otherwise); "
              "dev is SST-2's public dev split. *load*: the 1-minute load average before each "
              "run (above 2, other processes competed for the cores; wall times then include "
              "waiting)."), "",
             ("| variant | test accuracy | dev accuracy | seeds | epsilon | sigma | steps | "
              "numbers trained per step | wall time per seed | load |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [row(name, runs[name]) for name in VARIANTS if runs.get(name)]
    harnesses = sorted({r["harness"] for v in runs.values() for r in v if "harness" in r})
    notes = [f"\\* {harness}" for harness in harnesses]
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
