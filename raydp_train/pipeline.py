"""The pipeline YAML: its schema, defaults, validation, overrides and error messages.

This is the only module that reads the raw config. Everything else receives a validated
`Pipeline`, so a field's default and its allowed range are written down exactly once, here.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from raydp_train.config_base import SafeName, Section, exactly_one
from raydp_train.config_errors import FieldProblem, PipelineError, describe, show, yaml_problem
from raydp_train.config_paths import resolve_relative_paths
from raydp_train.config_training import ParamGroup, TrainingConfig
from raydp_train.sweep_config import BudgetConfig, TuneConfig

__all__ = [
    "BudgetConfig",
    "CnnModel",
    "DataConfig",
    "DigitsData",
    "HFModel",
    "LogisticModel",
    "LsgConfig",
    "MlpModel",
    "ModelConfig",
    "ParamGroup",
    "ParquetData",
    "Pipeline",
    "PipelineError",
    "PrivacyConfig",
    "RunConfig",
    "SyntheticData",
    "TrainingConfig",
    "TuneConfig",
    "ValidationSplit",
    "apply_overrides",
    "dump_pipeline",
    "load_pipeline",
    "pipeline_from_dict",
]


# --- data -------------------------------------------------------------------------------------

TrainFraction = Annotated[float, Field(gt=0, lt=1)]


class ValidationSplit(Section):
    """Rows held out of the training set to select hyperparameters on (ARCHITECTURE.md §2.5)."""

    fraction: float | None = Field(None, gt=0, lt=1)  # of the training rows, not trained on
    path: str | None = Field(None, min_length=1)  # OR a file of its own (source parquet)
    private: bool = True  # false only if these rows may be published as they are
    # Gaussian noise (std, in examples) on the released count of correct predictions; each
    # release is charged to the privacy account. Required to select on private rows.
    noise_multiplier: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _one_source(self) -> ValidationSplit:
        exactly_one(self, "fraction", "path", "fraction")
        return self


class SyntheticData(Section):
    source: Literal["synthetic"]
    validation: ValidationSplit | None = None
    n_samples: int = Field(1000, ge=10)
    n_features: int = Field(20, gt=0)
    n_informative: int = Field(10, gt=0)
    n_redundant: int = Field(5, ge=0)
    flip_y: float = Field(0.05, ge=0, le=1)
    random_state: int = 42
    train_fraction: TrainFraction = 0.8

    @model_validator(mode="after")
    def _features_fit(self) -> SyntheticData:
        if self.n_informative + self.n_redundant > self.n_features:
            raise FieldProblem(
                f"n_informative + n_redundant must be <= n_features, got "
                f"{self.n_informative} + {self.n_redundant} > {self.n_features}", "n_informative")
        return self


class DigitsData(Section):
    source: Literal["sklearn_digits"]
    validation: ValidationSplit | None = None
    train_fraction: TrainFraction = 0.8
    random_state: int = 42


class ParquetData(Section):
    source: Literal["parquet"]
    validation: ValidationSplit | None = None
    path: str = Field(min_length=1)
    test_path: str | None = None
    feature_columns: list[str] | None = Field(None, min_length=1)
    # Public statistics per feature column, {column: [mean, std]}: x -> (x - mean) / std.
    # Never fitted on the private rows (that would be a release outside the accounting).
    normalize: dict[str, tuple[float, float]] | None = None
    tensor_column: str | None = None
    text_column: str | None = None  # strings, tokenized by the model's tokenizer (model.kind hf)
    max_length: int = Field(128, ge=2)  # tokens per text, padded or truncated
    label_column: str = "label"
    # Names of classes 0..K-1: a string label column is mapped by them, and they become the
    # saved model's id2label.
    label_names: list[str] | None = Field(None, min_length=2)
    train_fraction: TrainFraction = 0.8  # used only when test_path is None
    random_state: int = 42

    @model_validator(mode="after")
    def _one_feature_source(self) -> ParquetData:
        given = [k for k in ("feature_columns", "tensor_column", "text_column")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise FieldProblem("set exactly one of feature_columns, tensor_column or text_column "
                               f"(got {', '.join(given) or 'none'})", "feature_columns")
        for column, (_, std) in (self.normalize or {}).items():
            if column not in (self.feature_columns or []):
                raise FieldProblem(f"{column!r} is not one of data.feature_columns "
                                   f"({', '.join(self.feature_columns or []) or 'none'})",
                                   "normalize")
            if not std > 0:
                raise FieldProblem(f"{column}: the std must be > 0, got {std:g}", "normalize")
        return self


DataConfig = Annotated[SyntheticData | DigitsData | ParquetData, Field(discriminator="source")]

# --- model ------------------------------------------------------------------------------------

NumClasses = Annotated[int | None, Field(ge=2)]  # None: inferred from the labels
PositiveInts = Annotated[list[Annotated[int, Field(gt=0)]], Field(min_length=1)]


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
    kernel_size: int = Field(3, ge=1)
    hidden_size: int = Field(64, gt=0)
    num_classes: NumClasses = None

    @field_validator("kernel_size")
    @classmethod
    def _odd_kernel(cls, value: int) -> int:
        # Odd kernels keep "same" padding symmetric.
        if value % 2 == 0:
            raise FieldProblem(f"must be odd, got {value}")
        return value


class LastLayers(Section):
    last_k_layers: int = Field(ge=1)  # the classifier head plus the last k transformer blocks


class HFModel(Section):
    """A Hugging Face sequence classifier: pretrained (name_or_path) or random (config)."""

    kind: Literal["hf"]
    # A local folder, a hub name (offline with HF_HUB_OFFLINE=1) or package:<pkg>/<folder>;
    # also where the tokenizer of text data comes from.
    name_or_path: str | None = Field(None, min_length=1)
    config: dict[str, Any] | None = None  # AutoConfig.for_model(**config): random init
    task: Literal["sequence_classification"] = "sequence_classification"
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
        return self

    @property
    def num_classes(self) -> int | None:
        return self.num_labels


ModelConfig = Annotated[
    LogisticModel | MlpModel | CnnModel | HFModel, Field(discriminator="kind")
]

# --- privacy, training, run -------------------------------------------------------------------


class LsgConfig(Section):
    """Low-rank and sparse gradients (ARCHITECTURE.md §2.4)."""

    rank: int = Field(8, ge=1)  # r: carriers L (n x r), R (r x m)
    sparsity: float = Field(0.0, ge=0, lt=1)  # p: fraction of rows / columns frozen
    layers: list[str] | None = Field(None, min_length=1)  # module-name patterns (fnmatch)
    train_other: Literal["dpsgd", "freeze"] = "dpsgd"  # biases, norms, heads, embeddings
    refresh_every: int = Field(1, ge=1)  # steps between new carriers and masks
    sparsity_start_epoch: int = Field(0, ge=0)  # sparsity applies after this epoch


class LoraConfig(Section):
    """DP-LoRA's adapters (ARCHITECTURE.md §2.9; Yu et al. 2022), made by peft."""

    rank: int = Field(8, ge=1)  # r: A (r x in), B (out x r)
    alpha: float = Field(16.0, gt=0)  # the update is (alpha / r) B A
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapter's input
    # Linear module-name patterns (fnmatch); default: trainable Linear layers with
    # min(in, out) > rank (not a 2-output head)
    layers: list[str] | None = Field(None, min_length=1)
    train_other: Literal["dpsgd", "freeze"] = "dpsgd"  # biases, norms, heads, embeddings


