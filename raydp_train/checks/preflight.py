"""Every check that can fail on bad input, run BEFORE any budget is reserved or any noisy
gradient released (the checks themselves: checks/pipeline_checks.py). `validate` of a text model checks its
files, not its structure: building it means seconds of importing torch and transformers, which
`run` always spends and `validate --check-model` asks for. Then the model's checks start in a
forked process on the other core before this process imports what checking the data and the
plan needs, so the two halves import and run side by side, unless this model's checks passed
before (passed_checks); this module itself imports nothing heavy."""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Self

from raydp_train.config.pipeline import Pipeline

if TYPE_CHECKING:
    from raydp_train.data.sources import Dataset
    from raydp_train.train.plan import PrivacyPlan


def check_pipeline(pipeline: Pipeline, for_training: bool = True,
                   build_model: bool = True,
                   datasets: dict | None = None,
                   checked: Dataset | None = None) -> tuple[Dataset, PrivacyPlan]:
    """The data and the plan, once every check passed. `for_training=False` (validate) makes
    the same checks on names, shapes and types only: text is not tokenized (so Ray is not
    started) and a pretrained model is built on the meta device, its weights never read, or,
    with `build_model=False`, only its files are checked; a data error is still reported
    before a model error. `datasets`: a ray_dataset pipeline's Ray Datasets (run's);
    `checked`: the summary of Ray Datasets a sweep's driver checked (not read again)."""
    # Never fork a process that runs Ray's threads (a sweep's driver checks its candidates here).
    if not for_training and _is_text(pipeline) and not _ray_running():
        with _model_check(pipeline, build_model) as model_checked:
            from raydp_train.checks import pipeline_checks as checks

            checks.check_tokenizer(pipeline, for_training=False)
            dataset, plan = checks.check_data_and_plan(pipeline, for_training)
            pipeline.training.warmup_for(plan.steps)  # the model's process checks the rest
            model_checked.result()
        return dataset, plan
    from raydp_train.checks import pipeline_checks as checks

    if _is_text(pipeline):
        checks.check_tokenizer(pipeline)  # a bad name_or_path fails here, not inside Ray Data
    dataset, plan = checks.check_data_and_plan(pipeline, for_training, datasets, checked)
    model = checks.check_model(pipeline, dataset.feature_shape, dataset.num_classes, for_training)
    checks.check_schedule(model, pipeline, plan.steps)
    if _is_text(pipeline):  # validate's model check is a part of these: it may be skipped next
        from raydp_train.checks.passed import remember_pass

        remember_pass(pipeline)
    return dataset, plan


def check_before_ray(pipeline: Pipeline) -> None:
    """What fails in a moment, checked before Ray starts (its start takes seconds, and the
    other checks come after it): each file a file source names is there, and a torch model's
    factory and loss load as functions."""
    from pathlib import Path

    from raydp_train.errors import DataError

    data = pipeline.data
    validation = getattr(data, "validation", None)
    if data.source == "hf_dataset":  # a folder, or a name: data/hf_datasets.py checks it
        data = validation = None
    for field, value in (("data.path", getattr(data, "path", None)),
                         ("data.test_path", getattr(data, "test_path", None)),
                         ("data.validation.path", getattr(validation, "path", None))):
        if value is not None and "://" not in value and not Path(value).is_file():
            raise DataError(f"{field}: {data.source} file not found: {value}")
    for field in ("factory", "loss"):
        if getattr(pipeline.model, field, None) is not None:
            from raydp_train.models.custom import load_function

            load_function(getattr(pipeline.model, field), f"model.{field}")


def _is_text(pipeline: Pipeline) -> bool:
    """A pretrained text model with its tokenizer (models.tokenizer_source, without importing
    torch)."""
    model = pipeline.model
    return (model.kind == "hf" and model.name_or_path is not None
            and getattr(pipeline.data, "text_column", None) is not None)


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def structure_checked(pipeline: Pipeline, build_model: bool) -> bool:
    """Whether check_pipeline(for_training=False, build_model) checked the model's structure
    (after it passed): always, but for a text model that validate did not build and that did
    not pass before."""
    from raydp_train.checks.passed import passed_before

    return build_model or not _is_text(pipeline) or _ray_running() or passed_before(pipeline)


def _model_check(pipeline: Pipeline, build_model: bool) -> _forked | _passed | _files_only:
    from raydp_train.checks.passed import passed_before
    from raydp_train.models.hf_files import HFModelError

    try:
        if passed_before(pipeline):
            return _passed()
    except HFModelError:
        pass  # a model folder that is not one: check_tokenizer names it
    if not build_model:
        return _files_only(pipeline)
    return _forked(_check_text_model, pipeline)


def _check_text_model(pipeline: Pipeline) -> None:
    """In the forked child."""
    from raydp_train.checks.passed import remember_pass
    from raydp_train.checks.pipeline_checks import check_text_model

    check_text_model(pipeline)
    remember_pass(pipeline)


class _passed:
    """A model check that passed before for exactly these inputs."""

    def __enter__(self) -> Self:
        return self

    def result(self) -> None:
        pass

    def __exit__(self, *exc_info) -> None:
        pass


class _files_only:
    """The model's files, checked when the data's checks passed (their error comes first)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    def __enter__(self) -> Self:
        return self

    def result(self) -> None:
        from raydp_train.models.hf_files import check_model_files

        check_model_files(self._pipeline.model)

    def __exit__(self, *exc_info) -> None:
        pass


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
