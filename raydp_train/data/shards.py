"""Parquet splits that scale with the workers (ARCHITECTURE.md §2.10): each split file is a Ray
Data dataset read on the cluster, and each Ray Train worker materializes (and tokenizes) only
its own shard; the driver reads no more of the files than their labels.

Sampling is still Poisson over the whole training set: every row lies in exactly one worker's
shard (the shards partition the rows, whichever blocks Ray Data hands to whom), and each worker
includes each of its rows independently with the global q = B / N; so each of the N examples
is included independently with probability q, exactly as by one sampler over all N.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray.data
from ray.train import DataConfig

from raydp_train.data.columns import numeric_rows, text_labels
from raydp_train.data.parquet_reads import read_parquet
from raydp_train.data.streaming import choose_sampler
from raydp_train.data.text import tokenize_texts

# The most rows per block (the unit shards are made of), and the rows per batch a worker
# reads while it materializes its shard.
BATCH_ROWS = 1024


def file_splits(data) -> dict[str, Path] | None:
    """{"train", "test"[, "validation"]} -> file, when the source is parquet and every split is
    a file of its own; None when a split is cut from a file (`train_fraction`,
    `validation.fraction`): those are read and split in memory (data/sources.py)."""
    if data.source != "parquet" or data.test_path is None:
        return None
    if getattr(data, "max_rows", None) is not None:  # a subset, read by the driver: small
        return None
    if getattr(data, "user_column", None) is not None:  # shards by user: split in memory
        return None
    validation = data.validation
    if validation is not None and validation.path is None:
        return None
    splits = {"train": Path(data.path), "test": Path(data.test_path)}
    if validation is not None:
        splits["validation"] = Path(validation.path)
    return splits


def shard_splits(pipeline) -> dict[str, Path] | None:
    """The splits that reach the workers as Ray Train shards: `file_splits`, less the training
    file when the workers stream it (data/streaming.py)."""
    splits = file_splits(pipeline.data)
    if splits is not None and choose_sampler(pipeline) == "streaming":
        del splits["train"]
    return splits


def split_datasets(pipeline) -> dict[str, ray.data.Dataset]:
    """Every split of `shard_splits` as a lazy Ray Data dataset of the columns the pipeline
    reads, in file order; nothing is read until the workers iterate their shards."""
    datasets = {}
    for name, path in shard_splits(pipeline).items():
        rows = pq.ParquetFile(path).metadata.num_rows  # the footer alone
        datasets[name] = in_blocks(read_parquet(path), pipeline, rows)
    return datasets


def shard_ready(datasets: dict, pipeline, train_rows: int) -> dict[str, ray.data.Dataset]:
    """Ray Datasets handed to run() (data.source ray_dataset), cut into blocks as a Parquet
    split of the same rows is: the same rows in the same shards, nothing written. The train
    split's size is known (counted before the plan); the others are counted here."""
    return {name: in_blocks(dataset, pipeline,
                            train_rows if name == "train" else dataset.count())
            for name, dataset in datasets.items()}


def one_worker_shards(datasets: dict, pipeline, train_rows: int) -> dict:
    """Ray Datasets handed over, as ONE Ray Train worker's shards of them (every row, in
    order): for a sweep's one-worker trial, trained in its own process (sweeps/trial.py)."""
    return ShardEveryRow().configure(shard_ready(datasets, pipeline, train_rows), 1, None,
                                     None)[0]


def in_blocks(dataset: ray.data.Dataset, pipeline, rows: int) -> ray.data.Dataset:
    """The columns the pipeline reads, in blocks of `block_rows`, in order."""
    data = pipeline.data
    text_column = getattr(data, "text_column", None)
    columns = [text_column] if text_column else data.feature_columns or [data.tensor_column]
    columns = [*columns, *([data.label_column] if data.label_column is not None else [])]
    per_block = block_rows(rows, pipeline.training.workers)
    return dataset.select_columns(columns).repartition(target_num_rows_per_block=per_block)


