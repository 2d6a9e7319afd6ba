"""The `tune` section of a pipeline: the sweep over the budget (its search space, search
algorithm, scheduler and selection rule)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from raydp_train.config.base import Section
from raydp_train.config.errors import FieldProblem, show

SEARCHABLE = (
    "privacy.noise_multiplier", "privacy.clip_norm", "privacy.lsg.rank", "privacy.lsg.sparsity",
    "privacy.lora.rank", "privacy.lora.alpha",
    "training.lr", "training.weight_decay", "training.warmup_steps", "training.warmup_fraction",
    "training.param_groups[i].lr", "training.param_groups[i].weight_decay",
    "training.batch_size", "training.epochs", "training.ema_decay",
)
# Whole-number fields: a trial must get one of the listed values, never a draw from a range.
WHOLE_NUMBERS = ("privacy.lsg.rank", "privacy.lora.rank", "training.warmup_steps",
                 "training.batch_size", "training.epochs")


def searchable(key: str) -> bool:
    """A listed field; `[i]` stands for any index of an entry the pipeline has."""
    return re.sub(r"\[\d+\]", "[i]", key) in SEARCHABLE


class SearchDimension(Section):
    """One searched field: exactly one of `choice` / `grid` (values) or `uniform` /
    `loguniform` ([low, high])."""

    choice: list[float] | None = Field(None, min_length=1)
    grid: list[float] | None = Field(None, min_length=1)
    uniform: tuple[float, float] | None = None
    loguniform: tuple[float, float] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> SearchDimension:
        kinds = [k for k in type(self).model_fields if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise FieldProblem(f"set exactly one of choice, grid, uniform, loguniform (got "
                               f"{', '.join(kinds) or 'none'})")
        # A uniform range may start at 0 where its field allows it (the field's own check
        # sees both ends); a log scale needs a positive low end.
        if self.uniform is not None and not self.uniform[0] < self.uniform[1]:
            raise FieldProblem(f"must be [low, high] with low < high, got {list(self.uniform)}",
                               "uniform")
        if self.loguniform is not None and not 0 < self.loguniform[0] < self.loguniform[1]:
            raise FieldProblem(f"must be [low, high] with 0 < low < high (a log scale), got "
                               f"{list(self.loguniform)}", "loguniform")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in type(self).model_fields if getattr(self, k) is not None)

    def values(self) -> list[float]:
        """The extreme values a trial can get: every listed value, or both range ends."""
        return list(getattr(self, self.kind))


class AshaConfig(Section):
    grace_period: int = Field(1, ge=1)  # epochs before a trial may be stopped
    reduction_factor: float = Field(2.0, gt=1)


class PbtConfig(Section):
    """Population based training: every `perturbation_interval` epochs, a trial in the bottom
    `quantile_fraction` continues from a top trial's checkpoint with mutated settings."""

    perturbation_interval: int = Field(1, ge=1)  # epochs
    quantile_fraction: float = Field(0.25, gt=0, le=0.5)
    # true: every trial waits at each interval for the others (paused, its resources freed):
    # trials that cannot all run at once still exploit each other
    synch: bool = False


# Fields that set what a trial spends (its sigma, q and steps): drawn once per trial, never
# mutated by pbt, so each trial's plan and the sweep's worst-trial bound stay as validated.
PLAN_FIELDS = ("privacy.noise_multiplier", "training.batch_size", "training.epochs")

# Tune's search algorithms by name; the adaptive ones choose each trial from earlier trials'
# released metrics, and need the `search` extra (sweeps/search.py).
SEARCHES = ("random", "grid", "optuna", "hyperopt", "bayesopt")
ADAPTIVE_SEARCHES = ("optuna", "hyperopt", "bayesopt")


class RandomStopping(Section):
    """Papernot & Steinke (2022): the number of trials is random, so selection costs little."""

    mean_trials: float = Field(ge=1)
    # 0 logarithmic, 1 geometric, other > 0 truncated negative binomial, "inf" Poisson
    shape: float | Literal["inf"] = 1.0

    @field_validator("shape")
    @classmethod
    def _non_negative(cls, value: float | str) -> float | str:
        if value != "inf" and value < 0:
            raise FieldProblem(f"must be >= 0 or 'inf', got {show(value)}")
        return value

    @property
    def shape_value(self) -> float:
        return float(self.shape)


