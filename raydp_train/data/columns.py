"""Parquet columns as numpy arrays: numeric features (standardized with public statistics),
tensors, and labels (integers, or strings named by `data.label_names`); each column checked,
and a column that cannot be used is a DataError naming the column and file."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydp_train.data.arrow_numbers import numbers_as_numpy
from raydp_train.data.targets import label_kind
from raydp_train.errors import DataError


def one_line(error: Exception) -> str:
    """A library's message on one line (pyarrow's may span several)."""
    return " ".join(str(error).split())


def numeric_rows(table: pa.Table, config, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(features, labels) of a table of `config`'s numeric or tensor columns: what a data
    worker makes of each batch of a file that `read_numeric_file` checked."""
    labels = labels_of(table.column(config.label_column), path, config)
    return numeric_features(table, config, path), labels


def numeric_features(table: pa.Table | pa.RecordBatch, config, path: Path) -> np.ndarray:
    """The features of a table (or a batch) of `config`'s numeric or tensor columns."""
    if config.feature_columns:
        columns = config.feature_columns
        features = np.stack([_numeric(table.column(c), path, c) for c in columns], axis=1)
        return _standardized(features, config)
    return _tensor_column(table.column(config.tensor_column), path, config.tensor_column)


class FeatureScaleWarning(UserWarning):
    """Raw numeric features far from unit scale: DP-SGD will learn little from them."""


# Features beyond this magnitude swamp a clipped gradient (the clip norm C is ~1).
FAR_FROM_UNIT_SCALE = 100.0


def _standardized(features: np.ndarray, config) -> np.ndarray:
    """(x - mean) / std per column with the pipeline's public statistics. A column left raw
    whose values reach far beyond unit scale gets a warning, shown to whoever runs the
    pipeline on their own data (it is not part of any release)."""
    normalize = config.normalize or {}
    for index, column in enumerate(config.feature_columns):
        if column in normalize:
            mean, std = normalize[column]
            features[:, index] = (features[:, index] - mean) / std
        elif np.abs(features[:, index]).max() > FAR_FROM_UNIT_SCALE:
            warnings.warn(FeatureScaleWarning(
                f"data.feature_columns: column '{column}' has values beyond +-"
                f"{FAR_FROM_UNIT_SCALE:g}; clipped gradients will hardly move on such raw "
                f"features. Give public statistics: data.normalize: {{{column}: [mean, std]}}"
            ), stacklevel=2)
    return features


def _numeric(column: pa.ChunkedArray, path: Path, name: str) -> np.ndarray:
    if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
        raise DataError(f"data: column '{name}' in {path} is {column.type}, expected numbers")
    if column.null_count:
        raise DataError(f"data: column '{name}' in {path} has {column.null_count} null values")
    return numbers_as_numpy(column).astype(np.float64)


# Rows per batch of a column read from a file: a few MB of text at a time.
BATCH_ROWS = 65_536


def open_parquet(path: Path) -> pq.ParquetFile:
    """A Parquet file's footer, for reading one column at a time by row groups. Without
    pre-buffering: pyarrow's would hold the pages of every row group it reads ahead (a
    600 MB file's text column read to count its nulls peaked at 590 MB)."""
    return pq.ParquetFile(path, pre_buffer=False, buffer_size=1 << 20)


def record_batches(parquet: pq.ParquetFile, columns: list[str], path: Path,
                   field: str) -> Iterator[pa.RecordBatch]:
    """The `columns` of `parquet` (from `open_parquet`), batch by batch in file order, row
    group by row group: memory bounded by a row group, never the whole table. A page that
    cannot be read (damaged after a sound footer) is a DataError naming `field`."""
    try:
        yield from parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns)
    except (pa.ArrowException, OSError) as error:
        named = ", ".join(f"'{name}'" for name in columns)
        raise DataError(f"{field}: cannot read column {named} of {path} as parquet: "
                        f"{one_line(error)}") from error


def column_batches(parquet: pq.ParquetFile, name: str, path: Path,
                   field: str) -> Iterator[pa.Array]:
    """The column `name` of `parquet`, batch by batch (see record_batches)."""
    for batch in record_batches(parquet, [name], path, field):
        yield batch.column(0)


def file_labels(parquet: pq.ParquetFile, path: Path, config) -> np.ndarray:
    """The label column of a file (from `open_parquet`), read alone by row groups and
    checked whole, as `data.label_kind` says."""
    name = config.label_column
    column = pa.chunked_array(list(column_batches(parquet, name, path, "data.label_column")),
                              type=parquet.schema_arrow.field(name).type)
    return labels_of(column, path, config)


def text_labels(source: pa.Table | pq.ParquetFile, rows: int, path: Path, config) -> np.ndarray:
    """The label column of a text table or file (read alone, by row groups); without one
    (model.task causal_lm, whose targets are the texts' own next tokens) the placeholder
    class 0 for each of its rows."""
    name = config.label_column
    if name is None:
        return np.zeros(rows, np.int64)
    if isinstance(source, pa.Table):
        return labels_of(source.column(name), path, config)
    return file_labels(source, path, config)


def labels_of(column: pa.ChunkedArray, path: Path, config) -> np.ndarray:
    """The labels of `column`, read and checked as `data.label_kind` says (data/targets.py)."""
    return label_kind(config).read(column, path, config)


def _tensor_column(column: pa.ChunkedArray, path: Path, name: str) -> np.ndarray:
    """A list (or nested list) column of numbers, one equally-shaped tensor per row."""
    if column.null_count:
        raise DataError(f"data.tensor_column: '{name}' in {path} has null rows")
    problem = f"data.tensor_column: '{name}' in {path} must hold equally-shaped lists of numbers"
    kind = column.type
    if pa.types.is_fixed_size_list(kind) and (pa.types.is_integer(kind.value_type)
                                              or pa.types.is_floating(kind.value_type)):
        # From the buffers, not a Python list per row: a step's rows stream through here.
        values = pa.chunked_array([chunk.flatten() for chunk in column.chunks], kind.value_type)
        return numbers_as_numpy(values).astype(np.float64).reshape(len(column), kind.list_size)
    try:
        tensors = np.asarray(column.to_pylist(), dtype=np.float64)
    except (ValueError, TypeError) as error:
        raise DataError(f"{problem} ({error})") from error
    if tensors.ndim < 2:
        raise DataError(f"{problem}, got {column.type}")
    return tensors
