"""Ray Datasets handed to `run` (data.source ray_dataset), checked where they are
(ARCHITECTURE.md §2.10): Ray Data tasks (`map_batches`) check every batch's features as a
Parquet file's are checked (numbers or equally-shaped tensors, no nulls, NaN or inf; text as
strings without nulls) and pass on only the label column and each batch's feature shape, so
the driver holds the labels and the row counts, as it does for Parquet splits, never the
features; nothing is written anywhere. An error names the dataset (`datasets['train']`), not
a file. The driver's summary is a `Dataset` whose features are zeros of the right shape (one
row broadcast): the plan's N, the model's input shape and the label checks come from it;
each worker then reads its own shard (data/shards.py). A sweep's trials get the summary through
the object store `portable` (one zero row per split: a broadcast array is pickled whole).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa

from raydp_train.data.columns import BATCH_ROWS, labels_of, numeric_features
from raydp_train.data.numeric_files import check_finite
from raydp_train.data.sources import Dataset
from raydp_train.data.targets import label_kind
from raydp_train.errors import DataError, user_error_in

SHAPE = "__raydp_train_feature_shape"  # the column that carries each batch's feature shape


def where(data, split: str) -> str:
    """What an error about a split's rows names: the Ray Dataset passed, or the Hugging Face
    dataset's split."""
    if data.source == "hf_dataset":
        from raydp_train.data.hf_datasets import where as hf_where

        return hf_where(data, split)
    return f"datasets[{split!r}]"


def checked_datasets(datasets: dict, data, num_classes: int | None, tokenizer: str | None,
                     classes_field: str) -> Dataset:
    """The driver's summary of the splits {"train", "test"[, "validation"]}, every row
    checked on the cluster; raises the DataError of the first bad batch."""
    if getattr(data, "text_column", None) is not None and tokenizer is None:
        raise DataError("data.text_column: text needs a tokenizer: model.name_or_path of "
                        "model.kind hf, or model.tokenizer of model.kind torch")
    read = {name: _checked_split(dataset, data, name) for name, dataset in datasets.items()}
    shapes = {name: features.shape[1:] for name, (features, _) in read.items()}
    if len(set(shapes.values())) > 1:
        raise DataError(f"{where(data, 'test')}: features of shape {shapes['test']} do not "
                        f"match {shapes['train']} in {where(data, 'train')}")
    kind = label_kind(data)
    splits = [("training", read["train"][1]), ("test", read["test"][1])]
    if "validation" in read:
        splits.append(("validation", read["validation"][1]))
    classes = kind.width(splits, num_classes, classes_field, data)
    validation = read.get("validation", (None, None))
    return Dataset(read["train"][0], read["train"][1].astype(kind.dtype), read["test"][0],
                   read["test"][1].astype(kind.dtype), classes, validation[0],
                   None if validation[1] is None else validation[1].astype(kind.dtype),
                   features_read=False)


def portable(summary: Dataset) -> Dataset:
    """The summary as it travels to a sweep's trials: each split's zero features one row."""
    return dataclasses.replace(summary, **{name: features[:1]
                                           for name, features in _features(summary)})


def widened(sent: Dataset) -> Dataset:
    """A `portable` summary with each split's zero features broadcast to its rows again."""
    return dataclasses.replace(sent, **{
        name: np.broadcast_to(features, (len(getattr(sent, name.replace("features", "labels"))),
                                         *features.shape[1:]))
        for name, features in _features(sent)})


def _features(summary: Dataset) -> list[tuple[str, np.ndarray]]:
    names = ("train_features", "test_features", "validation_features")
    return [(name, getattr(summary, name)) for name in names if getattr(summary, name) is not None]


def _checked_split(dataset, data, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(zeros in the features' shape, one row broadcast; the labels) of one dataset."""
    columns = _columns(data)
    names = dataset.schema.names if isinstance(dataset, pa.Table) else dataset.schema().names
    missing = [column for column in columns if column not in names]
    if missing:
        raise DataError(f"{where(data, split)}: column(s) {missing} not in the dataset; "
                        f"available: {', '.join(names)}")
    local = isinstance(dataset, pa.Table)
    chosen = dataset.select(columns) if local else dataset.select_columns(columns)
    tables = [table for table in _checked_batches(chosen, data, split) if table.num_rows]
    if not tables:
        raise DataError(f"{where(data, split)}: has no rows")
    table = pa.concat_tables(tables)
    shapes = sorted(set(table.column(SHAPE).to_pylist()))
    if len(shapes) > 1:
        raise DataError(f"data.tensor_column: '{data.tensor_column}' in {where(data, split)} "
                        f"must hold equally-shaped lists of numbers, got {', '.join(shapes)}")
    shape = tuple(int(size) for size in shapes[0].split("x") if size)
    rows = table.num_rows
    if data.label_column is None:
        labels = np.zeros(rows, np.int64)
    else:
        labels = labels_of(table.column(data.label_column), where(data, split), data)
    dtype = np.int32 if getattr(data, "text_column", None) else np.float32
    return np.broadcast_to(np.zeros((1, *shape), dtype), (rows, *shape)), labels


def _checked_batches(dataset, data, split: str) -> list[pa.Table]:
    """BatchCheck's tables of every batch: by Ray Data tasks, or here for an Arrow table
    (validate of a Hugging Face dataset, without Ray)."""
    check = BatchCheck(data, split)
    if isinstance(dataset, pa.Table):
        return [check(pa.Table.from_batches([batch]))
                for batch in dataset.to_batches(max_chunksize=BATCH_ROWS)]
    checked = dataset.map_batches(check, batch_format="pyarrow")
    checked.context.raise_original_map_exception = True  # the DataError, not Ray's wrapper
    try:
        return list(checked.iter_batches(batch_size=None, batch_format="pyarrow"))
    except Exception as error:  # noqa: BLE001 -- a batch's DataError, under Ray Data's wrappers
        raise user_error_in(error) or error from None


def _columns(data) -> list[str]:
    text_column = getattr(data, "text_column", None)
    columns = [text_column] if text_column else data.feature_columns or [data.tensor_column]
    return [*columns, *([data.label_column] if data.label_column is not None else [])]


class BatchCheck:
    """A Ray Data task's check of one batch: its features as a Parquet file's are checked;
    returns the label column and the batch's feature shape ("3", "2x128")."""

    def __init__(self, data, split: str):
        self.data, self.split = data, split

    def __call__(self, table: pa.Table) -> pa.Table:
        data, name = self.data, where(self.data, self.split)
        text_column = getattr(data, "text_column", None)
        if text_column is not None:
            shape = (2, data.max_length)
            _check_text(table.column(text_column), text_column, name)
        else:
            features = numeric_features(table, data, name)
            check_finite(features, name, "data")
            shape = features.shape[1:]
        kept = {SHAPE: pa.array(["x".join(map(str, shape))] * table.num_rows)}
        if data.label_column is not None:
            kept[data.label_column] = table.column(data.label_column)
        return pa.table(kept)


def _check_text(column: pa.ChunkedArray, name: str, where_: str) -> None:
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"data.text_column: column '{name}' in {where_} is {column.type}, "
                        "expected strings")
    if column.null_count:
        raise DataError(f"data.text_column: '{name}' in {where_} has {column.null_count} null "
                        "rows")
