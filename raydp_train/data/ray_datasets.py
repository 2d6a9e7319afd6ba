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

A sweep's trials (`tune`) still read Parquet copies: `with_ray_datasets` writes each
dataset once, block by block, under `<run.output_dir>/datasets/`, and the pipeline reads them.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from raydp_train.config.pipeline import Pipeline, PipelineError

# A dataset's name -> the data field it fills.
SPLITS = {"train": "path", "test": "test_path", "validation": "validation.path"}


def ray_splits(pipeline: Pipeline, datasets: dict | None,
               source: str = "<pipeline>") -> dict | None:
    """The splits {"train", "test"[, "validation"]} a ray_dataset pipeline trains on, as
    lazy Ray Datasets (test and validation cut from train where the pipeline says); None for
    a pipeline that reads files. Refused by name: datasets for a pipeline that reads files,
    or a ray_dataset pipeline without them."""
    data = pipeline.data
    if data.source == "hf_dataset":  # its own splits, by name (data/hf_datasets.py)
        from raydp_train.data.hf_datasets import hf_ray_datasets

        if datasets is not None:
            raise PipelineError(source, [("datasets: data.source hf_dataset reads its own "
                                          "splits; pass datasets with source ray_dataset")])
        datasets = hf_ray_datasets(data)
    elif not _fit(pipeline, datasets, source):
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


def with_ray_datasets(pipeline: Pipeline, datasets: dict | None,
                      source: str = "<pipeline>") -> Pipeline:
    """A sweep's `pipeline` reading `datasets` written as Parquet; unchanged without them."""
    data = pipeline.data
    if data.source == "hf_dataset":
        raise PipelineError(source, [("data.source: hf_dataset is for run, not yet for a "
                                      "sweep; write its splits with Dataset.to_parquet and "
                                      "use source parquet")])
    if not _fit(pipeline, datasets, source):
        return pipeline
    folder = (Path(pipeline.run.output_dir).resolve() / "datasets"
              / f"{pipeline.name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}")
    fields = {**data.model_dump(), "source": "parquet"}
    for split, dataset in datasets.items():
        written = str(write_parquet(dataset, folder / f"{split}.parquet", split))
        if split == "validation":
            fields["validation"] = {**fields["validation"], "path": written}
        else:
            fields[SPLITS[split]] = written
    from raydp_train.config.data import ParquetData

    parquet = ParquetData.model_validate(fields)
    return pipeline.model_copy(update={"data": parquet})


def _fit(pipeline: Pipeline, datasets: dict | None, source: str) -> bool:
    """Whether `datasets` were given, after checking that they fit the pipeline."""
    if datasets is None:
        require_rows(pipeline, source)
        return False
    problems = _problems(pipeline.data, datasets)
    if problems:
        raise PipelineError(source, problems)
    return True


def require_rows(pipeline: Pipeline, source: str = "<pipeline>") -> None:
    """A ray_dataset pipeline without its datasets is refused: only run() / tune() get them."""
    if pipeline.data.source == "ray_dataset":
        raise PipelineError(source, [
            ("data.source: ray_dataset needs the rows: raydp_train.run(pipeline, datasets="
             "{'train': ds, 'test': ds}); the command line reads files (parquet, csv, json)")])


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


def write_parquet(dataset, path: Path, split: str) -> Path:
    """`dataset` as one Parquet file at `path`, written block by block; refused if empty."""
    import pyarrow.parquet as pq
    import ray

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    writer, rows = None, 0
    try:
        for reference in dataset.to_arrow_refs():
            block = ray.get(reference)
            if block.num_rows == 0:
                continue
            if writer is None:
                writer = pq.ParquetWriter(partial, block.schema)
            writer.write_table(block.cast(writer.schema))
            rows += block.num_rows
    finally:
        if writer is not None:
            writer.close()
    if rows == 0:
        partial.unlink(missing_ok=True)
        raise PipelineError(f"datasets[{split!r}]", [f"datasets[{split!r}]: has no rows"])
    partial.replace(path)
    return path
