"""The checks preflight runs (checks/preflight.py says in which order and where), each of which can
fail on bad input: the tokenizer loads, the data loads, the plan fits it, the model builds,
the mechanism attaches to it (every trainable layer is supported), and the optimizer's
parameter groups, the schedule and the frozen-prefix cache fit the model. Importing this
module is light: the model checks import torch and transformers when they run, so that
validate's data and plan checks never wait for them."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from raydp_train.config.pipeline import Pipeline
from raydp_train.models.hf_files import check_tokenizer as check_tokenizer_files
from raydp_train.models.hf_files import load_tokenizer, tokenizer_source

if TYPE_CHECKING:
    from torch import nn

    from raydp_train.data.sources import Dataset
    from raydp_train.train.plan import PrivacyPlan


def check_tokenizer(pipeline: Pipeline, for_training: bool = True) -> None:
    """Training loads the tokenizer as its data workers will; validate reads its file."""
    if for_training:
        load_tokenizer(pipeline.model)
    else:
        check_tokenizer_files(pipeline.model)


def check_text_model(pipeline: Pipeline) -> None:
    """validate's checks of a text model, which need no data: token ids and masks of
    `max_length`, and a head of `num_labels` outputs (2 when the data will say; no check
    depends on the head's size; the tokenizer is checked apart)."""
    from raydp_train.optim.optimizer import make_optimizer

    model = check_model(pipeline, (2, pipeline.data.max_length),
                        pipeline.model.num_classes or 2, for_training=False)
    make_optimizer(model, pipeline.training)


def check_data_and_plan(pipeline: Pipeline, for_training: bool,
                        datasets: dict | None = None,
                        checked: Dataset | None = None) -> tuple[Dataset, PrivacyPlan]:
    """`datasets`: a ray_dataset pipeline's Ray Datasets, checked where they are; `checked`:
    their summary, checked before (a sweep's trial), taken as it is."""
    from raydp_train.train.plan import PlanError, make_plan

    dataset = checked if checked is not None else _data(pipeline, for_training, datasets)
    units, unit = dataset.num_units, pipeline.privacy.unit
    if dataset.train_users is not None:
        from raydp_train.data.users import state_rows_per_user

        state_rows_per_user(dataset.train_users, pipeline.privacy.rows_per_user)
    # make_plan allows q = 1 (tests use it for an exact full-batch step); a pipeline may not.
    if pipeline.training.batch_size >= units:
        raise PlanError(
            f"training.batch_size: must be < the {units} training {unit}s (q = "
            "batch_size / N must be < 1: at q = 1 every step takes every example, with no "
            f"amplification by sampling), got {pipeline.training.batch_size}")
    return dataset, make_plan(pipeline, units)


def _data(pipeline: Pipeline, for_training: bool, datasets: dict | None) -> Dataset:
    """The pipeline's data, read and checked (check_data_and_plan)."""
    from raydp_train.data.sources import load_data

    tokenize = for_training
    if for_training:
        from raydp_train.data.shards import file_splits

        tokenize = file_splits(pipeline.data) is None  # else each worker tokenizes its shard
    classes_field = "model.num_labels" if pipeline.model.kind == "hf" else "model.num_classes"
    if datasets is None and pipeline.data.source == "hf_dataset":  # validate: no Ray
        from raydp_train.data.hf_datasets import local_splits

        datasets = local_splits(pipeline.data)
    if datasets is not None:
        from raydp_train.data.ray_dataset_checks import checked_datasets

        return checked_datasets(datasets, pipeline.data, pipeline.model.num_classes,
                                tokenizer_source(pipeline.model), classes_field)
    return load_data(pipeline.data, pipeline.model.num_classes,
                     tokenizer_source(pipeline.model), classes_field, tokenize=tokenize)


def check_model(pipeline: Pipeline, feature_shape: tuple[int, ...], num_classes: int,
                for_training: bool) -> nn.Module:
    """The model builds, the mechanism attaches to it (every trainable layer is supported,
    with LSG's settings when asked for) and the frozen-prefix cache fits it."""
    import torch

    from raydp_train.models.builders import build_model
    from raydp_train.models.frozen_precision import keep_frozen_in
    from raydp_train.models.hf_prefix import FrozenPrefix
    from raydp_train.privacy.mechanism import make_mechanism

    # validate's model: on the meta device (shapes only), or randomly initialized for the
    # self-check, which computes; its weights are never read.
    weights = "pretrained" if for_training else (
        "random" if pipeline.privacy.self_check.enabled else "meta")
    model = build_model(pipeline.model, feature_shape, num_classes, weights, _say)
    engine = make_mechanism(pipeline.privacy, torch.Generator()).attach(
        model, pipeline.privacy.clip_norm)
    keep_frozen_in(model, getattr(pipeline.model, "frozen_dtype", "fp32"))
    try:
        check_loss(pipeline, model, feature_shape, num_classes)
        check_engine(pipeline, model, engine, feature_shape, num_classes)
    finally:
        engine.close()
    # These look at the parameters that train, so after the mechanism froze what it freezes.
    if pipeline.training.cache_frozen_prefix:
        FrozenPrefix(model)
    return model


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def check_loss(pipeline: Pipeline, model: nn.Module, feature_shape: tuple[int, ...],
               num_classes: int) -> None:
    """A torch model's own `model.loss` gives one loss per example (else refused by name)."""
    import torch

    from raydp_train.data.targets import label_kind
    from raydp_train.models.custom import training_loss

    if getattr(pipeline.model, "loss", None) is not None:
        generator = torch.Generator().manual_seed(0)
        features = random_features(pipeline, model, feature_shape, 2, generator)
        kind = label_kind(pipeline.data)
        with torch.no_grad():
            training_loss(pipeline.model, kind)(
                model, features, kind.example_labels(2, num_classes, generator))


PREFLIGHT_ROWS = 8  # rows of the preflight's random batch


def random_features(pipeline: Pipeline, model: nn.Module, feature_shape: tuple[int, ...],
                    count: int, generator):
    """`count` random rows of the model's input: token ids of its vocabulary and attention
    masks (some padding) for text, else standard normal numbers."""
    import torch

    if getattr(pipeline.data, "text_column", None) is None:
        return torch.randn(count, *feature_shape, generator=generator)
    if pipeline.model.kind == "hf":
        vocab = model.model.get_input_embeddings().num_embeddings  # the transformers model
    else:  # a torch model's `model.tokenizer`
        from raydp_train.data.text import vocabulary_size
        from raydp_train.models.hf_files import tokenizer_source

        vocab = vocabulary_size(tokenizer_source(pipeline.model))
    ids = torch.randint(vocab, (count, feature_shape[-1]), generator=generator)
    lengths = torch.randint(1, feature_shape[-1] + 1, (count, 1), generator=generator)
    mask = (torch.arange(feature_shape[-1]) < lengths).long()
    return torch.stack([ids * mask, mask], dim=1)


def check_engine(pipeline: Pipeline, model: nn.Module, engine, feature_shape: tuple[int, ...],
                 num_classes: int) -> None:
    """privacy.self_check on a random batch of the model's input shape, in training mode: the
    leave-one-out invariant against one backward pass per example, before any budget is
    reserved (privacy/self_check.py)."""
    import random

    import torch

    from raydp_train.data.targets import label_kind
    from raydp_train.privacy.clipping import PerExampleClipper
    from raydp_train.privacy.self_check import SelfCheckError, compare_with_per_example
    from raydp_train.privacy.user_clipping import rows_as_examples
    from raydp_train.train.step import AUTOCAST_DTYPES, in_precision
    from raydp_train.train.tasks import task_of

    settings = pipeline.privacy.self_check
    if not settings.enabled or not isinstance(engine, PerExampleClipper):
        return
    generator = torch.Generator().manual_seed(0)
    # A batch of a few rows: a model that mixes rows (from the third on, say) shows.
    count = max(settings.examples, PREFLIGHT_ROWS)
    features = random_features(pipeline, model, feature_shape, count, generator)
    kind = label_kind(pipeline.data)
    labels = kind.example_labels(count, num_classes, generator)
    loss = task_of(pipeline).training_loss(pipeline.model)
    precision = pipeline.training.precision
    training = model.training
    model.train()
    try:
        with rows_as_examples(engine):  # privacy.unit user: the rows are what is checked
            report = compare_with_per_example(engine, in_precision(loss, precision, "cpu"),
                                              (model, features, labels), settings.examples,
                                              AUTOCAST_DTYPES[precision], random.Random(0))
    finally:
        model.train(training)
    if not report.passed:
        raise SelfCheckError(report.message())


def check_schedule(model: nn.Module, pipeline: Pipeline, steps: int) -> None:
    """The optimizer's parameter groups fit the model, and the schedule the run's steps."""
    from raydp_train.optim.optimizer import make_optimizer, make_schedule

    make_schedule(make_optimizer(model, pipeline.training), pipeline.training, steps)
