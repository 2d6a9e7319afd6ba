"""Ray Datasets handed to `run` (data.source ray_dataset), checked where they are
(ARCHITECTURE.md §2.10): Ray Data tasks (`map_batches`) check every batch's features as a
Parquet file's are checked (numbers or equally-shaped tensors, no nulls, NaN or inf; text as
strings without nulls) and pass on only the label column and each batch's feature shape, so
the driver holds the labels and the row counts, as it does for Parquet splits, never the
features; nothing is written anywhere. An error names the dataset (`datasets['train']`), not
a file. The driver's summary is a `Dataset` whose features are zeros of the right shape (one
row broadcast): the plan's N, the model's input shape and the label checks come from it;
each worker then reads its own shard (data/shards.py).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from raydp_train.data.columns import labels_of, numeric_features
from raydp_train.data.numeric_files import check_finite
from raydp_train.data.sources import Dataset
from raydp_train.data.targets import label_kind
from raydp_train.errors import DataError
from raydp_train.runs.worker_errors import user_error_in

SHAPE = "__raydp_train_feature_shape"  # the column that carries each batch's feature shape


def where(split: str) -> str:
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
        raise DataError(f"{where('test')}: features of shape {shapes['test']} do not match "
                        f"{shapes['train']} in {where('train')}")
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


def _checked_split(dataset, data, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(zeros in the features' shape, one row broadcast; the labels) of one dataset."""
    columns = _columns(data)
    names = dataset.schema().names
    missing = [column for column in columns if column not in names]
    if missing:
        raise DataError(f"{where(split)}: column(s) {missing} not in the dataset; available: "
                        f"{', '.join(names)}")
    checked = dataset.select_columns(columns).map_batches(
        BatchCheck(data, split), batch_format="pyarrow")
    try:
        tables = [batch for batch in checked.iter_batches(batch_size=None,
                                                           batch_format="pyarrow")]
    except Exception as error:  # noqa: BLE001 -- a batch's DataError, under Ray Data's wrappers
        raise user_error_in(error) or error from None
    tables = [table for table in tables if table.num_rows]
    if not tables:
        raise DataError(f"{where(split)}: has no rows")
    table = pa.concat_tables(tables)
    shapes = sorted(set(table.column(SHAPE).to_pylist()))
    if len(shapes) > 1:
        raise DataError(f"data.tensor_column: '{data.tensor_column}' in {where(split)} must "
                        f"hold equally-shaped lists of numbers, got {', '.join(shapes)}")
    shape = tuple(int(size) for size in shapes[0].split("x") if size)
    rows = table.num_rows
    if data.label_column is None:
        labels = np.zeros(rows, np.int64)
    else:
        labels = labels_of(table.column(data.label_column), where(split), data)
    dtype = np.int32 if getattr(data, "text_column", None) else np.float32
    return np.broadcast_to(np.zeros((1, *shape), dtype), (rows, *shape)), labels


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
        data, name = self.data, where(self.split)
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
