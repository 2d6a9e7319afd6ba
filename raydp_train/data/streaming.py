"""`data.sampler: streaming`: Poisson sampling over a Parquet split that no worker holds whole
(ARCHITECTURE.md §2.13).

Rank w of W owns the w-th of W contiguous runs of the file's rows. Each epoch, Ray Data reads
its rows row group by row group, gives each row its steps of the epoch (per row a
Binomial(steps, q) count and that many distinct steps, privacy/step_draws.py), one copy of
the row per step it joins, and sorts the copies by (step, row): a shuffle through the object
store, which spills to disk what it cannot hold. The worker then reads the steps in order,
one step's rows in memory at a time, every step of the epoch even with no rows (it still
takes part in the all-reduce). `choose_sampler` picks memory or streaming for
`data.sampler: auto` by the size of a worker's shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydp_train.config.data import streaming_refusal
from raydp_train.privacy.step_draws import row_steps

STEP, ROW = "__step", "__row"  # the columns a drawn copy of a row carries
BATCH_ROWS = 1024  # rows per batch read from a row group
MIB = 1 << 20


@dataclass(frozen=True)
class EpochDraws:
    """What fixes an epoch's draws: the run's seed, the epoch, its steps, q."""

    seed: int
    epoch: int
    steps: int
    sampling_rate: float


def worker_rows(num_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """[first, stop) of the rows rank `rank` draws from and trains on: W contiguous runs,
    sizes differing by at most one, every row in exactly one."""
    return rank * num_rows // world_size, (rank + 1) * num_rows // world_size


def shard_mib(path: Path, columns: list[str], workers: int) -> float:
    """A worker's share of `columns` of `path`, uncompressed, in MiB (from the footer)."""
    metadata = pq.ParquetFile(path).metadata
    names = set(columns)
    total = sum(group.column(c).total_uncompressed_size
                for group in (metadata.row_group(g) for g in range(metadata.num_row_groups))
                for c in range(group.num_columns) if group.column(c).path_in_schema.split(".")[0] in names)
    return total / MIB / workers


def choose_sampler(pipeline) -> str:
    """"memory" or "streaming", as `data.sampler` says; auto picks streaming when a worker's
    share of the training file exceeds data.sampler_memory_mb and streaming can serve the
    pipeline (config/data.py's `streaming_refusal`), memory otherwise."""
    data, training = pipeline.data, pipeline.training
    sampler = getattr(data, "sampler", "memory")
    if sampler != "auto":
        return sampler
    one_worker_sweep = pipeline.tune is not None and training.workers == 1
    if streaming_refusal(data, training.cache_frozen_prefix, one_worker_sweep) is not None:
        return "memory"
    too_big = shard_mib(Path(data.path), read_columns(data), training.workers)
    return "streaming" if too_big > data.sampler_memory_mb else "memory"


def read_columns(data) -> list[str]:
    """The columns the pipeline reads: its features, then its labels."""
    features = ([data.text_column] if data.text_column else
                data.feature_columns or [data.tensor_column])
    return [*features, *([data.label_column] if data.label_column is not None else [])]


def row_group_pieces(path: Path, first: int, stop: int) -> list[dict]:
    """The row groups of `path` holding rows [first, stop), each with the part it holds."""
    metadata, pieces, start = pq.ParquetFile(path).metadata, [], 0
    for group in range(metadata.num_row_groups):
        end = start + metadata.row_group(group).num_rows
        if start < stop and first < end:
            pieces.append({"row_group": group, "group_first": start,
                           "first": max(first, start), "stop": min(stop, end)})
        start = end
    return pieces


def drawn_copies(pieces: dict, path: str, columns: list[str], draws: EpochDraws) -> Iterator:
    """Ray Data's map over row groups: each row once per step it joins, with STEP and ROW."""
    file = pq.ParquetFile(path)
    for piece in zip(*(pieces[key] for key in ("row_group", "group_first", "first", "stop"))):
        group, position, first, stop = (int(value) for value in piece)
        for batch in file.iter_batches(BATCH_ROWS, row_groups=[group], columns=columns):
            low, high = max(first, position), min(stop, position + batch.num_rows)
            if low < high:
                yield copies_by_step(pa.Table.from_batches(
                    [batch.slice(low - position, high - low)]), low, draws)
            position += batch.num_rows


def copies_by_step(rows: pa.Table, first_row: int, draws: EpochDraws) -> pa.Table:
    """`rows`, whose first is row `first_row` of the training set, once per step each joins,
    with its STEP and ROW: what any source of numbered rows gives the sort by step."""
    offsets, steps = row_steps(draws.seed, draws.epoch, first_row, rows.num_rows, draws.steps,
                               draws.sampling_rate)
    return rows.take(offsets).append_column(STEP, pa.array(steps)).append_column(
        ROW, pa.array(offsets + first_row))


def step_ordered(path: Path, columns: list[str], first: int, stop: int, draws: EpochDraws):
    """A lazy Ray Data dataset of rows [first, stop)'s drawn copies, sorted by (step, row);
    None when the rows are none."""
    import ray.data

    pieces = row_group_pieces(path, first, stop)
    if not pieces:
        return None
    items = ray.data.from_items(pieces, override_num_blocks=len(pieces))
    copies = items.map_batches(drawn_copies, batch_size=1, batch_format="numpy",
                               fn_kwargs={"path": str(path), "columns": columns, "draws": draws})
    ordered = copies.sort([STEP, ROW])
    # The sort's blocks in their order, not as their tasks finish: a step's rows must come
    # together, and before the next step's.
    ordered.context.execution_options.preserve_order = True
    return ordered


def steps_in_order(batches: Iterable[pa.Table], steps: int, schema: pa.Schema) -> Iterator:
    """Each step's rows, 0 .. steps-1 in order, as a table of `schema` (empty for a step no
    row joined), from batches sorted by step; one step's rows held at a time."""
    step, held = 0, []
    for batch in batches:
        ids = batch.column(STEP).to_numpy()
        if ids.size and (ids[0] < step or np.any(np.diff(ids) < 0) or ids[-1] >= steps):
            # never train a row in a step it was not drawn for
            raise RuntimeError(f"rows out of step order: step {ids.min()} after step {step}")
        while batch.num_rows:
            count = int((ids == ids[0]).sum())  # sorted: the first step's rows lead
            while step < ids[0]:
                yield _table(held, schema)
                step, held = step + 1, []
            held.append(batch.slice(0, count).select(schema.names))
            batch, ids = batch.slice(count), ids[count:]
    while step < steps:
        yield _table(held, schema)
        step, held = step + 1, []


def _table(parts: list[pa.Table], schema: pa.Schema) -> pa.Table:
    return pa.concat_tables(parts) if parts else schema.empty_table()


def epoch_steps(path: Path, columns: list[str], rows: tuple[int, int],
                draws: EpochDraws) -> Iterator[pa.Table]:
    """This worker's rows of each step of the epoch, in order (see the module's doc)."""
    schema = pq.ParquetFile(path).schema_arrow
    schema = pa.schema([schema.field(name) for name in columns])
    dataset = step_ordered(path, columns, *rows, draws)
    batches = () if dataset is None else dataset.iter_batches(
        batch_size=BATCH_ROWS, batch_format="pyarrow", prefetch_batches=1)
    return steps_in_order(batches, draws.steps, schema)
