"""Data sources: synthetic, sklearn digits and parquet, as train/test tensors.

Nothing here computes statistics of private data (no fitted scalers): a non-private mean or
std of the training set would leak outside the privacy accounting. Parquet features are used
as stored, or standardized with public statistics the pipeline gives (`data.normalize`);
digits pixels are scaled by their fixed range.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from raydp_train.data.columns import (
    DataError,
    column_batches,
    one_line,
    open_parquet,
    text_labels,
)
from raydp_train.data.numeric_files import read_numeric_file
from raydp_train.data.table_files import as_parquet, check_data_file, with_max_rows
from raydp_train.data.targets import label_kind
from raydp_train.data.users import read_users


@dataclass
class Dataset:
    """numpy arrays, read without torch (validate stays light); `to_torch` for training."""

    train_features: np.ndarray
    train_labels: np.ndarray
    test_features: np.ndarray
    test_labels: np.ndarray
    num_classes: int
    # Held out of training to select hyperparameters on (`data.validation`); may be empty.
    validation_features: np.ndarray | None = None
    validation_labels: np.ndarray | None = None
    # False: text read for checks only (validate, or splits each worker reads for itself):
    # its token arrays are zeros of the right shape, never trained on.
    features_read: bool = True
    # Who wrote each training row (data.user_column: ids 0..N_users-1), or None.
    train_users: np.ndarray | None = None
    # Who wrote each row of a PRIVATE validation file under privacy.unit user (its own ids):
    # its accuracy is then released per user (train/evaluation.py), else None.
    validation_users: np.ndarray | None = None

    @property
    def num_train(self) -> int:
        return self.train_labels.shape[0]

    @property
    def num_units(self) -> int:
        """What q counts: the training rows, or their users (privacy.unit: user)."""
        if self.train_users is None:
            return self.num_train
        return int(np.unique(self.train_users).size)

    @property
    def feature_shape(self) -> tuple[int, ...]:
        return tuple(self.train_features.shape[1:])

    def rows(self, rank: int, world_size: int) -> Dataset:
        """Every split's rows r with r mod world_size = rank: one worker's share
        (ARCHITECTURE.md §2.10); with users, the training (and private validation) rows of the
        users u with u mod world_size = rank, so that each user's rows live on one worker
        (§2.14)."""
        arrays = {name: None if value is None else value[rank::world_size]
                  for name, value in self._arrays().items()}
        if self.train_users is not None:
            mine = self.train_users % world_size == rank
            arrays.update({name: getattr(self, name)[mine]
                           for name in ("train_features", "train_labels", "train_users")})
        if self.validation_users is not None:
            mine = self.validation_users % world_size == rank
            arrays.update({name: getattr(self, name)[mine] for name in (
                "validation_features", "validation_labels", "validation_users")})
        return dataclasses.replace(self, **arrays)

    def _arrays(self) -> dict:
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if field.name not in ("num_classes", "features_read")}

    def to_torch(self) -> Dataset:
        """The same splits as torch tensors that share the arrays' memory (read-only arrays
        from Ray's object store too: training never writes to its data)."""
        import torch

        if not self.features_read:
            raise RuntimeError("this dataset's text was checked, not tokenized: not for training")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")
            tensors = {name: None if value is None else torch.as_tensor(value)
                       for name, value in self._arrays().items()}
        return dataclasses.replace(self, **tensors)


def load_data(config, num_classes: int | None = None, tokenizer: str | None = None,
              classes_field: str = "model.num_classes", tokenize: bool = True) -> Dataset:
    """Load `config` (a pipeline `data` section) and check the labels against `num_classes`
    (the field `classes_field` of the model section).

    Text columns are tokenized with the tokenizer at `tokenizer` (a folder or hub name), by Ray
    Data. `tokenize=False` (validate) checks the text files and labels without tokenizing, so
    without Ray: the token tensors are then zeros of the right shape, for checks, not training.
    """
    loaders = {"synthetic": _synthetic, "sklearn_digits": _digits, "parquet": _parquet}
    # csv / json: their Parquet copies; data.max_rows: a subset (data/table_files.py)
    config = with_max_rows(as_parquet(config))
    reader = _Reader(config, tokenizer, tokenize)
    features, labels, test_features, test_labels = loaders[config.source](config, reader)
    validation = _validation_file(config, reader)
    splits = [("training", labels), ("test", test_labels)]
    if validation is not None:
        splits.append(("validation", validation[1]))
    kind = label_kind(config)
    classes = kind.width(splits, num_classes, classes_field, config)
    dataset = Dataset(_features(features), labels.astype(kind.dtype),
                      _features(test_features), test_labels.astype(kind.dtype), classes,
                      features_read=tokenize or (reader.numeric and config.source != "parquet"))
    if validation is not None:
        dataset.validation_features = _features(validation[0])
        dataset.validation_labels = validation[1].astype(kind.dtype)
    elif config.validation is not None:
        _hold_out_validation(dataset, config.validation.fraction, config.random_state)
    if getattr(config, "user_column", None) is not None:
        dataset.train_users = read_users(Path(config.path), config.user_column, len(labels))
        if validation is not None and config.validation.private:  # released per user
            dataset.validation_users = read_users(Path(config.validation.path),
                                                  config.user_column, len(validation[1]))
    return dataset


def _features(values: np.ndarray) -> np.ndarray:
    """Token ids and masks stay integers (int32: half of int64's memory; the model reads
    them as int64); everything else is float32."""
    if np.issubdtype(values.dtype, np.integer) and values.ndim == 3 and values.shape[1] == 2:
        return values.astype(np.int32, copy=False)
    return values.astype(np.float32, copy=False)