# Each mechanism's own settings section, named after it (privacy/mechanism.py).
MECHANISM_SETTINGS = {"lsg": LsgConfig, "lora": LoraConfig}


class PrivacyConfig(Section):
    # none: the non-private reference (no clipping, no noise, epsilon infinite)
    mechanism: Literal["dpsgd", "lsg", "lora", "none"] = "dpsgd"
    clip_norm: float = Field(1.0, gt=0)
    noise_multiplier: float | None = Field(None, gt=0)
    target_epsilon: float | None = Field(None, gt=0)  # noise_multiplier is then calibrated
    delta: float = Field(1e-5, gt=0, lt=1)
    accountant: Literal["rdp", "pld"] = "rdp"
    lsg: LsgConfig | None = None  # used when mechanism is lsg (defaults if omitted)
    lora: LoraConfig | None = None  # used when mechanism is lora (defaults if omitted)

    @model_validator(mode="after")
    def _one_noise_spec(self) -> PrivacyConfig:
        if self.mechanism == "none":
            if self.noise_multiplier is not None or self.target_epsilon is not None:
                raise FieldProblem("mechanism none adds no noise: remove noise_multiplier and "
                                   "target_epsilon", "mechanism")
            return self
        exactly_one(self, "noise_multiplier", "target_epsilon", None)
        for name, settings in MECHANISM_SETTINGS.items():
            if getattr(self, name) is not None and self.mechanism != name:
                raise FieldProblem(f"only allowed with mechanism: {name}", name)
            if self.mechanism == name and getattr(self, name) is None:
                setattr(self, name, settings())
        return self


