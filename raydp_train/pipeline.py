"""The pipeline YAML: its schema, defaults, validation, overrides and error messages.

This is the only module that reads the raw config. Everything else receives a validated
`Pipeline`, so a field's default and its allowed range are written down exactly once, here.
"""

from __future__ import annotations

import copy
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

__all__ = [
    "CnnModel", "DataConfig", "DigitsData", "LogisticModel", "LsgConfig", "MlpModel", "ModelConfig",
    "ParquetData", "Pipeline", "PipelineError", "PrivacyConfig", "RunConfig", "SyntheticData",
    "TrainingConfig", "apply_overrides", "dump_pipeline", "load_pipeline", "pipeline_from_dict",
]


class PipelineError(ValueError):
    """A config that cannot be used; str() is a header naming `source`, then one line per problem."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        super().__init__(source, self.problems)

    def __str__(self) -> str:
        lines = [f"cannot load pipeline config {self.source}:"]
        return "\n".join(lines + [f"  {p}" for p in self.problems])

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses Ray process boundaries, so it must rebuild from plain args.
        return (type(self), (self.source, self.problems))


class _FieldProblem(ValueError):
    """Raised by cross-field checks so the message is reported at `section.field`, not `section`."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class _Section(BaseModel):
    # A typo in a key must fail loudly, not silently fall back to a default.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans(cls, raw: Any) -> Any:
        # Pydantic would quietly read `epochs: yes` as 1: only bool fields take booleans.
        for key, value in raw.items() if isinstance(raw, dict) else ():
            field = cls.model_fields.get(key)
            if isinstance(value, bool) and field is not None and field.annotation is not bool:
                raise _FieldProblem(f"must not be a boolean, got {_show(value)} "
                                    "(YAML reads yes/no/on/off as true/false)", key)
        return raw


def _exactly_one(section: BaseModel, a: str, b: str, field: str | None) -> None:
    n_set = sum(getattr(section, k) is not None for k in (a, b))
    if n_set != 1:
        got = "both" if n_set == 2 else "neither"
        raise _FieldProblem(f"set exactly one of {a} or {b} (got {got})", field)


# --- data -------------------------------------------------------------------------------------

TrainFraction = Annotated[float, Field(gt=0, lt=1)]


class SyntheticData(_Section):
    source: Literal["synthetic"]
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
            raise _FieldProblem(
                f"n_informative + n_redundant must be <= n_features, got "
                f"{self.n_informative} + {self.n_redundant} > {self.n_features}", "n_informative")
        return self


class DigitsData(_Section):
    source: Literal["sklearn_digits"]
    train_fraction: TrainFraction = 0.8
    random_state: int = 42


class ParquetData(_Section):
    source: Literal["parquet"]
    path: str = Field(min_length=1)
    test_path: str | None = None
    feature_columns: list[str] | None = Field(None, min_length=1)
    tensor_column: str | None = None
    label_column: str = "label"
    train_fraction: TrainFraction = 0.8  # used only when test_path is None
    random_state: int = 42

    @model_validator(mode="after")
    def _one_feature_source(self) -> ParquetData:
        _exactly_one(self, "feature_columns", "tensor_column", "feature_columns")
        return self


DataConfig = Annotated[SyntheticData | DigitsData | ParquetData, Field(discriminator="source")]

# --- model ------------------------------------------------------------------------------------

NumClasses = Annotated[int | None, Field(ge=2)]  # None: inferred from the labels
PositiveInts = Annotated[list[Annotated[int, Field(gt=0)]], Field(min_length=1)]


class LogisticModel(_Section):
    kind: Literal["logistic"]
    num_classes: NumClasses = None


class MlpModel(_Section):
    kind: Literal["mlp"]
    hidden_sizes: PositiveInts = [64]
    activation: Literal["relu", "tanh", "gelu"] = "relu"
    num_classes: NumClasses = None


class CnnModel(_Section):
    kind: Literal["cnn"]
    channels: PositiveInts = [16, 32]
    kernel_size: int = Field(3, ge=1)
    hidden_size: int = Field(64, gt=0)
    num_classes: NumClasses = None

    @field_validator("kernel_size")
    @classmethod
    def _odd_kernel(cls, value: int) -> int:
        # Odd kernels keep "same" padding symmetric.
        if value % 2 == 0:
            raise _FieldProblem(f"must be odd, got {value}")
        return value


ModelConfig = Annotated[LogisticModel | MlpModel | CnnModel, Field(discriminator="kind")]

