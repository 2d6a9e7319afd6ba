"""The `training` section of a pipeline: batches, optimizer, parameter groups, schedule."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from raydp_train.config.base import Section
from raydp_train.config.errors import FieldProblem
from raydp_train.config.optimizers import optimizer_problem
from raydp_train.errors import UserError

# The largest learning rate or weight decay: beyond it an update overflows float32 (inf
# weights after the noisy gradient was already released).
MAX_RATE = 1e6


class TrainingSetupError(UserError, ValueError):
    """The training section does not fit the model or the run; the message names the field."""


class ParamGroup(Section):
    """Parameters (fnmatch patterns over the names `model.trainable` uses) trained with their
    own learning rate and weight decay; a parameter belongs to the first group that matches."""

    params: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    lr: float | None = Field(None, gt=0, le=MAX_RATE)  # null: training.lr
    weight_decay: float | None = Field(None, ge=0, le=MAX_RATE)  # null: training.weight_decay


class TrainingConfig(Section):
    epochs: int = Field(30, gt=0)
    batch_size: int = Field(64, gt=0)  # expected logical batch under Poisson sampling
    max_physical_batch: int = Field(256, gt=0)  # memory cap; does not change the privacy math
    # sgd, adam, adamw: this package's single-tensor loops (no torch optimizer import in the
    # workers); or any torch.optim class by name (AdamW, RAdam, ...: config/optimizers.py)
    optimizer: Annotated[str, Field(min_length=1)] = "sgd"
    lr: float = Field(0.1, gt=0, le=MAX_RATE)  # any trainable parameter no param_groups takes
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, le=MAX_RATE)
    # the optimizer's keyword arguments (foreach, fused, betas, eps, ...), not lr or weight decay
    optimizer_options: dict[str, Any] = Field(default_factory=dict)
    param_groups: list[ParamGroup] = Field(default_factory=list)
    # Hugging Face `get_scheduler` names; the multiplier of every group's lr, stepped once per
    # logical (DP) step. `constant` with a warmup is HF's constant_with_warmup.
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int | None = Field(None, ge=0)  # OR a fraction of the run's steps (rounded up)
    warmup_fraction: float | None = Field(None, ge=0, le=1)
    # an exponential moving average of the trained weights (optim/averaging.py), bias-corrected:
    # evaluation and the returned model use it; post-processing of the steps, no privacy cost
    ema_decay: float | None = Field(None, gt=0, lt=1)
    # hf models: compute the frozen layers below the first trained one once per example
    cache_frozen_prefix: bool = False
    # hf models: order each step's sample by text length before cutting it into micro-batches,
    # each cut to its longest text (the same clipped sum over fewer padding positions)
    trim_padding: bool = False
    workers: int = Field(1, ge=1)  # Ray Train workers, each clipping its own shard
    # where the workers go on a cluster: pack (Ray's default: fill a node first), spread (over
    # the nodes when it can), strict_spread (each on a different node, or the run waits)
    placement: Literal["pack", "spread", "strict_spread"] = "pack"
    use_gpu: bool = False  # one GPU per worker; model, step and noise on it
    # CPUs each worker asks Ray for; null: 1, or none with use_gpu (Ray Train's defaults)
    cpus_per_worker: float | None = Field(None, gt=0, le=1024)
    # with use_gpu: the GPU model each worker needs, as Ray names it ("A100", "H100", ...)
    accelerator_type: str | None = Field(None, min_length=1)
    # more Ray resources each worker asks for: the nodes' custom resources (`ray start
    # --resources`), e.g. {big_memory: 1}; CPUs and GPUs are workers' and use_gpu's
    worker_resources: dict[str, Annotated[float, Field(gt=0, allow_inf_nan=False)]] = Field(
        default_factory=dict)
    # torch threads in each worker; auto: the cores of the worker's machine divided among the
    # training processes on it (its workers, a sweep's concurrent trials)
    threads_per_worker: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    # bf16: forward and backward under autocast; norms, clipping, noise and update in fp32
    precision: Literal["fp32", "bf16"] = "fp32"
    # fsdp: torch FSDP2 shards the model over the workers (per transformer block), the clipped
    # sums and the noise alike (ARCHITECTURE.md §2.15); none: every worker holds the whole model
    sharding: Literal["none", "fsdp"] = "none"

    def warmup_for(self, total_steps: int) -> int:
        """warmup_steps as given, or ceil(warmup_fraction * steps) as Hugging Face's
        warmup_ratio."""
        if self.warmup_fraction is not None:
            return math.ceil(self.warmup_fraction * total_steps)
        warmup = self.warmup_steps or 0
        if warmup > total_steps:
            raise TrainingSetupError(f"training.warmup_steps: must be <= the run's {total_steps} "
                                     f"steps, got {warmup}")
        return warmup

    @model_validator(mode="after")
    def _known_optimizer(self) -> TrainingConfig:
        problem = optimizer_problem(self.optimizer, self.optimizer_options, self.momentum)
        if problem is not None:
            raise FieldProblem(problem[1], problem[0])
        return self

    @model_validator(mode="after")
    def _one_warmup(self) -> TrainingConfig:
        if self.warmup_steps is not None and self.warmup_fraction is not None:
            raise FieldProblem("set warmup_steps or warmup_fraction, not both", "warmup_steps")
        return self

    @model_validator(mode="after")
    def _average_unsharded(self) -> TrainingConfig:
        if self.ema_decay is not None and self.sharding == "fsdp":
            raise FieldProblem("a weight average is kept of whole weights, not of FSDP's "
                               "shards: unset ema_decay or set sharding: none", "ema_decay")
        return self

    @model_validator(mode="after")
    def _resources_named_once(self) -> TrainingConfig:
        if self.accelerator_type is not None and not self.use_gpu:
            raise FieldProblem("a GPU model is asked for GPUs: set use_gpu: true too",
                               "accelerator_type")
        named = sorted({"CPU", "GPU", "TPU", "memory", "object_store_memory"}
                       & set(self.worker_resources))
        if named or any(key.startswith("accelerator_type:") for key in self.worker_resources):
            raise FieldProblem(
                f"{', '.join(named) or 'accelerator_type:...'}: not a custom resource: a "
                "worker's CPU comes with workers, its GPU with use_gpu, a GPU model with "
                "accelerator_type", "worker_resources")
        return self

    def worker_bundle(self) -> dict[str, float]:
        """The Ray resources one worker asks for, as Ray Train asks them: a CPU (or
        cpus_per_worker), or a GPU with use_gpu (no CPU unless cpus_per_worker), the GPU
        model's marker, custom resources."""
        bundle = {"GPU": 1.0} if self.use_gpu else {"CPU": 1.0}
        if self.cpus_per_worker is not None:
            bundle["CPU"] = float(self.cpus_per_worker)
        if self.accelerator_type is not None:  # Ray's own marker of a node's GPU model
            bundle[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return {**bundle, **self.worker_resources}