def check_text_file(path: Path, text_column: str, label_column: str | None, field: str) -> int:
    """The number of rows, after checking the file and its columns; raises DataError."""
    check_data_file(path, "parquet", field)
    try:
        parquet = open_parquet(path)  # the footer, read once: schema and row count
        schema, rows = parquet.schema_arrow, parquet.metadata.num_rows
    except (pa.ArrowInvalid, OSError) as error:
        raise DataError(f"{field}: cannot read {path} as parquet: {one_line(error)}") from error
    missing = [c for c in (text_column, label_column)
               if c is not None and c not in schema.names]
    if missing:
        raise DataError(f"{field}: column(s) {missing} not in {path}; available: "
                        f"{', '.join(schema.names)}")
    kind = schema.field(text_column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"data.text_column: column '{text_column}' in {path} is {kind}, "
                        "expected strings")
    if rows == 0:
        raise DataError(f"{field}: {path} has no rows")
    # Batch by batch: the driver never holds a whole text column.
    nulls = sum(batch.null_count for batch in
                column_batches(parquet, text_column, path, "data.text_column"))
    if nulls:
        raise DataError(f"data.text_column: '{text_column}' in {path} has {nulls} null rows")
    return rows


class _Reader:
    """Reads one parquet file of the pipeline's layout: numeric, tensor or text features."""

    def __init__(self, config, tokenizer: str | None, tokenize: bool):
        self.config, self.tokenizer, self.tokenize = config, tokenizer, tokenize
        self.numeric = getattr(config, "text_column", None) is None

    def read(self, path: Path, field: str) -> tuple[np.ndarray, np.ndarray]:
        config = self.config
        if self.numeric:
            return read_numeric_file(path, config, field, keep_features=self.tokenize)
        from raydp_train.data.text import tokenize_parquet

        rows = check_text_file(path, config.text_column, config.label_column, field)
        if self.tokenizer is None:
            raise DataError("data.text_column: text needs a tokenizer: model.name_or_path of "
                            "model.kind hf, or model.tokenizer of model.kind torch")
        labels = text_labels(open_parquet(path), rows, path, config)
        if not self.tokenize:
            return _unread_tokens(len(labels), config.max_length), labels
        tokens = tokenize_parquet(path, config.text_column, self.tokenizer, config.max_length)
        return tokens, labels


def _unread_tokens(rows: int, max_length: int) -> np.ndarray:
    """Zeros in the shape of `rows` rows of token ids and masks, for checks: one row's memory,
    broadcast (read-only), where a full array would take 8 max_length bytes a row."""
    return np.broadcast_to(np.zeros((1, 2, max_length), np.int32), (rows, 2, max_length))


def _take(values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """values[rows]; unread tokens (one row broadcast: stride 0) stay one row broadcast."""
    if values.strides[0] == 0:
        return np.broadcast_to(values[:1], (len(rows), *values.shape[1:]))
    return values[rows]


def _validation_file(config, reader: _Reader):
    validation = config.validation
    if validation is None or validation.path is None:
        return None
    if config.source != "parquet":
        raise DataError("data.validation.path: only for file sources (parquet, csv, json); "
                        "use fraction")
    return reader.read(Path(validation.path), "data.validation.path")


def _hold_out_validation(dataset: Dataset, fraction: float, seed: int) -> None:
    """Move a fixed random `fraction` of the training rows into the validation split."""
    n = dataset.num_train
    count = round(fraction * n)
    if count == 0 or count == n:
        raise DataError(
            f"data.validation.fraction: {fraction} of {n} training rows leaves an empty split"
        )
    order = np.random.default_rng(seed).permutation(n)
    held, kept = order[:count], np.sort(order[count:])
    dataset.validation_features = _take(dataset.train_features, held)
    dataset.validation_labels = dataset.train_labels[held]
    dataset.train_features = _take(dataset.train_features, kept)
    dataset.train_labels = dataset.train_labels[kept]


def _split(features: np.ndarray, labels: np.ndarray, train_fraction: float, shuffle_seed=None):
    order = np.arange(len(labels))
    if shuffle_seed is not None:
        order = np.random.default_rng(shuffle_seed).permutation(len(labels))
    cut = round(train_fraction * len(labels))
    if cut == 0 or cut == len(labels):
        raise DataError(
            f"data.train_fraction: {train_fraction} of {len(labels)} rows leaves an empty split"
        )
    train, test = order[:cut], order[cut:]
    return _take(features, train), labels[train], _take(features, test), labels[test]


def _synthetic(config, reader):
    """The seed experiment's data: synthetic, so standardizing it leaks nothing private."""
    from sklearn.datasets import make_classification

    features, labels = make_classification(
        n_samples=config.n_samples,
        n_features=config.n_features,
        n_informative=config.n_informative,
        n_redundant=config.n_redundant,
        flip_y=config.flip_y,
        random_state=config.random_state,
    )
    features = (features - features.mean(0)) / features.std(0).clip(min=1e-12)
    return _split(features, labels, config.train_fraction)


def _digits(config, reader):
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).reshape(-1, 1, 8, 8)  # pixel range 0..16 is fixed
    return _split(images, digits.target, config.train_fraction, config.random_state)


def _parquet(config, reader: _Reader):
    features, labels = reader.read(Path(config.path), "data.path")
    if config.test_path is None:
        return _split(features, labels, config.train_fraction, config.random_state)
    test_features, test_labels = reader.read(Path(config.test_path), "data.test_path")
    if test_features.shape[1:] != features.shape[1:]:
        raise DataError(
            f"data.test_path: features of shape {test_features.shape[1:]} in {config.test_path} "
            f"do not match {features.shape[1:]} in {config.path}"
        )
    return features, labels, test_features, test_labels