# --- privacy, training, run -------------------------------------------------------------------


class LsgConfig(_Section):
    """Low-rank and sparse gradients (DESIGN §2.4)."""

    rank: int = Field(8, ge=1)  # r: carriers L (n x r), R (r x m)
    sparsity: float = Field(0.0, ge=0, lt=1)  # p: fraction of rows / columns frozen
    layers: list[str] | None = Field(None, min_length=1)  # module-name patterns (fnmatch)
    train_other: Literal["dpsgd", "freeze"] = "dpsgd"  # biases, norms, heads, embeddings
    refresh_every: int = Field(1, ge=1)  # steps between new carriers and masks
    sparsity_start_epoch: int = Field(0, ge=0)  # sparsity applies after this epoch


class PrivacyConfig(_Section):
    mechanism: Literal["dpsgd", "lsg"] = "dpsgd"
    clip_norm: float = Field(1.0, gt=0)
    noise_multiplier: float | None = Field(None, gt=0)
    target_epsilon: float | None = Field(None, gt=0)  # noise_multiplier is then calibrated
    delta: float = Field(1e-5, gt=0, lt=1)
    accountant: Literal["rdp", "pld"] = "rdp"
    lsg: LsgConfig | None = None  # used when mechanism is lsg (defaults if omitted)

    @model_validator(mode="after")
    def _one_noise_spec(self) -> PrivacyConfig:
        _exactly_one(self, "noise_multiplier", "target_epsilon", None)
        if self.mechanism == "lsg" and self.lsg is None:
            self.lsg = LsgConfig()
        if self.mechanism == "dpsgd" and self.lsg is not None:
            raise _FieldProblem("only allowed with mechanism: lsg", "lsg")
        return self


class TrainingConfig(_Section):
    epochs: int = Field(30, gt=0)
    batch_size: int = Field(64, gt=0)  # expected logical batch under Poisson sampling
    max_physical_batch: int = Field(256, gt=0)  # memory cap; does not change the privacy math
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = Field(0.1, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    workers: int = Field(1, ge=1)  # Ray Train workers, each clipping its own shard
    use_gpu: bool = False  # one GPU per worker; model, step and noise on it


class RunConfig(_Section):
    seed: int | None = None  # None: secure random noise; an int is for reproducing, not release
    output_dir: str = "runs"  # a run writes <output_dir>/<name>-<time>/
    max_failures: int = Field(0, ge=0)  # worker-group restarts from the last checkpoint


class Pipeline(_Section):
    name: str
    data: DataConfig
    model: ModelConfig
    privacy: PrivacyConfig
    training: TrainingConfig = TrainingConfig()
    run: RunConfig = RunConfig()
    # Future optional sections (`tune`, `budget`) go here, defaulting to None.

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        # The name becomes a directory and a Ray job name.
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", value):
            raise _FieldProblem(f"may contain only letters, digits, '_', '.' and '-', got {value!r}")
        return value


# --- loading ----------------------------------------------------------------------------------


def load_pipeline(path: str | Path, overrides: Sequence[str] = ()) -> Pipeline:
    """Read, override and validate a pipeline YAML file."""
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
        raise PipelineError(source, [_yaml_problem(e)]) from None
    return pipeline_from_dict(raw, overrides, source)


def pipeline_from_dict(raw: dict, overrides: Sequence[str] = (), source: str = "<dict>") -> Pipeline:
    """Validate an already-parsed config, after applying `--set` overrides."""
    if not isinstance(raw, dict):
        sections = ", ".join(Pipeline.model_fields)
        problem = f"top level must be a mapping with sections {sections}; got {_show(raw)}"
        raise PipelineError(source, [problem])
    raw = apply_overrides(raw, overrides, source=source)
    try:
        return Pipeline.model_validate(raw)
    except ValidationError as e:
        raise PipelineError(source, [_describe(err) for err in e.errors()]) from None


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
    parts = key.strip().split(".")
    if not eq or not all(parts):
        raise ValueError("expected KEY=VALUE with a dotted KEY, e.g. training.lr=0.01")
    try:
        value = yaml.safe_load(value_text)
    except yaml.YAMLError as e:
        raise ValueError(f"value is not valid YAML ({_yaml_problem(e)})") from None
    # PyYAML (YAML 1.1) reads `1e-5` as a string; on the command line it is always a number.
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value):
        value = float(value)
    node = raw
    for depth, part in enumerate(parts[:-1]):
        if node.get(part) is None:
            node[part] = {}
        elif not isinstance(node[part], dict):
            where = ".".join(parts[: depth + 1])
            raise ValueError(f"{where} is {_show(node[part])}, not a section with fields")
        node = node[part]
    node[parts[-1]] = value