def split_name(data, split: str):
    """What an error about a split's rows names: its file, or the dataset handed over."""
    if data.source in ("ray_dataset", "hf_dataset"):
        from raydp_train.data.ray_dataset_checks import where

        return where(data, split)
    return file_splits(data)[split]


def block_rows(rows: int, workers: int) -> int:
    """Rows per block: at most BATCH_ROWS, and a multiple of `workers` blocks in all, so that
    W contiguous runs of blocks (ShardEveryRow) differ by at most a block's remainder."""
    blocks_per_worker = max(1, math.ceil(rows / (workers * BATCH_ROWS)))
    return max(1, math.ceil(rows / (workers * blocks_per_worker)))


def shard_rows(table: pa.Table, data, path: Path, tokenizer: str | None) -> tuple:
    """One batch of a split file's shard -> (features, labels): token ids and masks, or
    numbers, as the in-memory reader (data/sources.py) makes them of the whole file."""
    text_column = getattr(data, "text_column", None)
    if text_column is None:
        features, labels = numeric_rows(table, data, path)
        return features.astype(np.float32), labels
    labels = text_labels(table, table.num_rows, path, data)
    texts = table.column(text_column).to_pylist()
    return tokenize_texts(texts, tokenizer, data.max_length), labels


class ShardEveryRow(DataConfig):
    """Ray Train's default split (`equal=True`) may drop rows so that every worker gets as
    many; Poisson sampling needs every row in exactly one shard, so shard sizes may differ.

    Rank r gets the r-th of W contiguous runs of rows, in order, cut where W runs of
    `block_rows` blocks would end (`shard_bounds`): the same rows for the same rows and W
    however the dataset was cut into blocks (a Parquet file, or a Ray Dataset handed over)
    and wherever the workers run (a streaming split hands blocks to whichever worker asks
    first), so a seeded run samples the same examples on one node or several. Each worker
    reads (and tokenizes) only its rows."""

    def configure(self, datasets, world_size: int, worker_handles, worker_node_ids, **kwargs):
        shards = [{} for _ in range(world_size)]
        for name, dataset in datasets.items():
            dataset.context.execution_options.preserve_order = True  # blocks in order
            if world_size == 1:
                shards[0][name] = dataset.iterator()
                continue
            blocks = dataset.materialize()  # in the object store: the references alone here
            bounds = shard_bounds(blocks.count(), world_size)
            for rank, shard in enumerate(blocks.split_at_indices(bounds)):
                shards[rank][name] = shard.iterator()
        return shards


def shard_bounds(rows: int, workers: int) -> list[int]:
    """Where ranks 1..W-1's rows start: after whole runs of `block_rows` blocks, as many per
    worker (the last worker's run may be shorter, or empty when there are few rows)."""
    per_worker = max(1, math.ceil(rows / (workers * BATCH_ROWS))) * block_rows(rows, workers)
    return [min(rows, rank * per_worker) for rank in range(1, workers)]


def materialize(shard, pipeline, split: str, feature_shape: tuple[int, ...],
                labels_as: tuple = (np.int64, ()), tokenizer: str | None = None,
                ) -> tuple[np.ndarray, np.ndarray]:
    """A worker's whole shard of `split` (a Ray Data iterator) as (features, labels) arrays,
    text tokenized here with `tokenizer` (models.hf_files.tokenizer_source); the labels of
    `labels_as`'s (dtype, one row's shape): targets.LabelKind.label_array."""
    dtype, label_shape = labels_as
    path = split_name(pipeline.data, split)
    features, labels = [], []
    for batch in shard.iter_batches(batch_size=BATCH_ROWS, batch_format="pyarrow"):
        batch_features, batch_labels = shard_rows(batch, pipeline.data, path, tokenizer)
        features.append(batch_features)
        labels.append(batch_labels)
    if not labels:  # more workers than blocks: an empty shard still takes its steps
        return np.empty((0, *feature_shape), np.float32), np.empty((0, *label_shape), dtype)
    return np.concatenate(features), np.concatenate(labels).astype(dtype)
