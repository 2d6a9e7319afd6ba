"""The pipeline's `model` section: what is trained (a small built-in model, the user's own
torch code, or a Hugging Face model), and in which precision its frozen weights are kept.

Part of the pipeline schema (`config/pipeline.py` assembles the sections and loads the YAML).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from raydp_train.config.base import FunctionSpec, ReadPath, Section
from raydp_train.config.errors import FieldProblem

NumClasses = Annotated[int | None, Field(ge=2)]  # None: inferred from the labels
# Widths and channels: a million is far beyond any model trained here, and int64-safe.
Width = Annotated[int, Field(gt=0, le=1_000_000)]
PositiveInts = Annotated[list[Width], Field(min_length=1)]
LabelTexts = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=2)]


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


# Where the frozen weights are kept: fp32, or bf16/fp16 for half their memory; what trains
# stays in fp32 (models/frozen_precision.py).
FrozenDtype = Literal["fp32", "bf16", "fp16"]


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
    frozen_dtype: FrozenDtype = "fp32"
    # Text data's tokenizer (features [B, 2, max_length]: ids, mask): as hf's name_or_path.
    tokenizer: ReadPath | None = Field(None, min_length=1)


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
    frozen_dtype: FrozenDtype = "fp32"
    # cls: the model's own head ([CLS] through BERT's pooler); mean: masked mean of the last
    # hidden states into the final Linear. null: what the checkpoint was trained with (a
    # sentence-transformers 1_Pooling/config.json beside the weights), else cls.
    pooling: Literal["cls", "mean"] | None = None
    # L2-normalise the mean-pooled vector; null: as the checkpoint (a sentence-transformers
    # Normalize module in modules.json). Only with pooling mean.
    normalize: bool | None = None
    # zeros: the final Linear starts at 0; label_texts: at the pooled embeddings of
    # label_texts, one public text per label in label order (a zero-shot classifier).
    head_init: Literal["default", "zeros", "label_texts"] = "default"
    label_texts: LabelTexts | None = None
    # Every dropout probability of the model (its config's and its Dropout modules'); null:
    # the checkpoint's. 0 turns dropout off, as private fine-tuning often does.
    dropout: float | None = Field(None, ge=0, lt=1)

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
        self._label_texts_fit()
        return self

    def _label_texts_fit(self) -> None:
        if (self.head_init == "label_texts") != (self.label_texts is not None):
            raise FieldProblem("head_init: label_texts and label_texts go together: set both "
                               "or neither", "label_texts")
        if self.label_texts is None:
            return
        if self.num_labels is not None and len(self.label_texts) != self.num_labels:
            raise FieldProblem(f"{len(self.label_texts)} texts for num_labels: "
                               f"{self.num_labels}; give one per label, in label order",
                               "label_texts")
        if self.pooling == "cls":
            raise FieldProblem("compares the mean-pooled sentence vector with each text's: "
                               "only with pooling: mean", "head_init")
        if self.name_or_path is None or self.config is not None:
            raise FieldProblem("embeds the texts with a checkpoint's pretrained weights: set "
                               "name_or_path and leave config unset (a model built from "
                               "config is random)", "head_init")

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
