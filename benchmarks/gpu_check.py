"""The GPU check, run by benchmarks/gpu_check.sh: the CUDA tests, the step times of
benchmarks/gpu_step.py, the quickstart, a 1-epoch SST-2 subset with `training.use_gpu: true`
(DP-SGD, and DP-LoRA on an fp32 and a bf16 frozen base), and FSDP sharding on 2 workers
(NCCL, one GPU each: skipped, saying so, with fewer); then one table.

    bash benchmarks/gpu_check.sh              (one GPU; under 8 minutes)
    bash benchmarks/gpu_check.sh --dry-run    (no GPU: the same checks on the CPU, shrunk)

A dry run proves the script's plumbing where no GPU is: the CUDA tests are collected (and
skip, saying why), the steps run on 2 rows for 1 step, the pipelines run on the CPU on a
sliver of their data.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
SST2 = ROOT.parent / "shared" / "data" / "sst2"
BIN = Path(sys.executable).parent
# SST-2 rows of the 1-epoch subset: (train, test, dev) on a GPU, and in a dry run.
SUBSET = {False: (8192, 872, 872), True: (64, 32, 32)}


def run(command: list[str], timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          check=False, env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    if done.returncode != 0:
        sys.exit(f"gpu check: {' '.join(command[:4])} ... failed:\n{done.stdout[-3000:]}\n"
                 f"{done.stderr[-3000:]}")
    return done, time.monotonic() - started


def cuda_tests(dry_run: bool) -> tuple[str, float]:
    done, seconds = run([sys.executable, "-m", "pytest", "-q", "-rs", "-k", "cuda",
                         "tests/test_precision.py"], 300)
    summary = re.findall(r"(\d+ (?:passed|skipped|deselected|failed))", done.stdout)
    if not dry_run and not any("passed" in part for part in summary):
        sys.exit(f"gpu check: no CUDA test ran on the GPU:\n{done.stdout[-2000:]}")
    return ", ".join(summary), seconds


def step_times(dry_run: bool, out: Path) -> tuple[str, float]:
    command = [sys.executable, "benchmarks/gpu_step.py", "--out", str(out),
               "--device", "cpu" if dry_run else "cuda", *(["--dry-run"] if dry_run else [])]
    _, seconds = run(command, 360)
    return out.read_text(), seconds


def pipeline_run(pipeline: str, dry_run: bool, folder: Path, *settings: str,
                 name: str | None = None, workers: int = 1) -> tuple[str, float]:
    output = folder / (name or Path(pipeline).stem)
    _, seconds = run([str(BIN / "raydp-train"), "run", pipeline,
                      "--set", f"training.workers={workers}",
                      "--set", f"training.use_gpu={str(not dry_run).lower()}",
                      "--set", f"run.output_dir={output}", *settings], 420)
    (run_dir,) = [d for d in output.iterdir() if d.is_dir()]
    record = json.loads((run_dir / "record.json").read_text())
    last = record["metrics"][-1]
    return (f"test accuracy {last['test_accuracy']:.3f}, epsilon "
            f"{record['privacy']['epsilon']:.3f}, {last['steps']} steps"), seconds


def sst2_subset(dry_run: bool, folder: Path) -> list[str]:
    """`--set` words that point the SST-2 pipeline at the first rows of each split."""
    settings = []
    for key, split, rows in zip(("data.path", "data.test_path", "data.validation.path"),
                                ("train", "test", "dev"), SUBSET[dry_run], strict=True):
        path = folder / f"{split}.parquet"
        pq.write_table(pq.read_table(SST2 / f"{split}.parquet").slice(0, rows), path)
        settings += ["--set", f"{key}={path}"]
    if dry_run:  # the pipeline's batch of 1,024 is more than a dry run's rows
        settings += ["--set", "training.batch_size=16", "--set", "training.max_physical_batch=16"]
    return settings


def lora_rows(dry_run: bool, folder: Path, subset: list[str]) -> list[tuple]:
    """DP-LoRA on the SST-2 subset with its frozen base in fp32 and in bf16 (a dry run: bf16
    alone, the path the fp32 runs of the test suite do not take)."""
    dtypes = ("bf16",) if dry_run else ("fp32", "bf16")
    return [(f"SST-2 subset, 1 epoch, DP-LoRA, {dtype} frozen base",
             *pipeline_run("pipelines/sst2_minilm_lora.yaml", dry_run, folder,
                           "--set", "training.epochs=1", "--set", f"model.frozen_dtype={dtype}",
                           *subset, name=f"lora-{dtype}"))
            for dtype in dtypes]


def sharded_row(dry_run: bool, folder: Path) -> tuple:
    """`training.sharding: fsdp` on 2 workers: NCCL wants a GPU per rank (a dry run: Gloo)."""
    check = "digits, 1 epoch, DP-SGD, training.sharding fsdp on 2 workers"
    if not dry_run:
        import torch

        if torch.cuda.device_count() < 2:
            found = torch.cuda.device_count()
            return check, f"skipped: {found} GPU here, NCCL needs one per rank", 0.0
    return (check, *pipeline_run("pipelines/digits_dpsgd.yaml", dry_run, folder,
                                 "--set", "training.epochs=1", "--set",
                                 "training.sharding=fsdp", name="sharded", workers=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="no GPU: the CPU, shrunk")
    args = parser.parse_args()
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            sys.exit("gpu check: torch sees no CUDA device here (a CPU dry run: --dry-run)")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        rows.append(("CUDA tests (tests/test_precision.py -k cuda)", *cuda_tests(args.dry_run)))
        steps, seconds = step_times(args.dry_run, folder / "steps.md")
        rows.append(("step times (benchmarks/gpu_step.py, table below)", "done", seconds))
        epochs = ["--set", "training.epochs=2"] if args.dry_run else []
        rows.append(("quickstart", *pipeline_run("pipelines/quickstart.yaml", args.dry_run,
                                                 folder, *epochs)))
        subset = sst2_subset(args.dry_run, folder)
        rows.append((f"SST-2 subset ({SUBSET[args.dry_run][0]} rows), 1 epoch, DP-SGD",
                     *pipeline_run("pipelines/sst2_minilm_dpsgd.yaml", args.dry_run, folder,
                                   "--set", "training.epochs=1", *subset)))
        rows += lora_rows(args.dry_run, folder, subset)
        rows.append(sharded_row(args.dry_run, folder))
    where = "CPU dry run" if args.dry_run else "GPU"
    print(f"\n## GPU check ({where}, {time.strftime('%Y-%m-%d')})\n\n"
          "| check | result | seconds |\n|---|---|---:|", flush=True)
    for check, result, seconds in rows:
        print(f"| {check} | {result} | {seconds:.0f} |")
    print(f"\n{steps}", flush=True)


if __name__ == "__main__":
    main()
