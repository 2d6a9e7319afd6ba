"""CSV and JSON data (`data.source: csv | json`), read by pyarrow's own readers.

Each file is read once and kept as a Parquet copy in the cache, keyed by its path, size and
modification time; the data section then reads those copies as `source: parquet` does, so the
columns, labels, normalization, tokenization and every check are the same code for all three.
A copy is made on each machine that reads the file (a worker on another node makes its own).
JSON is one object per line (JSON lines, what pandas' `to_json(orient="records", lines=True)`
writes) or one array of objects.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv
import pyarrow.json
import pyarrow.parquet as pq

from raydp_train.data.cache import cache_folder
from raydp_train.data.columns import DataError, one_line

CONVERTED = ("csv", "json")


def as_parquet(config):
    """`config` (a pipeline data section) with each csv or json file replaced by its Parquet
    copy and `source: parquet`; any other section unchanged."""
    if config.source not in CONVERTED:
        return config
    update = {"source": "parquet",
              "path": str(parquet_copy(Path(config.path), config.source, "data.path"))}
    if config.test_path is not None:
        update["test_path"] = str(parquet_copy(Path(config.test_path), config.source,
                                               "data.test_path"))
    validation = config.validation
    if validation is not None and validation.path is not None:
        copy = parquet_copy(Path(validation.path), config.source, "data.validation.path")
        update["validation"] = validation.model_copy(update={"path": str(copy)})
    return config.model_copy(update=update)


def with_max_rows(config):
    """`config` (a data section, its files Parquet) with `path` replaced by a subset of at
    most `max_rows` of its rows, drawn with `random_state` and kept in file order: a copy in
    the cache, keyed by the file, the count and the seed, so every reader on a machine reads
    the same rows. Unchanged without max_rows, or when the file is not more rows than that
    (or cannot be read: its reader then says why, naming the file)."""
    limit = getattr(config, "max_rows", None)
    if limit is None or config.path is None:
        return config
    path = Path(config.path)
    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError):
        return config
    if rows <= limit:
        return config
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{limit}|"
                         f"{config.random_state}".encode()).hexdigest()[:24]
    target = cache_folder("subsets") / key / path.name
    if not target.is_file():
        keep = np.random.default_rng(config.random_state).choice(rows, limit, replace=False)
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{os.getpid()}")
        _write_rows(pq.ParquetFile(path, pre_buffer=False), np.sort(keep), partial)
        os.replace(partial, target)  # whole or absent, even with two readers at once
    return config.model_copy(update={"path": str(target)})


def _write_rows(source: pq.ParquetFile, rows: np.ndarray, target: Path) -> None:
    """The rows `rows` (sorted) of `source` written to `target`, read a row group at a time:
    memory bounded by a row group, not the file."""
    with pq.ParquetWriter(target, source.schema_arrow) as writer:
        start = 0
        for group in range(source.num_row_groups):
            end = start + source.metadata.row_group(group).num_rows
            inside = rows[np.searchsorted(rows, start):np.searchsorted(rows, end)] - start
            if len(inside):
                writer.write_table(source.read_row_group(group).take(inside))
            start = end


def parquet_copy(path: Path, source: str, field: str) -> Path:
    """The Parquet copy of the csv or json file at `path` (made now, or found in the cache)."""
    check_data_file(path, source, field)
    status = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{status.st_size}|{status.st_mtime_ns}|{source}"
                         .encode()).hexdigest()[:24]
    target = cache_folder("tables") / key / f"{path.name}.parquet"
    if target.is_file():
        return target
    table = _read(path, source, field)
    if table.num_rows == 0:
        raise DataError(f"{field}: {path} has no rows")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    pq.write_table(table, partial)
    os.replace(partial, target)  # whole or absent, even with two readers at once
    return target


def _read(path: Path, source: str, field: str) -> pa.Table:
    try:
        if source == "csv":
            return pyarrow.csv.read_csv(path)
        if _first_character(path) == "[":
            rows = json.loads(path.read_text())
            if not all(isinstance(row, dict) for row in rows):
                raise ValueError("the array must hold one object per row")
            return pa.Table.from_pylist(rows)
        return pyarrow.json.read_json(path)
    except (pa.ArrowException, OSError, ValueError, TypeError) as error:
        raise DataError(f"{field}: cannot read {path} as {source}"
                        f"{' (JSON lines or one array of objects)' if source == 'json' else ''}"
                        f": {one_line(error)}") from error


def _first_character(path: Path) -> str:
    with path.open("rb") as file:
        return file.read(4096).lstrip()[:1].decode("ascii", errors="replace")


# What a path is when it is not a regular file, for the one line that refuses it.
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def check_data_file(path: Path, source: str, field: str) -> None:
    """`path` is a regular file (a FIFO or /dev/zero would be read forever), else DataError
    naming what it is."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise DataError(f"{field}: {source} file not found: {path}") from None
    except OSError as error:
        raise DataError(f"{field}: cannot read {path}: {error.strerror or error}") from None
    if not stat.S_ISREG(mode):
        what = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise DataError(f"{field}: {path} is {what}, not a {source} file")
