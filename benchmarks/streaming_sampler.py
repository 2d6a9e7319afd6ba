"""Rows per second one worker gets from a Parquet training file: Ray Data's plain
`iter_batches` (no sampling), the in-memory sampler (train/samplers.py `MemorySampler`: read
the shard, then a Poisson mask and a gather per step) and the streaming sampler
(`data.sampler: streaming`, data/streaming.py: per-row draws, a sort by step in Ray Data, the
steps read in order). Rank 0 of 2 workers (half the file), one epoch of 1/q steps; the rows
a sampler hands over per second, the time to read or sort the rows included. One process, an
embedded Ray of 2 CPUs; the machine's load (`uptime`) is recorded with the table.

    .venv/bin/python benchmarks/streaming_sampler.py [--rows 100000] [--width 256]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import write_section

RESULTS = Path(__file__).with_name("RESULTS.md")
TITLE = "## Streaming sampler: rows per second per worker (benchmarks/streaming_sampler.py)"
WORKERS, RANK = 2, 0
# Kept under the table when the section is written again (measured otherwise: said where).
NOTES = """\
Reading it: the streaming sampler pays for its sort, a pass of every row through the object
store (spilled to disk when it does not fit), on top of what a plain read costs; the in-memory
sampler reads the shard once (its read is in its time: 100 epochs would pay it once) and then
only masks and gathers, but must hold the shard. Streaming is for shards that do not fit, not
a faster reader: `data.sampler: auto` keeps memory below `data.sampler_memory_mb`.

End to end (tests/test_streaming_sampler.py's cluster test, run by hand on 2026-12-06): a
382 MiB training file (300,000 rows of 256 float32 features), an embedded Ray with a 75 MiB
object store (Ray's least), 2 workers, 20 steps of one epoch, `auto` chose streaming: the
epoch took 164.6 s and the whole `run` 297 s at a load average of 16-39 on the 2 cores (other
jobs); each worker's peak RSS was 633 and 615 MiB, against 578 and 526 MiB for the in-memory
sampler on a 26 MiB file, and its resident data (the test rows) 12.8 and 12.0 MiB, for
150,000 training rows (150 MiB) a worker. examples_seen 300,076 (one epoch: about N)."""


def write_file(path: Path, rows: int, width: int) -> None:
    """Random float32 features (incompressible: the file is as large as its rows) and labels."""
    x = np.random.default_rng(0).standard_normal((rows, width), dtype=np.float32)
    table = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), width),
                      "label": (x[:, 0] > 0).astype(np.int64)})
    pq.write_table(table, path, row_group_size=2048, compression="none")


def plain_iter_batches(path: Path, rows: int) -> int:
    """Ray Data's read of the rank's rows, batch by batch, nothing sampled."""
    from raydp_train.data.parquet_reads import read_parquet

    first, stop = rows * RANK // WORKERS, rows * (RANK + 1) // WORKERS
    seen = 0
    dataset = read_parquet(path).limit(stop)
    for batch in dataset.iter_batches(batch_size=1024, batch_format="pyarrow"):
        seen += batch.num_rows
    return seen - first  # the other rank's rows are read too; counted as this rank's


def memory_sampler(path: Path, rows: int, q: float, steps: int) -> int:
    """The shard read into memory as a tensor, then per step a mask and a gather."""
    import torch

    from raydp_train.data.columns import numeric_features
    from raydp_train.privacy.sampling import poisson_sample

    first, stop = rows * RANK // WORKERS, rows * (RANK + 1) // WORKERS
    table = pq.read_table(path).slice(first, stop - first)
    features = torch.as_tensor(numeric_features(table, _Data(), path).astype(np.float32))
    generator, seen = torch.Generator().manual_seed(0), 0
    for _ in range(steps):
        seen += features[poisson_sample(stop - first, q, generator)].shape[0]
    return seen


def streaming_sampler(path: Path, rows: int, q: float, steps: int) -> int:
    """The streaming sampler's epoch: draws, Ray Data's sort by step, the steps in order, each
    step's rows as features (as a worker's `StreamingSampler.step_batches` makes them)."""
    from raydp_train.data.columns import numeric_features
    from raydp_train.data.streaming import EpochDraws, epoch_steps, worker_rows

    seen = 0
    draws = EpochDraws(seed=0, epoch=1, steps=steps, sampling_rate=q)
    for table in epoch_steps(path, ["x", "label"], worker_rows(rows, WORKERS, RANK), draws):
        seen += numeric_features(table, _Data(), path).shape[0] if table.num_rows else 0
    return seen


class _Data:
    feature_columns, tensor_column = None, "x"


def timed(name: str, run) -> dict:
    start = time.perf_counter()
    rows = run()
    seconds = time.perf_counter() - start
    return {"reader": name, "rows": rows, "seconds": seconds, "rows_per_s": rows / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--width", type=int, default=256, help="float32 features per row")
    parser.add_argument("--q", type=float, default=0.01, help="sampling rate (1/q steps)")
    parser.add_argument("--quick", action="store_true", help="10,000 rows; no RESULTS.md")
    args = parser.parse_args()
    rows = 10_000 if args.quick else args.rows
    steps = round(1 / args.q)
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "train.parquet"
        write_file(path, rows, args.width)
        mib = path.stat().st_size / 2**20
        load = os.getloadavg()
        results = [timed("Ray Data iter_batches (no sampling)", lambda: plain_iter_batches(path, rows)),
                   timed("in-memory sampler", lambda: memory_sampler(path, rows, args.q, steps)),
                   timed("streaming sampler", lambda: streaming_sampler(path, rows, args.q, steps))]
        load_after = os.getloadavg()
    ray.shutdown()
    table = [f"| {r['reader']} | {r['rows']:,} | {r['seconds']:.1f} | {r['rows_per_s']:,.0f} |"
             for r in results]
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout
    text = "\n".join([
        TITLE, "",
        (f"{rows:,} rows of {args.width} float32 features ({mib:.0f} MiB, uncompressed), rank 0 "
        f"of {WORKERS} workers (half the rows), q = {args.q} ({steps} steps, one epoch); rows "
        "handed over (sampled rows for the samplers; a row joins ~1 step an epoch), reading and "
        "sorting included. One process, an embedded Ray of 2 CPUs, on a machine shared with "
        f"other jobs: load average {load[0]:.1f} before, {load_after[0]:.1f} after "
        f"(`uptime`: {uptime.strip()})."), "",
        "| reader | rows | seconds | rows/s |", "|---|---:|---:|---:|", *table, "", NOTES, ""])
    print(text)
    if not args.quick:
        write_section(RESULTS, text)


if __name__ == "__main__":
    main()
