"""A numeric or tensor Parquet file (`data.feature_columns` or `data.tensor_column`) read and
checked: every row, as training will read it, or batch by batch within row groups where the
features are only checked (validate), so that memory does not grow with the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raydp_train.data.columns import (
    DataError,
    file_labels,
    numeric_features,
    numeric_rows,
    one_line,
    open_parquet,
    record_batches,
)
from raydp_train.data.table_files import check_data_file


def read_numeric_file(path: Path, config, field: str,
                  keep_features: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(features, labels) of a numeric or tensor file, every row checked. Without
    `keep_features` (validate, or a driver whose workers read their own shards) the
    features are checked batch by batch within row groups and kept as one row broadcast."""
    check_data_file(path, "parquet", field)
    columns = config.feature_columns or [config.tensor_column]
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as error:
        raise DataError(f"{field}: cannot read {path} as parquet: {one_line(error)}") from error
    missing = [c for c in [*columns, config.label_column] if c not in schema.names]
    if missing:
        raise DataError(
            f"{field}: column(s) {missing} not in {path}; available: {', '.join(schema.names)}"
        )
    if not keep_features:
        return _checked_by_batches(path, config, field, columns)
    try:
        table = pq.ParquetFile(path).read(columns=[*columns, config.label_column])
    except (pa.ArrowInvalid, OSError) as error:  # a damaged page after a sound footer
        raise DataError(f"{field}: cannot read {path} as parquet: {one_line(error)}") from error
    if table.num_rows == 0:
        raise DataError(f"{field}: {path} has no rows")
    features, labels = numeric_rows(table, config, path)
    check_finite(features, path, field)
    return features, labels


def _checked_by_batches(path: Path, config, field: str,
                        columns: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The labels, and the features checked as `read_numeric_file` checks them but a batch at a
    time, kept as zeros of their shape (one row broadcast)."""
    parquet = open_parquet(path)
    if parquet.metadata.num_rows == 0:
        raise DataError(f"{field}: {path} has no rows")
    labels = file_labels(parquet, path, config)
    rows, shape = 0, None
    for batch in record_batches(parquet, columns, path, field):
        features = numeric_features(pa.Table.from_batches([batch]), config, path)
        check_finite(features, path, field, first_row=rows)
        if shape is not None and features.shape[1:] != shape:
            raise DataError(f"data.tensor_column: '{config.tensor_column}' in {path} must hold "
                            f"equally-shaped lists of numbers, got {list(shape)} and "
                            f"{list(features.shape[1:])} (rows from {rows})")
        rows, shape = rows + len(features), features.shape[1:]
    return np.broadcast_to(np.zeros((1, *shape), np.float32), (rows, *shape)), labels


def check_finite(features: np.ndarray, path: Path, field: str, first_row: int = 0) -> None:
    """No NaN or inf, nothing beyond float32's range; rows counted from `first_row`."""
    flat = features.reshape(len(features), -1)
    for bad, what in ((~np.isfinite(flat), "NaN or inf features"),
                      (np.abs(flat) > np.finfo(np.float32).max,
                       "features beyond float32's range (they would train as inf)")):
        if bad.any():
            rows = np.unique(np.nonzero(bad)[0])[:10] + first_row
            raise DataError(f"{field}: {path} has {what} in rows {rows.tolist()}")
