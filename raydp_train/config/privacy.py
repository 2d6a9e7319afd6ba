"""The `privacy` section: the mechanism (its choices are the registry's, privacy/mechanism.py),
clipping, noise or a target epsilon, delta, the accountant, each mechanism's own settings and
the engine's self-check."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, field_validator, model_validator

from raydp_train.config.base import Section, exactly_one
from raydp_train.config.errors import FieldProblem, show
from raydp_train.privacy.mechanism import MECHANISMS, mechanism_named


class LsgConfig(Section):
    """Low-rank and sparse gradients (ARCHITECTURE.md §2.4)."""

    rank: int = Field(8, ge=1)  # r: carriers L (n x r), R (r x m)
    sparsity: float = Field(0.0, ge=0, lt=1)  # p: fraction of rows / columns frozen
    layers: list[str] | None = Field(None, min_length=1)  # module-name patterns (fnmatch)
    train_other: Literal["dpsgd", "freeze"] = "dpsgd"  # biases, norms, heads, embeddings
    refresh_every: int = Field(1, ge=1)  # steps between new carriers and masks
    sparsity_start_epoch: int = Field(0, ge=0)  # sparsity applies after this epoch


class LoraConfig(Section):
    """DP-LoRA's adapters (ARCHITECTURE.md §2.9; Yu et al. 2022)."""

    rank: int = Field(8, ge=1)  # r: A (r x in), B (out x r)
    alpha: float = Field(16.0, gt=0)  # the update is (alpha / r) B A
    dropout: float = 0.0  # only 0: the adapter is folded into its layer's one matmul
    # Linear module-name patterns (fnmatch); default: trainable Linear layers with
    # min(in, out) > rank (not a 2-output head)
    layers: list[str] | None = Field(None, min_length=1)
    train_other: Literal["dpsgd", "freeze"] = "dpsgd"  # biases, norms, heads, embeddings

    @field_validator("dropout")
    @classmethod
    def _no_dropout(cls, value: float) -> float:
        if value != 0:
            raise FieldProblem(
                f"only 0, got {show(value)}: each adapter is folded into its layer's one "
                "matmul, y = x (W + (alpha / r) B A)^T + b, so the adapter has no input of its "
                "own to drop (the model's own dropout still applies: model.dropout)")
        return value


class AdaptiveClippingConfig(Section):
    """Private adaptive clipping (Andrew et al. 2021; privacy/adaptive_clipping.py): C, from
    privacy.clip_norm, follows a quantile of the per-example gradient norms."""

    target_quantile: float = Field(0.5, gt=0, lt=1)  # gamma: the fraction left unclipped
    learning_rate: float = Field(0.2, gt=0, le=10)  # eta: C <- C exp(-eta (b~ - gamma))
    # sigma_b: the noise std on each step's count of examples under C (default: the expected
    # batch size / 20); the gradient's multiplier rises so the step costs privacy.noise_multiplier
    count_noise: float | None = Field(None, gt=0, le=1e9)


class SelfCheckConfig(Section):
    """The engine against one backward pass per example, on the run's own model and data
    (privacy/self_check.py), before the first noisy gradient is released and then on a
    random fraction of steps."""

    enabled: bool = True
    examples: int = Field(2, ge=1)  # examples of the micro-batch checked
    step_fraction: float = Field(0.01, ge=0, le=1)  # later steps checked, at random


# The choices are the registry's names (privacy/mechanism.py; its module loads no torch).
MechanismName = Literal[tuple(MECHANISMS)]


class PrivacyConfig(Section):
    # none: the non-private reference (no clipping, no noise, epsilon infinite)
    mechanism: MechanismName = "dpsgd"
    # Bounded so that C, sigma C and their quotients stay normal float32 numbers: a C of 1e308
    # overflows the float32 step; a sigma of 1e-300 divides the accountant by zero.
    clip_norm: float = Field(1.0, ge=1e-6, le=1e6)
    noise_multiplier: float | None = Field(None, ge=1e-3, le=1e6)
    target_epsilon: float | None = Field(None, gt=0)  # noise_multiplier is then calibrated
    delta: float = Field(1e-5, gt=0, lt=1)
    accountant: Literal["rdp", "pld"] = "rdp"
    # A mechanism's own settings: the field named after it (defaults if omitted).
    lsg: LsgConfig | None = None
    lora: LoraConfig | None = None
    self_check: SelfCheckConfig = SelfCheckConfig()
    # A trained module with no rule of its own: its parameters' per-example gradients by
    # torch.func (per_example, exact, materialized for that module), or refused by name.
    other_layers: Literal["per_example", "refuse"] = "per_example"
    # flat: g_i min(1, C / ||g_i||); automatic: C g_i / (||g_i|| + stability) (Bu et al. 2023,
    # per-example normalization): every example contributes just under C, no C to tune;
    # adaptive: flat clipping at a C that follows a quantile of the norms (privacy.adaptive).
    clipping: Literal["flat", "automatic", "adaptive"] = "flat"
    stability: float = Field(0.01, gt=0, le=1e6)  # automatic clipping's gamma
    # What one clipped contribution is: an example (a row), or a user (data.user_column): all
    # of a sampled user's rows, at most rows_per_user of them, summed and clipped once.
    unit: Literal["example", "user"] = "example"
    rows_per_user: int | None = Field(None, ge=1)  # the cap, with unit user (required there)
    # With unit user, what each sampled user's ONE clipped vector is: the sum of its rows'
    # gradients, or their mean (each row weighs 1/k, k its rows in the step); sensitivity C.
    user_contribution: Literal["sum", "mean"] = "sum"
    adaptive: AdaptiveClippingConfig | None = None  # adaptive clipping's settings

    @field_validator("clipping", mode="before")
    @classmethod
    def _flat_was_fixed(cls, value):
        return "flat" if value == "fixed" else value  # its name in pipelines saved before

    @model_validator(mode="after")
    def _one_noise_spec(self) -> PrivacyConfig:
        if not self.private:
            if self.noise_multiplier is not None or self.target_epsilon is not None:
                raise FieldProblem(f"mechanism {self.mechanism} adds no noise: remove "
                                   "noise_multiplier and target_epsilon", "mechanism")
            return self
        exactly_one(self, "noise_multiplier", "target_epsilon", None)
        if self.adaptive is not None and self.clipping != "adaptive":
            raise FieldProblem("only allowed with clipping: adaptive", "adaptive")
        if self.clipping == "adaptive" and self.adaptive is None:
            self.adaptive = AdaptiveClippingConfig()
        for name, settings in mechanism_settings().items():
            if getattr(self, name) is not None and self.mechanism != name:
                raise FieldProblem(f"only allowed with mechanism: {name}", name)
            if self.mechanism == name and getattr(self, name) is None:
                setattr(self, name, settings())
        return self

    @property
    def private(self) -> bool:
        """False for the non-private reference: no clipping, no noise, no budget."""
        return mechanism_named(self.mechanism).private


def mechanism_settings() -> dict[str, type[Section]]:
    """Each registered mechanism's own settings section: the privacy field named after it."""
    fields = PrivacyConfig.model_fields
    return {name: next(arg for arg in get_args(fields[name].annotation) if arg is not type(None))
            for name in MECHANISMS if name in fields}
