"""The pipeline YAML: its schema, defaults, validation and error messages (`--set` overrides:
config/overrides.py).

This is the only module that reads the raw config. Everything else receives a validated
`Pipeline`, so a field's default and its allowed range are written down exactly once, here
or in the section modules it assembles (`config/data.py`, `config/model.py`, `config/privacy.py`,
`config/training.py`, `config/budget.py`, `config/tune.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from raydp_train.config.base import SafeName, Section, Seed, WrittenPath
from raydp_train.config.budget import BudgetConfig
from raydp_train.config.cross_section import check_across_sections
from raydp_train.config.data import (
    DataConfig,
    DigitsData,
    ParquetData,
    SyntheticData,
    ValidationSplit,
)
from raydp_train.config.errors import FieldProblem, PipelineError, describe, show, yaml_problem
from raydp_train.config.model import (
    CnnModel,
    HFModel,
    LogisticModel,
    MlpModel,
    ModelConfig,
)
from raydp_train.config.overrides import apply_overrides
from raydp_train.config.paths import resolve_relative_paths
from raydp_train.config.privacy import LoraConfig, LsgConfig, PrivacyConfig
from raydp_train.config.training import ParamGroup, TrainingConfig
from raydp_train.config.tune import TuneConfig
from raydp_train.config.yaml_text import YamlLimitError, load_bounded

__all__ = [
    "BudgetConfig",
    "CnnModel",
    "DataConfig",
    "DigitsData",
    "HFModel",
    "LogisticModel",
    "LoraConfig",
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


# --- run, and the whole pipeline ---------------------------------------------------------------


class RunConfig(Section):
    seed: Seed | None = None  # None: noise seeded from os.urandom; an int: reproducible, not release
    # fast: torch's generator (not robust to floating-point attacks); secure: AES-CTR noise,
    # Holohan-Braghin sums (privacy/secure_noise.py), slower
    noise: Literal["fast", "secure"] = "fast"
    output_dir: WrittenPath = "runs"  # a run writes <output_dir>/<name>-<time>/
    max_failures: int = Field(0, ge=0)  # worker-group restarts from the last checkpoint
    # The newest k epochs' checkpoints (model + optimizer state) stay; older ones are deleted.
    keep_checkpoints: int = Field(2, ge=1)
    # The same `run` again after an interruption: continue the unfinished run (resume), or
    # stop and name the choice (refuse); `--new` always starts another (runs/reruns.py).
    on_interrupted: Literal["resume", "refuse"] = "resume"
    # Each epoch's metrics, epsilon by both accountants and the budget left, also to a CSV
    # file, TensorBoard events, an MLflow run (reports/trackers.py); a sweep logs each trial.
    loggers: list[Literal["csv", "tensorboard", "mlflow"]] = Field(default_factory=list)
    mlflow_tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else <output_dir>/mlruns

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

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: Sequence[str] = ()) -> Pipeline:
        """A pipeline YAML file, with `--set`-style overrides ("training.epochs=5")."""
        return load_pipeline(path, overrides)

    @classmethod
    def from_dict(cls, raw: dict, overrides: Sequence[str] = ()) -> Pipeline:
        return pipeline_from_dict(raw, overrides)

    @model_validator(mode="after")
    def _sections_agree(self) -> Pipeline:
        check_across_sections(self)
        return self


def load_pipeline(path: str | Path, overrides: Sequence[str] = ()) -> Pipeline:
    """Read, override and validate a pipeline YAML file. Its relative input paths resolve
    against its folder, those of `overrides` against the current directory (config/paths.py)."""
    source = str(path)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise PipelineError(source, ["file not found"]) from None
    except OSError as e:
        raise PipelineError(source, [f"cannot read file: {e.strerror or e}"]) from None
    try:
        raw = load_bounded(text)
    except yaml.YAMLError as e:
        raise PipelineError(source, [yaml_problem(e)]) from None
    except YamlLimitError as e:
        raise PipelineError(source, [str(e)]) from None
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


def dump_pipeline(p: Pipeline) -> str:
    """The resolved pipeline, every default filled in, as YAML in schema order."""
    return yaml.safe_dump(p.model_dump(mode="json"), sort_keys=False)
