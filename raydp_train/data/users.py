"""Who wrote each training row (`data.user_column`, ARCHITECTURE.md §2.14): the column read
and checked like labels, its values mapped to user ids 0..N_users-1."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from raydp_train.data.columns import DataError, open_parquet


def read_users(path: Path, column: str, rows: int) -> np.ndarray:
    """[rows] int64 user ids of the file's rows; refused: a missing column, a null, one user."""
    parquet = open_parquet(path)
    if column not in parquet.schema_arrow.names:
        raise DataError(f"data.user_column: column '{column}' not in {path}; available: "
                        f"{', '.join(parquet.schema_arrow.names)}")
    values = parquet.read(columns=[column]).column(column)
    if len(values) != rows:
        raise DataError(f"data.user_column: {len(values)} values in {path} for {rows} rows")
    if values.null_count:
        raise DataError(f"data.user_column: '{column}' in {path} has {values.null_count} null "
                        "rows; every row needs the user who wrote it")
    _, user_of_row = np.unique(np.asarray(values.to_pylist(), dtype=object).astype(str),
                               return_inverse=True)
    if user_of_row.max(initial=0) == 0:
        raise DataError(f"data.user_column: '{column}' in {path} names one user only; "
                        "user-level privacy needs at least 2 (or set privacy.unit: example)")
    return user_of_row.astype(np.int64)


class UserRowsWarning(UserWarning):
    """Users with more rows than privacy.rows_per_user: a step uses only that many of them."""


def state_rows_per_user(user_of_row: np.ndarray, rows_per_user: int) -> None:
    """Say, to whoever runs the pipeline (not a release), when users exceed the cap."""
    line = rows_per_user_line(user_of_row, rows_per_user)
    if np.bincount(user_of_row).max() > rows_per_user:
        warnings.warn(UserRowsWarning(line), stacklevel=2)


def rows_per_user_line(user_of_row: np.ndarray, rows_per_user: int) -> str:
    """One line: users, rows per user, and how many users have more rows than the cap."""
    counts = np.bincount(user_of_row)
    over = int((counts > rows_per_user).sum())
    return (f"data.user_column: {counts.size} users, {int(counts.min())}-{int(counts.max())} "
            f"rows each; {over} have more than privacy.rows_per_user = {rows_per_user}, and "
            f"each step uses {rows_per_user} of their rows, drawn at random")
