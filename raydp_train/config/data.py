"""The pipeline's `data` section: where the examples come from.

Part of the pipeline schema (`config/pipeline.py` assembles the sections and loads the YAML).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from raydp_train.config.base import ReadPath, Section, Seed
from raydp_train.config.errors import FieldProblem

TrainFraction = Annotated[float, Field(gt=0, lt=1)]


class ValidationSplit(Section):
    """Rows held out of the training set to select hyperparameters on (ARCHITECTURE.md §2.5)."""

    fraction: float | None = Field(None, gt=0, lt=1)  # of the training rows, not trained on
    # OR a file of its own (a file source); with source ray_dataset neither: the rows are
    # datasets["validation"]
    path: ReadPath | None = Field(None, min_length=1)
    private: bool = True  # false only if these rows may be published as they are
    # Gaussian noise (std, in examples) on the released count of correct predictions; each
    # release is charged to the privacy account. Required to select on private rows.
    noise_multiplier: float | None = Field(None, ge=1e-3, le=1e6)  # as privacy's

    @model_validator(mode="after")
    def _one_source(self) -> ValidationSplit:
        if self.fraction is not None and self.path is not None:
            raise FieldProblem("set exactly one of fraction or path (got both)", "fraction")
        return self


def _validation_rows_named(section) -> None:
    """A validation split says where its rows come from (a Ray Dataset's need not)."""
    validation = section.validation
    if validation is not None and validation.fraction is None and validation.path is None:
        raise FieldProblem("set exactly one of fraction or path (got neither)",
                           "validation.fraction")


class SyntheticData(Section):
    source: Literal["synthetic"]
    validation: ValidationSplit | None = None
    n_samples: int = Field(1000, ge=10, le=10_000_000)  # generated in each worker's memory
    n_features: int = Field(20, gt=0, le=100_000)
    n_informative: int = Field(10, ge=2)  # 2 classes of 2 clusters need 2 informative ones
    n_redundant: int = Field(5, ge=0)
    flip_y: float = Field(0.05, ge=0, le=1)
    random_state: Seed = 42
    train_fraction: TrainFraction = 0.8

    @model_validator(mode="after")
    def _features_fit(self) -> SyntheticData:
        _validation_rows_named(self)
        if self.n_informative + self.n_redundant > self.n_features:
            raise FieldProblem(
                f"n_informative + n_redundant must be <= n_features, got "
                f"{self.n_informative} + {self.n_redundant} > {self.n_features}", "n_informative")
        return self


class DigitsData(Section):
    source: Literal["sklearn_digits"]
    validation: ValidationSplit | None = None
    train_fraction: TrainFraction = 0.8
    random_state: Seed = 42

    @model_validator(mode="after")
    def _validation_rows(self) -> DigitsData:
        _validation_rows_named(self)
        return self


class ParquetData(Section):
    """Rows in files: Parquet, or CSV / JSON lines (read by pyarrow, kept as Parquet copies:
    data/table_files.py), with the same column options."""

    source: Literal["parquet", "csv", "json"]
    validation: ValidationSplit | None = None
    path: ReadPath = Field(min_length=1)
    test_path: ReadPath | None = None
    feature_columns: list[str] | None = Field(None, min_length=1)
    # Public statistics per feature column, {column: [mean, std]}: x -> (x - mean) / std.
    # Never fitted on the private rows (that would be a release outside the accounting).
    normalize: dict[str, tuple[float, float]] | None = None
    tensor_column: str | None = None
    text_column: str | None = None  # strings, tokenized by the model's tokenizer
    max_length: int = Field(128, ge=2)  # tokens per text, padded or truncated
    # Classes of a sequence classifier; null for model.task causal_lm, whose targets are each
    # text's own next tokens (the pipeline sets that when the field is left out).
    label_column: str | None = Field("label", min_length=1)
    # Names of classes 0..K-1: a string label column is mapped by them, and they become the
    # saved model's id2label.
    label_names: list[str] | None = Field(None, min_length=2)
    # What a label is (data/targets.py): a class id; real values to regress on (a number or an
    # equal-length list of numbers per row); or a multi-hot set of labels (a list of 0/1).
    label_kind: Literal["class", "real", "multi_hot"] = "class"
    train_fraction: TrainFraction = 0.8  # used only when test_path is None
    random_state: Seed = 42
    max_rows: int | None = Field(None, ge=2)  # of path's rows, a random_state-seeded subset
    # How each worker Poisson-samples its training rows (ARCHITECTURE.md §2.13): memory holds
    # its shard and draws a mask per step; streaming draws each row's steps of an epoch and
    # reads the rows step by step, for a training file larger than a worker's memory; auto
    # streams when a worker's share of the file (uncompressed) exceeds sampler_memory_mb.
    sampler: Literal["memory", "streaming", "auto"] = "auto"
    sampler_memory_mb: int = Field(2048, ge=1)
    # Who wrote each training row (any type; privacy.unit: user protects each of them whole).
    user_column: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_feature_source(self) -> ParquetData:
        if self.source not in ("ray_dataset", "hf_dataset"):
            _validation_rows_named(self)
        given = [k for k in ("feature_columns", "tensor_column", "text_column")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise FieldProblem("set exactly one of feature_columns, tensor_column or text_column "
                               f"(got {', '.join(given) or 'none'})", "feature_columns")
        if self.source == "csv" and self.tensor_column is not None:
            raise FieldProblem("a CSV cell holds no tensor: use source json or parquet",
                               "tensor_column")
        for column, (_, std) in (self.normalize or {}).items():
            if column not in (self.feature_columns or []):
                raise FieldProblem(f"{column!r} is not one of data.feature_columns "
                                   f"({', '.join(self.feature_columns or []) or 'none'})",
                                   "normalize")
            if not std > 0:
                raise FieldProblem(f"{column}: the std must be > 0, got {std:g}", "normalize")
        self._fits_label_kind()
        return self

    def _fits_label_kind(self) -> None:
        if self.label_kind == "class":
            return
        for field in ("text_column", "label_names"):
            if getattr(self, field) is not None:
                raise FieldProblem(f"not with label_kind {self.label_kind}: text and named "
                                   "labels are class ids", field)
        if self.label_kind == "real" and self.validation is not None:
            raise FieldProblem(
                "not with label_kind real yet: a squared error has no bound per example, so "
                "no noise makes its release private; hold rows out with test_path instead",
                "validation")


class RayDatasetData(ParquetData):
    """Rows handed over as Ray Datasets, `raydp_train.run(pipeline, datasets={"train": ds,
    "test": ds})` (data/ray_datasets.py), with Parquet's column options; no paths."""

    source: Literal["ray_dataset"]
    path: str | None = None
    test_path: str | None = None

    @model_validator(mode="after")
    def _no_paths(self) -> RayDatasetData:
        paths = {"path": self.path, "test_path": self.test_path,
                 "validation.path": self.validation and self.validation.path}
        for field, path in paths.items():
            if path is not None:
                raise FieldProblem("not read with source ray_dataset: the rows are the Ray "
                                   "Datasets passed to run(pipeline, datasets=...)", field)
        return self


def streaming_refusal(data, cache_frozen_prefix: bool = False,
                      one_worker_sweep: bool = False) -> tuple[str, str] | None:
    """(why, field) when `data.sampler: streaming` cannot serve this pipeline, else None."""
    if data.source != "parquet" or data.test_path is None:
        return (("streaming reads a training file of its own: use data.source parquet with a "
                "test_path, or data.sampler memory"), "data.sampler")
    if data.max_rows is not None:
        return "a subset is drawn in the driver's memory: remove it", "data.max_rows"
    if getattr(data, "user_column", None) is not None:
        return (("streaming draws rows, not users (privacy.unit user): use data.sampler "
                 "memory"), "data.sampler")
    if data.validation is not None and data.validation.path is None:
        return "cuts rows in memory: use data.validation.path", "data.validation.fraction"
    if cache_frozen_prefix:
        return (("the prefix cache holds every training row's outputs in memory: not with "
                "data.sampler streaming"), "training.cache_frozen_prefix")
    if one_worker_sweep:
        return (("a one-worker trial holds its rows in its own process: use training.workers "
                ">= 2 or data.sampler memory"), "data.sampler")
    return None


class HFDatasetData(ParquetData):
    """A Hugging Face `datasets` dataset (data/hf_datasets.py): a folder written by
    `save_to_disk`, or a name loaded from the local Hugging Face cache, offline; its splits
    by name, with Parquet's column options."""

    source: Literal["hf_dataset"]
    path: ReadPath | None = Field(None, min_length=1)  # a save_to_disk folder, OR:
    name: str | None = Field(None, min_length=1)  # a dataset in the local Hugging Face cache
    # with name: its configuration (load_dataset's second argument, the Hub's "subset")
    subset: str | None = Field(None, min_length=1)
    split: str = Field("train", min_length=1)  # the rows trained on
    test_split: str | None = Field("test", min_length=1)  # null: cut by train_fraction
    # the rows data.validation releases a metric of (or data.validation.fraction cuts them)
    validation_split: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _one_place(self) -> HFDatasetData:
        if (self.path is None) == (self.name is None):
            raise FieldProblem("set exactly one of path (a save_to_disk folder) or name (a "
                               "dataset in the local Hugging Face cache)", "path")
        if self.subset is not None and self.name is None:
            raise FieldProblem("only with data.name (a save_to_disk folder holds one "
                               "configuration)", "subset")
        for field in ("test_path", "max_rows"):
            if getattr(self, field) is not None:
                raise FieldProblem("not with source hf_dataset: its splits are named by split, "
                                   "test_split and validation_split", field)
        validation = self.validation
        if self.validation_split is not None and validation is None:
            raise FieldProblem("set data.validation (private, noise_multiplier) to say how its "
                               "metric is released", "validation_split")
        if validation is not None and validation.path is not None:
            raise FieldProblem("not with source hf_dataset: name the split in "
                               "data.validation_split", "validation.path")
        if validation is not None and (validation.fraction is None) == (
                self.validation_split is None):
            raise FieldProblem("set exactly one of data.validation.fraction or "
                               "data.validation_split", "validation.fraction")
        return self


DataConfig = Annotated[SyntheticData | DigitsData | ParquetData | RayDatasetData | HFDatasetData,
                       Field(discriminator="source")]
