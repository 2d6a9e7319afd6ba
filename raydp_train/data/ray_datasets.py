"""Ray Datasets handed to the Python API (`data.source: ray_dataset`):

    rt.run(pipeline, datasets={"train": train_ds, "test": test_ds})

`run` keeps the rows in Ray (ARCHITECTURE.md §2.10): they are checked by Ray Data tasks
(data/ray_dataset_checks.py), counted on the cluster (the plan's N), and reach the workers
through Ray Train's `datasets=` and `get_dataset_shard`, each worker reading its own shard;
nothing is written under `run.output_dir`. Without "test", a test split is cut from the train
rows (data.train_fraction, seeded by data.random_state), as `data.validation.fraction` cuts
a validation split, by Ray Data on the cluster. A "validation" dataset is the validation
split; `data.validation` still says how its metric is released (private, noise_multiplier).
A resumed run reads the datasets given to it again (`run(..., resume=run_dir, datasets=...)`).

A sweep (`tune(pipeline, datasets=...)`) cuts and checks its splits once on the driver, and
every trial's workers read the same split datasets (the same seeded cut) through Ray Train's
`datasets=`, as run's do (sweeps/trial.py); a resumed sweep is given them again.
"""

from __future__ import annotations

from raydp_train.config.pipeline import Pipeline, PipelineError

SPLITS = ("train", "test", "validation")  # the names of the datasets handed over


def ray_splits(pipeline: Pipeline, datasets: dict | None,
               source: str = "<pipeline>") -> dict | None:
    """The splits {"train", "test"[, "validation"]} a ray_dataset or hf_dataset pipeline trains
    on, as lazy Ray Datasets (test and validation cut from train where the pipeline says: a
    seeded cut, materialized in the object store); None for a pipeline that reads files."""
    check_datasets(pipeline, datasets, source)
    data = pipeline.data
    if data.source == "hf_dataset":  # its own splits, by name (data/hf_datasets.py)
        from raydp_train.data.hf_datasets import hf_ray_datasets

        datasets = hf_ray_datasets(data)
    elif datasets is None:
        return None
    splits = dict(datasets)
    if "test" not in splits:
        splits["train"], splits["test"] = _cut(splits["train"], 1 - data.train_fraction,
                                               data.random_state, "data.train_fraction")
    if data.validation is not None and data.validation.fraction is not None:
        splits["train"], splits["validation"] = _cut(
            splits["train"], data.validation.fraction, data.random_state,
            "data.validation.fraction")
    return splits


def _cut(dataset, fraction: float, seed: int, field: str):
    """(the rows kept, a seeded random `fraction` of them) of `dataset`, split by Ray Data."""
    from raydp_train.errors import DataError

    rows = dataset.count()
    held = round(fraction * rows)
    if held == 0 or held == rows:
        raise DataError(f"{field}: {fraction:g} of {rows} training rows leaves an empty split")
    return dataset.train_test_split(test_size=held, shuffle=True, seed=seed)


def check_datasets(pipeline: Pipeline, datasets: dict | None,
                   source: str = "<pipeline>") -> None:
    """Before Ray starts: `datasets` fit the pipeline (run's or tune's). Refused by name:
    datasets for a pipeline that reads files or its own hf_dataset splits, a ray_dataset
    pipeline without them, no 'train', an unknown split, or not a ray.data.Dataset."""
    if pipeline.data.source == "hf_dataset" and datasets is not None:
        raise PipelineError(source, [("datasets: data.source hf_dataset reads its own "
                                      "splits; pass datasets with source ray_dataset")])
    if datasets is None:
        require_rows(pipeline, source)
        return
    problems = _problems(pipeline.data, datasets)
    if problems:
        raise PipelineError(source, problems)


def require_rows(pipeline: Pipeline, source: str = "<pipeline>") -> None:
    """A ray_dataset pipeline without its datasets is refused: only run() / tune() get them."""
    if pipeline.data.source == "ray_dataset":
        raise PipelineError(source, [
            ("data.source: ray_dataset needs the rows: raydp_train.run(pipeline, datasets="
             "{'train': ds, 'test': ds}) or raydp_train.tune(...), given again to continue a run "
             "or sweep; the command line reads files (parquet, csv, json)")])


def _problems(data, datasets: dict) -> list[str]:
    if data.source != "ray_dataset":
        return [(f"data.source: {data.source} reads files; set data.source: ray_dataset to "
                "train on the datasets passed")]
    if "train" not in datasets:
        return ["datasets: needs 'train' (and 'test', or data.train_fraction cuts one)"]
    unknown = sorted(set(datasets) - set(SPLITS))
    if unknown:
        return [(f"datasets: {', '.join(map(repr, unknown))} is not a split; pass 'train', "
                "'test' and 'validation'")]
    problem = _validation_problem(data.validation, "validation" in datasets)
    if problem:
        return [problem]
    import ray.data

    wrong = [name for name, dataset in datasets.items()
             if not isinstance(dataset, ray.data.Dataset)]
    return [f"datasets[{name!r}]: must be a ray.data.Dataset, got "
            f"{type(datasets[name]).__name__}" for name in wrong]


def _validation_problem(validation, given: bool) -> str | None:
    """datasets["validation"] and data.validation agree: one source of its rows, and the
    section that says how its metric is released."""
    if given and validation is None:
        return ("datasets['validation']: set data.validation (private, noise_multiplier) to "
                "say how its metric is released")
    if given and validation.fraction is not None:
        return ("datasets['validation']: data.validation.fraction cuts a validation split "
                "from the train rows too; give one of them")
    if not given and validation is not None and validation.fraction is None:
        return ("data.validation: its rows are missing: pass datasets['validation'], or set "
                "data.validation.fraction")
    return None
