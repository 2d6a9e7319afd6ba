"""What a run learns, as one object the worker and the checks ask (ARCHITECTURE.md §2.12):
targets read from a label column, whose kind says what they are (data/targets.py: class ids,
real values, multi-hot sets), or a causal LM's next tokens. Each task gives the per-example
training loss, the held-out score as sums that add over ranks, the test metrics from those
sums, the baselines to beat and the validation count it releases. A new task is one class
here and its row in the schema's task table (config/model.py). The run's plan carries
its task (train/plan.py), so torch loads only when a task is used: `validate` plans without
it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raydp_train.config.model import is_causal_lm
from raydp_train.data.sources import Dataset
from raydp_train.data.targets import LabelKind, label_kind

if TYPE_CHECKING:
    from torch import nn


class Task:
    """The interface; see the module docstring."""

    def training_loss(self, model_config):
        """The per-example loss (outputs, labels) -> [B] the engine clips."""
        raise NotImplementedError

    def loss_and_score(self, pipeline, model: nn.Module, local: Dataset):
        """(per-example loss, cached prefix outputs or None, score(model, split) -> sums)."""
        raise NotImplementedError

    def baselines(self, local: Dataset, context) -> dict[str, float]:
        """What a test metric must beat, from every rank's test labels."""
        return {}

    def test_metrics(self, totals: list[float]) -> dict[str, float]:
        raise NotImplementedError

    def released_count(self, totals: list[float]) -> tuple[float, float]:
        """(count, rows) released with noise for the validation split; sensitivity 1."""
        raise NotImplementedError


@dataclass(frozen=True)
class LabelTask(Task):
    """Targets from the label column: everything the label kind decides."""

    kind: LabelKind

    def training_loss(self, model_config):
        from raydp_train.models.custom import training_loss

        return training_loss(model_config, self.kind)

    def loss_and_score(self, pipeline, model: nn.Module, local: Dataset):
        from raydp_train.train.evaluation import frozen_prefix_cache

        return frozen_prefix_cache(pipeline.training, pipeline.model, model, local, self.kind)

    def baselines(self, local: Dataset, context) -> dict[str, float]:
        from raydp_train.train.evaluation import test_baselines

        return test_baselines(local, self.kind, context)

    def test_metrics(self, totals: list[float]) -> dict[str, float]:
        return self.kind.metrics(totals, "test")

    def released_count(self, totals: list[float]) -> tuple[float, float]:
        return self.kind.released_count(totals)


@dataclass(frozen=True)
class NextTokens(Task):
    """A causal LM's targets, each text's next tokens (`model.task: causal_lm`): its score is
    (token loss sum, tokens); no baselines, and no validation release (the schema refuses one)."""

    def training_loss(self, model_config):
        from raydp_train.models.hf_causal import causal_lm_loss

        return causal_lm_loss(model_config.loss_reduction)

    def loss_and_score(self, pipeline, model: nn.Module, local: Dataset):
        from raydp_train.models.hf_causal import token_loss_sum

        splits = {"test": local.test_features, "validation": local.validation_features}
        return (self.training_loss(pipeline.model), None,
                lambda model, split: token_loss_sum(model, splits[split]))

    def test_metrics(self, totals: list[float]) -> dict[str, float]:
        """The held-out loss per token and its perplexity exp(loss)."""
        loss = totals[0] / max(totals[1], 1)
        return {"test_loss": loss, "test_perplexity": math.exp(min(loss, 700.0))}

    def released_count(self, totals: list[float]) -> tuple[float, float]:
        raise AssertionError("a causal LM releases no validation count (config refuses one)")


def task_of(pipeline) -> Task:
    """The pipeline's task: next tokens for a causal LM, else its labels' kind."""
    return NextTokens() if is_causal_lm(pipeline.model) else LabelTask(label_kind(pipeline.data))
