"""SST-2 test accuracy of the pretrained MiniLM: non-private, DP-SGD and LSG at epsilon 3 and 8.

    .venv/bin/python benchmarks/sst2_accuracy.py        (about an hour on 2 cores)
    .venv/bin/python benchmarks/sst2_accuracy.py --only dpsgd-eps3 lsg-eps3

Each variant is one `raydp-train run` of a pipelines/sst2_minilm_*.yaml (a fresh process, the
embedded Ray), with its wall time. RESULTS.md gets its section rewritten after every run, so
an interrupted benchmark still reports what finished.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import write_section

ROOT = Path(__file__).resolve().parents[1]
# Only the pooler and the classifier trained, at a 10x learning rate: 148k numbers per step.
HEAD_ONLY = ['model.trainable=["bert.pooler.*", "classifier.*"]', "training.lr=0.01",
             "model.pooling=cls"]  # as measured in RESULTS.md
VARIANTS = {
    "non-private": ("sst2_minilm_nonprivate.yaml", []),
    "dpsgd-eps3": ("sst2_minilm_dpsgd.yaml", ["privacy.target_epsilon=3"]),
    "dpsgd-eps8": ("sst2_minilm_dpsgd.yaml", ["privacy.target_epsilon=8"]),
    "lsg-eps3": ("sst2_minilm_lsg.yaml", ["privacy.target_epsilon=3"]),
    "lsg-eps8": ("sst2_minilm_lsg.yaml", ["privacy.target_epsilon=8"]),
    "dpsgd-head-eps3": ("sst2_minilm_dpsgd.yaml", [*HEAD_ONLY, "privacy.target_epsilon=3"]),
    "dpsgd-head-eps8": ("sst2_minilm_dpsgd.yaml", [*HEAD_ONLY, "privacy.target_epsilon=8"]),
}
TITLE = "## SST-2 accuracy of the pretrained MiniLM (benchmarks/sst2_accuracy.py)"


def run_variant(pipeline: str, overrides: list[str], output_dir: str) -> dict:
    command = [str(Path(sys.executable).with_name("raydp-train")), "run",
               str(ROOT / "pipelines" / pipeline), "--set", f"run.output_dir={output_dir}"]
    command += [x for override in overrides for x in ("--set", override)]
    started = time.perf_counter()
    done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed",
                "wall_s": wall}
    (run_dir,) = [d for d in Path(output_dir).iterdir() if d.is_dir()]
    record = json.loads((run_dir / "record.json").read_text())
    last = record["metrics"][-1]
    return {"wall_s": wall, "test_accuracy": last["test_accuracy"],
            "validation_accuracy": last.get("validation_accuracy"),
            "epsilon": record["privacy"]["epsilon"], "steps": record["privacy"]["steps"],
            "sigma": record["privacy"]["noise_multiplier"],
            "trained": record["training"]["trained_numbers_per_step"]}


def section(results: dict[str, dict], earlier: dict[str, str]) -> str:
    """The section with a row per variant: this run's, else the row an earlier run wrote."""
    lines = [TITLE, "",
             ("all-MiniLM-L6-v2 fine-tuned on SST-2 (6,920 train / 872 dev / 1,821 test "
             "sentences, 48 tokens), the last 2 of 6 layers + head trained, 3 epochs, expected "
             "batch 256, AdamW lr 1e-3, C = 1, delta 1e-5, sigma calibrated to the target "
             "epsilon (RDP); 1 Ray Train worker on 2 vCPUs. LSG: rank 8, sparsity 0.25 on the "
             "attention and FFN projections. *head* rows: the same DP-SGD pipeline with only the "
             "pooler and the classifier trained, lr 1e-2 (`--set model.trainable='[\"bert.pooler.*\""
             ", \"classifier.*\"]' --set training.lr=0.01`). A rerun of some variants "
             "(`--only`) keeps the other rows as their own run measured them."), "",
             ("| variant | test accuracy | dev accuracy | epsilon | sigma | steps | numbers "
             "trained per step | wall time |"), "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in VARIANTS:
        if name not in results:
            if name in earlier:
                lines.append(earlier[name])
            continue
        r = results[name]
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'][:80]} | | | | | | "
                         f"{r['wall_s'] / 60:.1f} min |")
            continue
        lines.append(f"| {name} | {r['test_accuracy']:.4f} | {r['validation_accuracy']:.4f} | "
                     f"{r['epsilon']:.2f} | {r['sigma']:.3f} | {r['steps']} | {r['trained']:,} "
                     f"| {r['wall_s'] / 60:.1f} min |")
    return "\n".join(lines)


def earlier_rows(path: Path) -> dict[str, str]:
    """The table rows this benchmark wrote before, by variant name."""
    text = path.read_text() if path.exists() else ""
    start = text.find(TITLE)
    if start < 0:
        return {}
    end = text.find("\n## ", start + len(TITLE))
    rows = {}
    for line in text[start:end if end >= 0 else None].splitlines():
        name = line.split("|")[1].strip() if line.startswith("| ") else ""
        if name in VARIANTS:
            rows[name] = line
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    results, results_file = {}, Path(__file__).with_name("RESULTS.md")
    earlier = earlier_rows(results_file)
    for name in args.only:
        with tempfile.TemporaryDirectory() as output_dir:
            print(f"{name}: running", flush=True)
            results[name] = run_variant(*VARIANTS[name], output_dir)
        print(f"{name}: {results[name]}", flush=True)
        write_section(results_file, section(results, earlier))


if __name__ == "__main__":
    main()
