"""What a label is (`data.label_kind`): a class id, real values to regress on, or a multi-hot
set of labels. Each kind reads and checks its column, sets the width of the model's output,
gives the default per-example loss, scores held-out rows as sums (which add up over batches
and ranks), and says what a test metric must beat. The data readers, the worker, the checks
and predictions ask the pipeline's kind; none of them compares its name.

torch is imported inside the methods that need it: validate reads labels without torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from raydp_train.data.arrow_numbers import numbers_as_numpy
from raydp_train.errors import DataError


class LabelKind:
    name: str
    dtype: type  # of the label arrays
    sums: int  # how many sums `score` gives

    def width(self, splits: list[tuple[str, np.ndarray]], given: int | None, field: str,
              config=None) -> int:
        """The model's output width for these labels (checked against `given`, the model's
        num_classes, when set)."""
        widths = {values.shape[1] for _, values in splits}
        if len(widths) > 1:
            raise DataError(f"data.label_column: the splits hold {sorted(widths)} values per "
                            "row; every split needs the same width")
        width = widths.pop()
        if given is not None and given != width:
            raise DataError(f"{field}: {given} outputs, but data.label_column holds {width} "
                            f"values per row (data.label_kind {self.name})")
        return width

    def label_array(self, width: int) -> tuple[type, tuple[int, ...]]:
        """(dtype, one row's shape) of these labels: what an empty shard's array is."""
        return self.dtype, (width,)


class ClassIds(LabelKind):
    """One class id in 0..K-1 per row (an integer, or a string named by data.label_names);
    cross-entropy on K logits; accuracy."""

    name, dtype, sums = "class", np.int64, 2

    def read(self, column: pa.ChunkedArray, path: Path, config) -> np.ndarray:
        name, names = config.label_column, config.label_names
        if names is not None and _is_string(column.type):
            index = {label: i for i, label in enumerate(names)}
            unknown = sorted(set(column.to_pylist()) - set(index))
            if unknown:
                raise DataError(f"data.label_names: labels {unknown[:5]} in column '{name}' "
                                f"of {path} are not among {names}")
            return np.array([index[label] for label in column.to_pylist()], dtype=np.int64)
        if not pa.types.is_integer(column.type):
            strings = " (or give data.label_names)" if _is_string(column.type) else ""
            raise DataError(f"data.label_column: column '{name}' in {path} is {column.type}, "
                            f"expected integers{strings}")
        if column.null_count:
            raise DataError(f"data: column '{name}' in {path} has {column.null_count} null "
                            "values")
        return numbers_as_numpy(column).astype(np.int64)

    def width(self, splits, given, field, config=None):
        """K: `data.label_names`' length or the model's field; read from the labels (1 + the
        largest) only for built-in data, whose classes are public. Every label must lie in
        0..K-1."""
        classes = _classes(getattr(config, "label_names", None), given, field, splits,
                           getattr(config, "source", None))
        for split, values in splits:
            if values.min() < 0 or values.max() >= classes:
                raise DataError(
                    f"data: {split} labels must lie in [0, {classes - 1}] for {classes} classes "
                    f"({field}), got values in [{values.min()}, {values.max()}]")
        return classes

    def label_array(self, width: int) -> tuple[type, tuple[int, ...]]:
        return self.dtype, ()

    def loss(self, outputs, labels):
        import torch

        return torch.nn.functional.cross_entropy(outputs, labels, reduction="none")

    def score(self, outputs, labels) -> list[float]:
        return [float((outputs.argmax(1) == labels).sum()), float(len(labels))]

    def metrics(self, sums: list[float], split: str) -> dict[str, float]:
        return {f"{split}_accuracy": sums[0] / max(sums[1], 1)}

    def released_count(self, sums: list[float]) -> tuple[float, float]:
        return sums[0], sums[1]  # correct predictions change by at most 1 per example

    def baseline_sums(self, labels, width: int):
        import torch

        return torch.bincount(labels, minlength=width).double()

    def baselines(self, sums: list[float]) -> dict[str, float]:
        counts = [int(count) for count in sums]
        return {"chance": 1 / len(counts),
                "test_majority_class": max(counts) / max(sum(counts), 1)}

    def predict(self, outputs):
        return outputs.argmax(-1)

    def example_labels(self, count: int, width: int, generator):
        import torch

        return torch.randint(max(width, 1), (count,), generator=generator)


class RealValues(LabelKind):
    """Real values per row (a number, or a fixed-length list of numbers); squared error."""

    name, dtype, sums = "real", np.float32, 2

    def read(self, column: pa.ChunkedArray, path: Path, config) -> np.ndarray:
        return _number_rows(column, path, config.label_column, "numbers")

    def loss(self, outputs, labels):
        return ((outputs - labels.to(outputs.dtype)) ** 2).mean(1)

    def score(self, outputs, labels) -> list[float]:
        return [float(((outputs - labels) ** 2).sum()), float(labels.numel())]

    def metrics(self, sums: list[float], split: str) -> dict[str, float]:
        return {f"{split}_mse": sums[0] / max(sums[1], 1)}

    def released_count(self, sums):
        raise NotImplementedError("a squared error is unbounded: config refuses validation")

    def baseline_sums(self, labels, width: int):
        import torch

        labels = labels.double()
        return torch.cat([labels.sum(0), (labels ** 2).sum(0),
                          torch.tensor([len(labels)], dtype=torch.float64)])

    def baselines(self, sums: list[float]) -> dict[str, float]:
        """The test mse of always predicting the test split's own mean (its variance)."""
        width = (len(sums) - 1) // 2
        rows = max(sums[-1], 1)
        variances = [sums[width + i] / rows - (sums[i] / rows) ** 2 for i in range(width)]
        return {"test_mean_prediction_mse": max(sum(variances) / width, 0.0)}

    def predict(self, outputs):
        return outputs

    def example_labels(self, count: int, width: int, generator):
        import torch

        return torch.randn(count, width, generator=generator)


class MultiHot(LabelKind):
    """A fixed-length list of 0/1 per row, one per label; binary cross-entropy on K logits.
    Accuracy is exact match (every label right): a count each example changes by at most 1,
    so validation can release it with noise; label accuracy is the share of labels right."""

    name, dtype, sums = "multi_hot", np.float32, 4

    def read(self, column: pa.ChunkedArray, path: Path, config) -> np.ndarray:
        name = config.label_column
        values = _number_rows(column, path, name, "0/1 lists")
        if values.ndim != 2 or not np.isin(values, (0, 1)).all():
            raise DataError(f"data.label_column: column '{name}' in {path} must hold lists "
                            "of 0/1, one per label (data.label_kind multi_hot)")
        return values

    def loss(self, outputs, labels):
        import torch

        return torch.nn.functional.binary_cross_entropy_with_logits(
            outputs, labels.to(outputs.dtype), reduction="none").mean(1)

    def score(self, outputs, labels) -> list[float]:
        right = (outputs > 0) == (labels > 0.5)
        return [float(right.all(1).sum()), float(len(labels)), float(right.sum()),
                float(labels.numel())]

    def metrics(self, sums: list[float], split: str) -> dict[str, float]:
        return {f"{split}_accuracy": sums[0] / max(sums[1], 1),
                f"{split}_label_accuracy": sums[2] / max(sums[3], 1)}

    def released_count(self, sums: list[float]) -> tuple[float, float]:
        return sums[0], sums[1]

    def baseline_sums(self, labels, width: int):
        import torch

        return torch.cat([labels.double().sum(0),
                          torch.tensor([len(labels)], dtype=torch.float64)])

    def baselines(self, sums: list[float]) -> dict[str, float]:
        """The test label accuracy of answering each label's majority in the test split."""
        rows = max(sums[-1], 1)
        shares = [max(p / rows, 1 - p / rows) for p in sums[:-1]]
        return {"test_majority_per_label": sum(shares) / len(shares)}

    def predict(self, outputs):
        return (outputs > 0).long()

    def example_labels(self, count: int, width: int, generator):
        import torch

        return torch.randint(2, (count, width), generator=generator).to(torch.get_default_dtype())


LABEL_KINDS: dict[str, LabelKind] = {kind.name: kind for kind in (ClassIds(), RealValues(),
                                                                   MultiHot())}


def label_kind(data_config) -> LabelKind:
    """The kind of `data_config`'s labels (class ids unless a file source says otherwise)."""
    return LABEL_KINDS[getattr(data_config, "label_kind", "class")]


def _number_rows(column: pa.ChunkedArray, path: Path, name: str, expected: str) -> np.ndarray:
    """[rows, width] float32 of a numeric column (width 1) or a column of equal-length lists
    of numbers; nulls, NaN and infinities refused."""
    problem = f"data.label_column: column '{name}' in {path}"
    if column.null_count:
        raise DataError(f"{problem} has {column.null_count} null values")
    kind = column.type
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        values = numbers_as_numpy(column).astype(np.float64).reshape(-1, 1)
    elif pa.types.is_boolean(kind):  # bits, not bytes: no buffer to read as numbers
        values = np.asarray(column.to_pylist(), dtype=np.float64).reshape(-1, 1)
    elif pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(
            kind):
        try:
            values = np.asarray(column.to_pylist(), dtype=np.float64)
        except (ValueError, TypeError) as error:
            raise DataError(f"{problem} must hold equal-length {expected} ({error})") from error
        if values.ndim != 2:
            raise DataError(f"{problem} must hold equal-length {expected}, got {kind}")
    else:
        raise DataError(f"{problem} is {kind}, expected {expected}")
    if not np.isfinite(values).all():
        raise DataError(f"{problem} has NaN or infinite values")
    return values.astype(np.float32)


def _is_string(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


# Built-in data whose classes are known before any row is read; a user's rows are private.
PUBLIC_SOURCES = ("synthetic", "sklearn_digits")


def _classes(names: list[str] | None, given: int | None, field: str, splits: list,
             source: str | None = None) -> int:
    if names is not None:
        if given is not None and given != len(names):
            raise DataError(f"{field}: {given} classes, but data.label_names names "
                            f"{len(names)}")
        return len(names)
    if given is not None:
        return given
    if source not in PUBLIC_SOURCES:
        raise DataError(
            f"{field}: not set, nor data.label_names: the number of classes would be read "
            "from the private labels (1 + the largest), and the model's shape would reveal "
            f"it, outside epsilon; set {field}, or name the classes in data.label_names")
    seen = np.concatenate([values for _, values in splits])
    return max(int(seen.max()) + 1, 2)
