"""What a run whose splits are Parquet files of their own pays for reading them through Ray
Data (data/parquet_reads.py): the shipped reader (Ray Data's first Parquet reader) against
Ray Data 2.60's default (DataSourceV2, which starts 32 footer-reading actors per read), and
a run with Ray Train's preemption watcher, which an embedded Ray turns off (train/trainer.py).
Synthetic rows of 6 features in three files (train 2,000, test 500, validation 300), a
2-layer MLP, 2 epochs, 2 workers, each variant twice, alternating, on one embedded Ray.

    .venv/bin/python benchmarks/ray_data_reads.py          (about 8 minutes on 2 cores)
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import write_section
from suite_floor import timed

RESULTS = Path(__file__).with_name("RESULTS.md")
TITLE = "## Reading split files through Ray Data (benchmarks/ray_data_reads.py)"
ROUNDS = 2


def write_splits(folder: Path) -> dict[str, str]:
    rng = np.random.default_rng(11)
    paths = {}
    for name, count in (("train", 2000), ("test", 500), ("dev", 300)):
        features = rng.normal(0, 1, (count, 6))
        label = (features @ rng.normal(0, 1, 6) > 0).astype(np.int64)
        table = pa.table({**{f"x{i}": features[:, i] for i in range(6)}, "y": label})
        paths[name] = str(folder / f"{name}.parquet")
        pq.write_table(table, paths[name])
    return paths


def pipeline(paths: dict[str, str], output: Path):
    import raydp_train as rt

    return rt.Pipeline.from_dict({
        "name": "reads", "data": {
            "source": "parquet", "path": paths["train"], "test_path": paths["test"],
            "feature_columns": [f"x{i}" for i in range(6)], "label_column": "y",
            "validation": {"path": paths["dev"], "private": False}},
        "model": {"kind": "mlp", "hidden_sizes": [16], "num_classes": 2},
        "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-5},
        "training": {"epochs": 2, "batch_size": 100, "workers": 2},
        "run": {"seed": 3, "output_dir": str(output)}})


def default_reader(path):
    import ray.data

    return ray.data.read_parquet(str(path))


def run_variant(variant: str, paths: dict, output: Path):
    import raydp_train as rt
    from raydp_train.data import shards
    from raydp_train.data.parquet_reads import read_parquet
    from raydp_train.train.trainer import PREEMPTION_WATCHER

    shards.read_parquet = default_reader if variant == "default reader" else read_parquet
    os.environ[PREEMPTION_WATCHER] = "1" if variant == "preemption watcher on" else "0"
    with timed() as took:
        result = rt.run(pipeline(paths, output), on_line=None, on_epoch=None, on_progress=None)
    assert result.status == "completed", result.status
    return took


def main() -> None:
    import ray

    from raydp_train.train.trainer import ensure_ray

    load = os.getloadavg()[0]
    variants = ("shipped", "default reader", "preemption watcher on")
    measured = {variant: [] for variant in variants}
    with tempfile.TemporaryDirectory() as scratch:
        paths = write_splits(Path(scratch))
        ensure_ray(None, num_cpus=4)
        for round_number in range(ROUNDS):
            for variant in variants:
                took = run_variant(variant, paths, Path(scratch) / "runs")
                measured[variant].append(took)
                print(f"round {round_number + 1} {variant}: {took.wall:.1f} s, "
                      f"{took.cpu:.1f} CPU s", flush=True)
        ray.shutdown()
    base = sum(took.wall for took in measured["shipped"])
    lines = [TITLE, "", (f"{os.cpu_count()} cores, 1-minute load average {load:.1f} before "
                         "the runs. A run of 2 epochs whose train, test and validation splits "
                         "are files of their own, so the workers read them through Ray Data; "
                         "CPU s: the whole machine's, Ray's processes included."), "",
             "| variant | wall per run | CPU s per run | contention | wall vs shipped |",
             "|---|---|---|---|---:|"]
    for variant, runs in measured.items():
        walls = ", ".join(f"{took.wall:.1f} s" for took in runs)
        cpus = ", ".join(f"{took.cpu:.0f}" for took in runs)
        contention = ", ".join(f"{took.contention:.0%}" for took in runs)
        ratio = sum(took.wall for took in runs) / base
        lines.append(f"| {variant} | {walls} | {cpus} | {contention} | {ratio:.2f}x |")
    write_section(RESULTS, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