def _yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    what = getattr(e, "problem", None) or str(e)
    if mark is None:
        return f"YAML syntax error: {what}"
    return f"YAML syntax error at line {mark.line + 1}, column {mark.column + 1}: {what}"


# --- turning pydantic errors into sentences ---------------------------------------------------

_MESSAGES = {  # pydantic error type -> message; {got} is the input, other names from ctx
    "missing": "required field missing",
    "greater_than": "must be > {gt}, got {got}",
    "greater_than_equal": "must be >= {ge}, got {got}",
    "less_than": "must be < {lt}, got {got}",
    "less_than_equal": "must be <= {le}, got {got}",
    "finite_number": "must be a finite number, got {got}",
    "int_parsing": "must be an integer, got {got}",
    "int_type": "must be an integer, got {got}",
    "int_from_float": "must be a whole number, got {got}",
    "float_parsing": "must be a number, got {got}",
    "float_type": "must be a number, got {got}",
    "string_type": "must be a string, got {got}",
    "list_type": "must be a list, got {got}",
    "model_type": "must be a mapping of fields, got {got}",
    "model_attributes_type": "must be a mapping of fields, got {got}",
    "too_short": "must not be empty",
    "string_too_short": "must not be empty",
}


def _describe(err: Any) -> str:
    """One `<field.path>: <message>` line for one pydantic error."""
    kind, loc, ctx = err["type"], err["loc"], err.get("ctx") or {}
    path, ann, tag_field = _walk(loc)
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        path = f"{path}.{tag_field}"
        tags = ", ".join(repr(_tag(m, tag_field)) for m in _models(ann))
        got = f", got {ctx['tag']!r}" if "tag" in ctx else ""
        message = f"must be one of {tags}{got}" if got else f"required; one of {tags}"
    elif kind == "literal_error":
        allowed = ", ".join(repr(a) for o in _options(ann) for a in typing.get_args(o))
        message = f"must be one of {allowed or ctx['expected']}, got {_show(err['input'])}"
    elif kind == "extra_forbidden" and len(owner := _models(_walk(loc[:-1])[1])) == 1:
        message = f"unknown field; allowed fields: {', '.join(owner[0].model_fields)}"
    elif kind == "value_error" and isinstance(ctx.get("error"), _FieldProblem):
        problem = ctx["error"]
        path = ".".join(p for p in (path, problem.field) if p)
        message = str(problem)
    elif kind in _MESSAGES:
        bounds = {k: _show(v) for k, v in ctx.items()}  # 0.0 -> "0", as the user wrote it
        message = _MESSAGES[kind].format(got=_show(err.get("input")), **bounds)
    else:
        message = err["msg"]
    return f"{path}: {message}" if path else message


def _walk(loc: Sequence[str | int]) -> tuple[str, Any, str | None]:
    """Follow `loc` through the schema: the dotted path people see, the annotation found there,
    and the discriminator name if that annotation is a tagged union."""
    path, ann, tag_field = "", Pipeline, None
    for item in loc:
        if isinstance(item, int):
            path += f"[{item}]"
            ann, tag_field = (typing.get_args(_options(ann)[0]) or (None,))[0], None
            continue
        members = _models(ann)
        if tag_field and len(members) > 1:
            # pydantic puts the chosen union member's tag into loc; resolve it, do not show it.
            ann = next((m for m in members if _tag(m, tag_field) == item), None)
            tag_field = None
            continue
        field = members[0].model_fields.get(item) if len(members) == 1 else None
        ann, tag_field = (field.annotation, field.discriminator) if field else (None, None)
        path = f"{path}.{item}" if path else str(item)
    return path, ann, tag_field


def _options(ann: Any) -> tuple[Any, ...]:
    """The alternatives an annotation allows, None left out: `A | B | None` -> (A, B)."""
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(ann) if a is not type(None))
    return (ann,)


def _models(ann: Any) -> list[type[BaseModel]]:
    return [m for m in _options(ann) if isinstance(m, type) and issubclass(m, BaseModel)]


def _tag(model: type[BaseModel], tag_field: str) -> str:
    return typing.get_args(model.model_fields[tag_field].annotation)[0]


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML: null, true, 1 (not 1.0), 1e-05, 'text'."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, str):
        try:
            float(value)
            return value
        except ValueError:
            pass
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