class TuneConfig(Section):
    search_space: dict[str, SearchDimension] = Field(min_length=1)
    num_samples: int = Field(4, ge=1)  # trials (per grid point); random_stopping draws it
    max_concurrent_trials: int = Field(2, ge=1)
    # Wall-clock limit: running trials are stopped (their open epoch stays counted in full).
    time_budget_s: float | None = Field(None, gt=0)
    metric: Literal["validation_accuracy"] = "validation_accuracy"
    mode: Literal["max", "min"] = "max"
    search: Literal[SEARCHES] = "random"
    scheduler: Literal["fifo", "asha", "pbt"] = "fifo"
    asha: AshaConfig = AshaConfig()
    pbt: PbtConfig = PbtConfig()
    selection: Literal["composition", "random_stopping"] = "composition"
    random_stopping: RandomStopping | None = None

    @field_validator("search_space")
    @classmethod
    def _searchable(cls, space: dict) -> dict:
        for key in space:
            if not searchable(key):
                raise FieldProblem(f"cannot search {key!r}; searchable: {', '.join(SEARCHABLE)}")
        return space

    @model_validator(mode="after")
    def _whole_numbers_listed(self) -> TuneConfig:
        for key, dimension in self.search_space.items():
            if key not in WHOLE_NUMBERS:
                continue
            if dimension.kind in ("uniform", "loguniform"):
                raise FieldProblem(f"{key} is a whole number: list its values with choice or "
                                   f"grid, not {dimension.kind}", f"search_space.{key}")
            fractional = [v for v in dimension.values() if v != int(v)]
            if fractional:
                raise FieldProblem(f"{key} is a whole number, got {fractional}",
                                   f"search_space.{key}.{dimension.kind}")
        return self

    @model_validator(mode="after")
    def _search_fits_space(self) -> TuneConfig:
        """What each search algorithm can draw from: grid crosses listed values only, the
        adaptive ones model distributions (no grid), bayesopt linear ranges only."""
        for key, dimension in self.search_space.items():
            where = f"search_space.{key}"
            if self.search == "grid" and dimension.kind != "grid":
                raise FieldProblem(f"search: grid crosses listed values: give {key} grid values, "
                                   f"not {dimension.kind} (or use search: random)", where)
            if self.search in ADAPTIVE_SEARCHES and dimension.kind == "grid":
                raise FieldProblem(f"search: {self.search} draws from distributions, not a grid: "
                                   "use choice for listed values", where)
            if self.search == "bayesopt" and dimension.kind != "uniform":
                raise FieldProblem(f"search: bayesopt models continuous ranges on a linear scale: "
                                   f"use uniform, not {dimension.kind} (or search: optuna or "
                                   "hyperopt)", where)
        if self.scheduler == "pbt" and self.search in ADAPTIVE_SEARCHES:
            raise FieldProblem(f"scheduler: pbt explores by mutating running trials; it does not "
                               f"take search: {self.search}: use search: random or grid",
                               "scheduler")
        if self.scheduler == "pbt" and not set(self.search_space) - set(PLAN_FIELDS):
            raise FieldProblem(f"scheduler: pbt mutates searched fields other than "
                               f"{', '.join(PLAN_FIELDS)} (they set what a trial spends): "
                               "search one, such as training.lr", "scheduler")
        return self

    @model_validator(mode="after")
    def _random_stopping_rules(self) -> TuneConfig:
        if self.selection != "random_stopping":
            if self.random_stopping is not None:
                raise FieldProblem("only allowed with selection: random_stopping",
                                   "random_stopping")
            return self
        if self.random_stopping is None:
            raise FieldProblem("required with selection: random_stopping (mean_trials, shape)",
                               "random_stopping")
        if self.search != "random":
            raise FieldProblem(
                f"random_stopping's guarantee (Papernot & Steinke) covers trials drawn "
                f"independently at random; search: {self.search} "
                + ("crosses a fixed grid" if self.search == "grid" else
                   "chooses each trial from earlier trials' results (adaptive choices are not "
                   "covered)") + ": use search: random, or selection: composition", "search")
        if self.scheduler != "fifo":
            raise FieldProblem(f"random_stopping needs independent trials: use scheduler: fifo "
                               f"({self.scheduler} stops or changes trials by comparing them)",
                               "scheduler")
        for key, dimension in self.search_space.items():
            if dimension.grid is not None:
                raise FieldProblem("random_stopping draws every trial at random: use choice, "
                                   "uniform or loguniform, not grid", f"search_space.{key}")
        return self