class RunConfig(Section):
    seed: int | None = None  # None: noise seeded from os.urandom; an int: reproducible, not release
    # fast: torch's generator (not robust to floating-point attacks); secure: AES-CTR noise,
    # Holohan-Braghin sums (privacy/secure_noise.py), slower
    noise: Literal["fast", "secure"] = "fast"
    output_dir: str = "runs"  # a run writes <output_dir>/<name>-<time>/
    max_failures: int = Field(0, ge=0)  # worker-group restarts from the last checkpoint

    @model_validator(mode="after")
    def _secure_is_unseeded(self) -> RunConfig:
        if self.noise == "secure" and self.seed is not None:
            raise FieldProblem("secure noise cannot be seeded: remove run.seed, or use "
                               "run.noise: fast for a reproducible run (not for release)", "noise")
        return self


class Pipeline(Section):
    name: SafeName
    data: DataConfig
    model: ModelConfig
    privacy: PrivacyConfig
    training: TrainingConfig = TrainingConfig()
    run: RunConfig = RunConfig()
    budget: BudgetConfig | None = None
    tune: TuneConfig | None = None

    @model_validator(mode="after")
    def _tune_fits(self) -> Pipeline:
        if self.privacy.mechanism == "none" and self.budget is not None:
            raise FieldProblem("a non-private run (privacy.mechanism: none) cannot spend from a "
                               "privacy budget", "budget")
        if self.tune is not None:
            _check_tune(self)
        return self


def _check_tune(p: Pipeline) -> None:
    """Cross-section rules of a sweep: one shared budget, and no selection on private data."""
    if p.budget is None:
        raise FieldProblem("a sweep spends from one global budget: add a budget section", "budget")
    space = p.tune.search_space
    if "privacy.noise_multiplier" in space and p.privacy.noise_multiplier is None:
        raise FieldProblem("searching privacy.noise_multiplier needs privacy.noise_multiplier "
                           "set, not target_epsilon", "tune.search_space")
    for name in MECHANISM_SETTINGS:
        if any(key.startswith(f"privacy.{name}.") for key in space) and (
                p.privacy.mechanism != name):
            raise FieldProblem(f"searching privacy.{name} fields needs privacy.mechanism: "
                               f"{name}", "tune.search_space")
    if p.tune.selection == "random_stopping" and p.budget.accountant != "rdp":
        raise FieldProblem("random_stopping is accounted with RDP only (Papernot & Steinke): "
                           "use budget.accountant: rdp", "tune.selection")
    validation = p.data.validation
    if validation is None:
        raise FieldProblem("tune.metric validation_accuracy needs data.validation "
                           "(fraction, private)", "tune.metric")
    if validation.private and validation.noise_multiplier is None:
        raise FieldProblem(
            "the sweep would select on private validation rows: declare them public with "
            "data.validation.private: false, or release the metric with noise by setting "
            "data.validation.noise_multiplier", "tune.metric")


# --- loading ----------------------------------------------------------------------------------


