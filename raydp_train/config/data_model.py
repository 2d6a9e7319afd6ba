"""The pipeline's `data` and `model` sections: where the examples come from and what is trained.

Part of the pipeline schema (`config/pipeline.py` assembles the sections and loads the YAML).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from raydp_train.config.base import FunctionSpec, ReadPath, Section, Seed
from raydp_train.config.errors import FieldProblem

# --- data -------------------------------------------------------------------------------------

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
    text_column: str | None = None  # strings, tokenized by the model's tokenizer (model.kind hf)
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

    @model_validator(mode="after")
    def _one_feature_source(self) -> ParquetData:
        if self.source != "ray_dataset":
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


DataConfig = Annotated[SyntheticData | DigitsData | ParquetData | RayDatasetData,
                       Field(discriminator="source")]

# --- model ------------------------------------------------------------------------------------

NumClasses = Annotated[int | None, Field(ge=2)]  # None: inferred from the labels
# Widths and channels: a million is far beyond any model trained here, and int64-safe.
Width = Annotated[int, Field(gt=0, le=1_000_000)]
PositiveInts = Annotated[list[Width], Field(min_length=1)]


class LogisticModel(Section):
    kind: Literal["logistic"]
    num_classes: NumClasses = None


class MlpModel(Section):
    kind: Literal["mlp"]
    hidden_sizes: PositiveInts = Field(default_factory=lambda: [64])
    activation: Literal["relu", "tanh", "gelu"] = "relu"
    num_classes: NumClasses = None


class CnnModel(Section):
    kind: Literal["cnn"]
    channels: PositiveInts = Field(default_factory=lambda: [16, 32])
    kernel_size: int = Field(3, ge=1, le=99)
    hidden_size: Width = 64
    num_classes: NumClasses = None

    @field_validator("kernel_size")
    @classmethod
    def _odd_kernel(cls, value: int) -> int:
        # Odd kernels keep "same" padding symmetric.
        if value % 2 == 0:
            raise FieldProblem(f"must be odd, got {value}")
        return value


class TorchModel(Section):
    """A model from the user's own code: `factory` names a function returning an nn.Module,
    as "file.py:function" (beside the pipeline, or absolute) or "package.module:function"
    (installed, or on the path of every worker); it gets `kwargs`, and `feature_shape` and
    `num_classes` if it takes them."""

    kind: Literal["torch"]
    factory: FunctionSpec
    kwargs: dict[str, Any] = Field(default_factory=dict)
    # The per-example loss, "file.py:function" or "package.module:function": (outputs,
    # labels) -> [B] losses, one per example (null: cross-entropy on the logits).
    loss: FunctionSpec | None = None
    num_classes: NumClasses = None
    fix: bool = False  # BatchNorm -> GroupNorm, ... (privacy/fixes.py), one line each


class LastLayers(Section):
    last_k_layers: int = Field(ge=1)  # the classifier head plus the last k transformer blocks


# The tasks a Hugging Face model learns, and whether its rows carry labels (causal_lm: each
# text's next tokens are its targets). The one table that names them: the schema offers
# these, and train/tasks.py makes the task object from what a task is, never from its name.
TASK_HAS_LABELS = {"sequence_classification": True, "causal_lm": False}
TaskName = Literal[tuple(TASK_HAS_LABELS)]


class HFModel(Section):
    """A Hugging Face sequence classifier: pretrained (name_or_path) or random (config)."""

    kind: Literal["hf"]
    # A local folder, a hub name (offline with HF_HUB_OFFLINE=1) or package:<pkg>/<folder>;
    # also where the tokenizer of text data comes from.
    name_or_path: ReadPath | None = Field(None, min_length=1)
    config: dict[str, Any] | None = None  # AutoConfig.for_model(**config): random init
    task: TaskName = "sequence_classification"
    # causal_lm: an example's loss over its next-token cross-entropies at its real tokens,
    # summed or averaged (null: sum). Mean weighs every text alike, whatever its length.
    lm_loss: Literal["sum", "mean"] | None = None
    num_labels: NumClasses = None
    trainable: Literal["all"] | LastLayers | Annotated[list[str], Field(min_length=1)] = "all"
    # cls: the model's own head ([CLS] through BERT's pooler); mean: masked mean of the last
    # hidden states into the final Linear. null: what the checkpoint was trained with (a
    # sentence-transformers 1_Pooling/config.json beside the weights), else cls.
    pooling: Literal["cls", "mean"] | None = None
    # L2-normalise the mean-pooled vector; null: as the checkpoint (a sentence-transformers
    # Normalize module in modules.json). Only with pooling mean.
    normalize: bool | None = None
    head_init: Literal["default", "zeros"] = "default"  # zeros: the final Linear starts at 0

    @model_validator(mode="after")
    def _a_model_source(self) -> HFModel:
        if self.name_or_path is None and self.config is None:
            raise FieldProblem("set name_or_path (pretrained) or config (random init)",
                               "name_or_path")
        if self.config is not None and "model_type" not in self.config:
            raise FieldProblem("needs model_type, e.g. bert", "config")
        if self.normalize and self.pooling == "cls":
            raise FieldProblem("normalizes the mean-pooled vector: only with pooling: mean",
                               "normalize")
        self._fits_task()
        return self

    def _fits_task(self) -> None:
        """Classifier fields refused for causal_lm, and lm_loss for a classifier."""
        if TASK_HAS_LABELS[self.task]:
            if self.lm_loss is not None:
                raise FieldProblem("only with task: causal_lm", "lm_loss")
            return
        for name in ("num_labels", "pooling", "normalize"):
            if getattr(self, name) is not None:
                raise FieldProblem("a sequence classifier's field: not with task: causal_lm",
                                   name)
        if self.head_init != "default":
            raise FieldProblem("a sequence classifier's field: not with task: causal_lm",
                               "head_init")

    @property
    def num_classes(self) -> int | None:
        # A causal LM's rows carry no class: one placeholder label, 0, per row.
        return self.num_labels if TASK_HAS_LABELS[self.task] else 1

    @property
    def loss_reduction(self) -> str:
        return self.lm_loss or "sum"


def is_causal_lm(model_config) -> bool:
    """A model section of `model.task: causal_lm` (targets: each text's next tokens): the one
    predicate of the task outside the schema's fields; models without a task field have labels."""
    return not TASK_HAS_LABELS.get(getattr(model_config, "task", None), True)


ModelConfig = Annotated[
    LogisticModel | MlpModel | CnnModel | TorchModel | HFModel, Field(discriminator="kind")
]
