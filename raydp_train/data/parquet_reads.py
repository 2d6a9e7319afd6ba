"""Ray Data's read of a Parquet file, through its first reader (`use_datasource_v2 = False`).

Ray Data 2.60 reads Parquet through DataSourceV2 by default, which starts a pool of 32 actors
to read the files' footers on every `read_parquet` (RAY_DATA_PARQUET_FOOTER_NUM_ACTORS): built
for thousands of files on many nodes, it is a storm of processes for our splits, each one
file. On 2 cores a run of three small split files took 2.7x the wall time (175-181 s,
about 340 CPU s) it takes through the first reader (63-70 s; benchmarks/ray_data_reads.py).
That reader reads a file's footer where `read_parquet` is called and its rows in read tasks,
in file order as before."""

from __future__ import annotations

from pathlib import Path


def read_parquet(path: Path):
    """A lazy Ray Data dataset of `path`'s rows, read by Ray Data's first Parquet reader, with
    no progress bar; the caller's DataContext is left as it was."""
    import ray.data

    context = ray.data.DataContext.get_current()
    previous = context.use_datasource_v2, context.enable_progress_bars
    # Its footer sampling draws a progress bar on the console where it is called.
    context.use_datasource_v2, context.enable_progress_bars = False, False
    try:
        return ray.data.read_parquet(str(path))
    finally:
        context.use_datasource_v2, context.enable_progress_bars = previous
