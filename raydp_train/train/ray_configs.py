"""Ray's own `ScalingConfig` and `RunConfig`, as Ray users write them, mapped onto a pipeline:

    rt.run(pipeline, scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 2}),
           run_config=RunConfig(storage_path="s3://bucket/runs",
                                failure_config=FailureConfig(max_failures=2)))

What the pipeline has a field for lands in that field (so the run record and a resumed run
see it); the rest (storage, callbacks, the workers' runtime env) is passed to Ray Train as
given. A field set in both places with different values, and what would cost privacy (a
checkpoint policy by score, which may delete the newest checkpoint: the state of the steps
already charged; restarts without end), are refused by name before anything is spent.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from raydp_train.config.pipeline import Pipeline, PipelineError

# Ray Train's placement strategies this package offers (training.placement).
PLACEMENTS = {"PACK": "pack", "SPREAD": "spread", "STRICT_SPREAD": "strict_spread"}
# Resources a worker's bundle names that are not custom resources (worker_resources).
NOT_CUSTOM = ("memory", "object_store_memory", "TPU")


@dataclass(frozen=True)
class RaySettings:
    """What a RunConfig gives beyond the pipeline's fields, for Ray Train as given."""

    storage_path: str | None = None  # None: the run directory's folder (run.output_dir)
    storage_filesystem: object = None  # a pyarrow.fs.FileSystem, or None: from the path
    callbacks: list = field(default_factory=list)
    worker_runtime_env: dict = field(default_factory=dict)
    failure_config: object = None  # the user's FailureConfig (max_failures: run.max_failures)


def with_ray_configs(pipeline: Pipeline, scaling_config=None, run_config=None,
                     source: str = "<pipeline>", sweep: bool = False):
    """(pipeline with the configs' fields, RaySettings); refused by name, in one line."""
    problems: list[str] = []
    training = _scaling_fields(pipeline, scaling_config, problems)
    run, settings = _run_fields(pipeline, run_config, problems, sweep)
    if problems:
        raise PipelineError(source, problems[:1])
    updated = pipeline.model_copy(update={
        "training": _section(pipeline.training, "training", training, source),
        "run": _section(pipeline.run, "run", run, source)})
    return updated, settings


def _section(section, name: str, values: dict, source: str):
    """`section` with `values` set, validated as the pipeline's own would be."""
    from pydantic import ValidationError

    from raydp_train.config.errors import describe

    if not values:
        return section
    try:
        return type(section).model_validate({**section.model_dump(exclude_unset=True),
                                             **values})
    except ValidationError as error:
        problem = describe(error.errors()[0], type(section))
        raise PipelineError(source, [f"{name}.{problem} (from the Ray config passed)"]) from None


def _given(config, default, names) -> dict:
    """The fields of a Ray config object that differ from its class's defaults."""
    return {name: getattr(config, name) for name in names
            if getattr(config, name) != getattr(default, name)}


def _merge(section, section_name: str, values: dict, config_name: str,
           problems: list[str]) -> dict:
    """`values` ({pipeline field: (config field, value)}) that do not contradict a field the
    pipeline sets itself."""
    merged = {}
    for name, (ray_name, value) in values.items():
        if name in section.model_fields_set and getattr(section, name) != value:
            problems.append(f"{config_name}.{ray_name}: {value!r}, but the pipeline sets "
                            f"{section_name}.{name}: {getattr(section, name)!r}; give it in "
                            "one place")
        merged[name] = value
    return merged


def _scaling_fields(pipeline: Pipeline, config, problems: list[str]) -> dict:
    if config is None:
        return {}
    from ray.train import ScalingConfig

    given = _given(config, ScalingConfig(), [f.name for f in dataclasses.fields(config)])
    for name in ("trainer_resources", "label_selector", "use_tpu", "topology"):
        if name in given:
            problems.append(f"scaling_config.{name}: not offered (workers ask for CPUs, a GPU, "
                            "a GPU model and custom resources); leave it out")
    values = {"workers": ("num_workers", given.get("num_workers")),
              "use_gpu": ("use_gpu", given.get("use_gpu")),
              "accelerator_type": ("accelerator_type", given.get("accelerator_type"))}
    if "placement_strategy" in given:
        strategy = given["placement_strategy"]
        if strategy not in PLACEMENTS:
            problems.append(f"scaling_config.placement_strategy: {strategy!r} is not offered; "
                            f"use one of {', '.join(PLACEMENTS)}")
        values["placement"] = ("placement_strategy", PLACEMENTS.get(strategy))
    values.update(_resources(given.get("resources_per_worker") or {},
                             config.use_gpu, problems))
    values = {name: pair for name, pair in values.items() if pair[1] is not None}
    return _merge(pipeline.training, "training", values, "scaling_config", problems)


