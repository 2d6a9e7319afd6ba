"""Every check that can fail on bad input, run BEFORE any budget is reserved or any noisy
gradient released: the tokenizer loads, the data loads, the plan fits it, the model builds,
every trainable layer is supported (with LSG's settings when asked for), and the
optimizer's parameter groups, the schedule and the frozen-prefix cache fit the model and run."""

from __future__ import annotations

import torch

from raydp_train.data import Dataset, load_data
from raydp_train.hf_prefix import FrozenPrefix
from raydp_train.models import build_model, tokenizer_source
from raydp_train.pipeline import Pipeline
from raydp_train.plan import PlanError, PrivacyPlan, make_plan
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.lsg import LowRankSparseGradients
from raydp_train.train.optim import make_optimizer, make_schedule


def check_pipeline(pipeline: Pipeline, for_training: bool = True) -> tuple[Dataset, PrivacyPlan]:
    """The data and the plan, once every check passed. `for_training=False` (validate) makes
    the same checks on names, shapes and types only: text is not tokenized (so Ray is not
    started) and a pretrained model is built on the meta device, its weights never read."""
    tokenizer = tokenizer_source(pipeline.model)
    if tokenizer is not None and getattr(pipeline.data, "text_column", None) is not None:
        from raydp_train.hf import load_tokenizer

        load_tokenizer(pipeline.model)  # a bad name_or_path fails here, not inside Ray Data
    classes_field = "model.num_labels" if pipeline.model.kind == "hf" else "model.num_classes"
    dataset = load_data(pipeline.data, pipeline.model.num_classes, tokenizer, classes_field,
                        tokenize=for_training)
    # make_plan allows q = 1 (tests use it for an exact full-batch step); a pipeline may not.
    if pipeline.training.batch_size >= dataset.num_train:
        raise PlanError(
            f"training.batch_size: must be < the {dataset.num_train} training examples (q = "
            "batch_size / N must be < 1: at q = 1 every step takes every example, with no "
            f"amplification by sampling), got {pipeline.training.batch_size}")
    plan = make_plan(pipeline, dataset.num_train)
    model = build_model(pipeline.model, dataset.feature_shape, dataset.num_classes,
                        load_weights=for_training)
    rules = None
    if pipeline.privacy.mechanism == "lsg":
        rules = LowRankSparseGradients(model, pipeline.privacy.lsg, torch.Generator()).rules
    if pipeline.privacy.mechanism != "none":
        PerExampleClipper(model, pipeline.privacy.clip_norm, rules=rules).close()
    # These look at the parameters that train, so after LSG froze what it freezes.
    if pipeline.training.cache_frozen_prefix:
        FrozenPrefix(model)
    make_schedule(make_optimizer(model, pipeline.training), pipeline.training, plan.steps)
    return dataset, plan
