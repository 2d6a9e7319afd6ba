"""Every check that can fail on bad input, run BEFORE any budget is reserved or any noisy
gradient released: the tokenizer loads, the data loads, the plan fits it, the model builds,
every trainable layer is supported (with LSG's settings when asked for), and the
optimizer's parameter groups, the schedule and the frozen-prefix cache fit the model and run."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Self

import torch
from torch import nn

from raydp_train.config.pipeline import Pipeline
from raydp_train.data import Dataset, load_data
from raydp_train.hf_prefix import FrozenPrefix
from raydp_train.models import build_model, tokenizer_source
from raydp_train.plan import PlanError, PrivacyPlan, make_plan
from raydp_train.privacy.mechanism import make_mechanism
from raydp_train.train.optim import make_optimizer, make_schedule, warmup_steps


def check_pipeline(pipeline: Pipeline, for_training: bool = True) -> tuple[Dataset, PrivacyPlan]:
    """The data and the plan, once every check passed. `for_training=False` (validate) makes
    the same checks on names, shapes and types only: text is not tokenized (so Ray is not
    started) and a pretrained model is built on the meta device, its weights never read.
    There, a text model's checks (seconds of importing transformers) run in a forked process
    while this one checks the data and the plan; a data error is still reported first."""
    if not for_training and _is_text(pipeline):
        with _forked(_check_text_model, pipeline) as model_checked:
            dataset, plan = _check_data_and_plan(pipeline, for_training)
            warmup_steps(pipeline.training, plan.steps)
            model_checked.result()
        return dataset, plan
    if _is_text(pipeline):
        _check_tokenizer(pipeline)  # a bad name_or_path fails here, not inside Ray Data
    dataset, plan = _check_data_and_plan(pipeline, for_training)
    model = _check_model(pipeline, dataset.feature_shape, dataset.num_classes, for_training)
    make_schedule(make_optimizer(model, pipeline.training), pipeline.training, plan.steps)
    return dataset, plan


def _is_text(pipeline: Pipeline) -> bool:
    return (tokenizer_source(pipeline.model) is not None
            and getattr(pipeline.data, "text_column", None) is not None)


def _check_tokenizer(pipeline: Pipeline) -> None:
    from raydp_train.hf import load_tokenizer

    load_tokenizer(pipeline.model)


def _check_text_model(pipeline: Pipeline) -> None:
    """validate's checks of a text model, which need no data: token ids and masks of
    `max_length`, and a head of `num_labels` outputs (2 when the data will say; no check
    depends on the head's size)."""
    _check_tokenizer(pipeline)
    model = _check_model(pipeline, (2, pipeline.data.max_length),
                         pipeline.model.num_classes or 2, for_training=False)
    make_optimizer(model, pipeline.training)


def _check_data_and_plan(pipeline: Pipeline, for_training: bool) -> tuple[Dataset, PrivacyPlan]:
    classes_field = "model.num_labels" if pipeline.model.kind == "hf" else "model.num_classes"
    dataset = load_data(pipeline.data, pipeline.model.num_classes,
                        tokenizer_source(pipeline.model), classes_field, tokenize=for_training)
    # make_plan allows q = 1 (tests use it for an exact full-batch step); a pipeline may not.
    if pipeline.training.batch_size >= dataset.num_train:
        raise PlanError(
            f"training.batch_size: must be < the {dataset.num_train} training examples (q = "
            "batch_size / N must be < 1: at q = 1 every step takes every example, with no "
            f"amplification by sampling), got {pipeline.training.batch_size}")
    return dataset, make_plan(pipeline, dataset.num_train)


def _check_model(pipeline: Pipeline, feature_shape: tuple[int, ...], num_classes: int,
                 for_training: bool) -> nn.Module:
    """The model builds, the mechanism attaches to it (every trainable layer is supported,
    with LSG's settings when asked for) and the frozen-prefix cache fits it."""
    model = build_model(pipeline.model, feature_shape, num_classes, load_weights=for_training)
    make_mechanism(pipeline.privacy, torch.Generator()).attach(
        model, pipeline.privacy.clip_norm).close()
    # These look at the parameters that train, so after the mechanism froze what it freezes.
    if pipeline.training.cache_frozen_prefix:
        FrozenPrefix(model)
    return model


class _forked:
    """`function(*args)` in a forked child (running on another core); `result()` raises what
    it raised. Without fork (Windows), it runs in this process when `result()` is called."""

    def __init__(self, function: Callable, *args) -> None:
        self._call = (function, args)
        self._child = None
        if "fork" in multiprocessing.get_all_start_methods():
            context = multiprocessing.get_context("fork")
            self._outcome, sender = context.Pipe(duplex=False)
            self._child = context.Process(target=_report, args=(sender, function, args),
                                          daemon=True)
            self._child.start()
            sender.close()

    def __enter__(self) -> Self:
        return self

    def result(self) -> None:
        if self._child is None:
            function, args = self._call
            function(*args)
            return
        try:
            error = self._outcome.recv()
        except EOFError:
            error = None
        self._child.join()  # before reading its exit code: a dead child is reaped here
        if error is None and self._child.exitcode != 0:
            error = RuntimeError(f"the model check's process died (exit code "
                                 f"{self._child.exitcode}); rerun with --verbose")
        if error is not None:
            raise error

    def __exit__(self, *exc_info) -> None:
        if self._child is not None and self._child.is_alive():
            self._child.kill()  # the parent failed first: its error is the one reported
            self._child.join()


def _report(sender, function: Callable, args: tuple) -> None:
    try:
        function(*args)
        sender.send(None)
    except Exception as error:  # noqa: BLE001 - sent back whole, reported as the CLI would
        try:
            sender.send(error)
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its text
            sender.send(RuntimeError(f"{type(error).__name__}: {error}"))