def _resources(resources: dict, use_gpu: bool, problems: list[str]) -> dict:
    """resources_per_worker -> cpus_per_worker and worker_resources."""
    where = "scaling_config.resources_per_worker"
    values, custom = {}, {}
    for key, amount in resources.items():
        if key == "CPU":
            values["cpus_per_worker"] = (where, float(amount))
        elif key == "GPU":
            if not use_gpu or amount != 1:
                problems.append(f"{where}: GPU {amount:g}: a worker has one GPU, with "
                                "use_gpu=True; leave GPU out of resources_per_worker")
        elif key in NOT_CUSTOM or key.startswith("accelerator_type:"):
            problems.append(f"{where}: {key} is not offered per worker (a GPU model is "
                            "scaling_config.accelerator_type); leave it out")
        else:
            custom[key] = float(amount)
    if custom:
        values["worker_resources"] = (where, custom)
    return values


# The name Ray's RunConfig gives itself when none is given.
RAY_DEFAULT_NAME = re.compile(r"ray_train_run-\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}")


def _run_fields(pipeline: Pipeline, config, problems: list[str], sweep: bool):
    if config is None:
        return {}, RaySettings()
    from ray.train import CheckpointConfig, FailureConfig
    from ray.train.constants import DEFAULT_STORAGE_PATH

    if config.name and not RAY_DEFAULT_NAME.fullmatch(config.name):
        problems.append("run_config.name: a run is named by its run directory (<pipeline "
                        "name>-<time>); leave it out, and continue a run with resume=run_dir")
    checkpoints = config.checkpoint_config or CheckpointConfig()
    if checkpoints.checkpoint_score_attribute is not None:
        problems.append("run_config.checkpoint_config.checkpoint_score_attribute: keeping "
                        "checkpoints by score may delete the newest one, the state of steps "
                        "already charged; leave it out (the newest num_to_keep stay)")
    failures = config.failure_config or FailureConfig()
    if failures.max_failures < 0:
        problems.append("run_config.failure_config.max_failures: -1 restarts without end, and "
                        "each restart releases again the steps past the last checkpoint; give "
                        "a number")
    storage = None if config.storage_path == DEFAULT_STORAGE_PATH else config.storage_path
    passed = {"storage_path": storage, "storage_filesystem": config.storage_filesystem,
              "callbacks": config.callbacks, "worker_runtime_env": config.worker_runtime_env}
    if sweep:
        for name, value in passed.items():
            if value:
                problems.append(f"run_config.{name}: not for a sweep (each trial runs its own "
                                "Ray Train run under run.output_dir); leave it out")
    values = {"max_failures": ("failure_config.max_failures", failures.max_failures or None)}
    if checkpoints.num_to_keep is not None:
        values["keep_checkpoints"] = ("checkpoint_config.num_to_keep", checkpoints.num_to_keep)
    values = {name: pair for name, pair in values.items() if pair[1] is not None}
    run = _merge(pipeline.run, "run", values, "run_config", problems)
    settings = RaySettings(storage, config.storage_filesystem, list(config.callbacks or []),
                           dict(config.worker_runtime_env or {}), failures)
    return run, settings


STORAGE_FILE = "ray_storage.json"  # in the run directory: where Ray Train keeps its checkpoints


def record_storage(run_dir, settings: RaySettings) -> None:
    """Write where this run's checkpoints go when a RunConfig moved them out of the run
    directory, so that a resumed run finds them without being told again."""
    import json
    from pathlib import Path

    if settings.storage_path is not None:
        record = {"storage_path": settings.storage_path,
                  "own_filesystem": settings.storage_filesystem is not None}
        (Path(run_dir) / STORAGE_FILE).write_text(json.dumps(record))


def storage_of(run_dir, settings: RaySettings, source: str) -> RaySettings:
    """A resumed run's settings with its recorded storage_path (None: a new run); refused by
    name: another storage_path, or a filesystem of the user's own that is not given again."""
    import json
    from pathlib import Path

    if run_dir is None or not (Path(run_dir) / STORAGE_FILE).is_file():
        return settings
    record = json.loads((Path(run_dir) / STORAGE_FILE).read_text())
    recorded = record["storage_path"]
    if settings.storage_path not in (None, recorded):
        raise PipelineError(source, [(f"run_config.storage_path: {settings.storage_path}, "
                                      f"but the run resumed keeps its checkpoints in "
                                      f"{recorded}; give that one, or leave it out")])
    if record["own_filesystem"] and settings.storage_filesystem is None:
        raise PipelineError(source, [(f"run_config.storage_filesystem: the run resumed "
                                      f"keeps its checkpoints in {recorded} on a filesystem "
                                      "of your own; pass it again")])
    return dataclasses.replace(settings, storage_path=recorded)