def load_pipeline(path: str | Path, overrides: Sequence[str] = ()) -> Pipeline:
    """Read, override and validate a pipeline YAML file. Its relative input paths resolve
    against its folder, those of `overrides` against the current directory (config_paths)."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise PipelineError(source, ["file not found"]) from None
    except OSError as e:
        raise PipelineError(source, [f"cannot read file: {e.strerror or e}"]) from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise PipelineError(source, [yaml_problem(e)]) from None
    if isinstance(raw, dict):
        resolve_relative_paths(raw, Path(path).absolute().parent)
    return pipeline_from_dict(raw, overrides, source)


def pipeline_from_dict(raw: dict, overrides: Sequence[str] = (), source: str = "<dict>") -> Pipeline:
    """Validate an already-parsed config, after applying `--set` overrides; input paths still
    relative (from the overrides, or a dict built in code) resolve against the current
    directory, so every message and record names the absolute path."""
    if not isinstance(raw, dict):
        sections = ", ".join(Pipeline.model_fields)
        problem = f"top level must be a mapping with sections {sections}; got {show(raw)}"
        raise PipelineError(source, [problem])
    raw = resolve_relative_paths(apply_overrides(raw, overrides, source=source), Path.cwd())
    try:
        return Pipeline.model_validate(raw)
    except ValidationError as e:
        raise PipelineError(source, [describe(err, Pipeline) for err in e.errors()]) from None


def apply_overrides(raw: dict, overrides: Sequence[str], *, source: str = "<overrides>") -> dict:
    """Return a deep copy of `raw` with each `a.b.c=value` set; values are parsed as YAML."""
    result = copy.deepcopy(raw)
    problems = []
    for text in overrides:
        try:
            _apply_one(result, text)
        except ValueError as e:
            problems.append(f"--set {text}: {e}")
    if problems:
        raise PipelineError(source, problems)
    return result


def dump_pipeline(p: Pipeline) -> str:
    """The resolved pipeline, every default filled in, as YAML in schema order."""
    return yaml.safe_dump(p.model_dump(mode="json"), sort_keys=False)


def _apply_one(raw: dict, text: str) -> None:
    key, eq, value_text = text.partition("=")
    steps = _key_path(key) if eq else None
    if not steps:
        raise ValueError("expected KEY=VALUE with a dotted KEY, e.g. training.lr=0.01 or "
                         "training.param_groups[0].lr=0.01")
    try:
        value = yaml.safe_load(value_text)
    except yaml.YAMLError as e:
        raise ValueError(f"value is not valid YAML ({yaml_problem(e)})") from None
    # PyYAML (YAML 1.1) reads `1e-5` as a string; on the command line it is always a number.
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value):
        value = float(value)
    node = raw
    for depth, step in enumerate(steps[:-1]):
        wants_list = isinstance(steps[depth + 1], int)
        if isinstance(step, str) and node.get(step) is None and not wants_list:
            node[step] = {}
        node = _child(node, step, _key_text(steps[: depth + 1]))
        kind = list if wants_list else dict
        if not isinstance(node, kind):
            what = "a list" if wants_list else "a section with fields"
            where = _key_text(steps[: depth + 1])
            raise ValueError(f"{where} is {show(node)}, not {what}")  # noqa: TRY004 (user input)
    if isinstance(steps[-1], int):
        _child(node, steps[-1], _key_text(steps))  # an existing entry: lists do not grow here
    node[steps[-1]] = value


def _key_path(key: str) -> list[str | int] | None:
    """`a.b[1].c` -> ["a", "b", 1, "c"]; None if malformed."""
    steps: list[str | int] = []
    for part in key.strip().split("."):
        match = re.fullmatch(r"([^\[\]]+)((?:\[\d+\])*)", part)
        if match is None:
            return None
        steps += [match[1], *(int(i) for i in re.findall(r"\d+", match[2]))]
    return steps


def _key_text(steps: list[str | int]) -> str:
    return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in steps).lstrip(".")


def _child(node, step: str | int, where: str):
    if isinstance(step, int) and step >= len(node):
        raise ValueError(f"{where}: no such entry (the list has {len(node)})")
    return node.get(step) if isinstance(step, str) else node[step]
