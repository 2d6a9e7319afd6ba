"""Every check that can fail on bad input, run BEFORE any budget is reserved or any noisy
gradient released: the data loads, the plan fits it, the model builds and every trainable
layer is supported (with LSG's settings when asked for)."""

from __future__ import annotations

import torch

from raydp_train.data import Dataset, load_data
from raydp_train.models import build_model, tokenizer_source
from raydp_train.pipeline import Pipeline
from raydp_train.plan import PrivacyPlan, make_plan
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.lsg import LowRankSparseGradients


def check_pipeline(pipeline: Pipeline) -> tuple[Dataset, PrivacyPlan]:
    dataset = load_data(pipeline.data, pipeline.model.num_classes,
                        tokenizer_source(pipeline.model))
    plan = make_plan(pipeline, dataset.num_train)
    model = build_model(pipeline.model, dataset.feature_shape, dataset.num_classes)
    rules = None
    if pipeline.privacy.mechanism == "lsg":
        rules = LowRankSparseGradients(model, pipeline.privacy.lsg, torch.Generator()).rules
    if pipeline.privacy.mechanism != "none":
        PerExampleClipper(model, pipeline.privacy.clip_norm, rules=rules).close()
    return dataset, plan
