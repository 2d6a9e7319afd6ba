"""Ray Datasets handed to the Python API (`data.source: ray_dataset`):

    rt.run(pipeline, datasets={"train": train_ds, "test": test_ds})

Each dataset is written once, block by block (the driver holds one block at a time), to a
Parquet file under `<run.output_dir>/datasets/<name>-<time>/`, and the pipeline's data section
becomes `source: parquet` on those files. So the rows then go through the same checks,
columns, sharding (Ray Data shards of the file) and records as any Parquet split, the saved
pipeline.yaml names files that `predict` and a resumed run read again, and nothing is kept
only in a cache. Without "test", the test split is cut from the train rows (data.train_fraction).
A "validation" dataset becomes `data.validation.path`; `data.validation` still says how its
metric is released (private, noise_multiplier).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from raydp_train.config.pipeline import Pipeline, PipelineError

# A dataset's name -> the data field it fills.
SPLITS = {"train": "path", "test": "test_path", "validation": "validation.path"}


def with_ray_datasets(pipeline: Pipeline, datasets: dict | None,
                      source: str = "<pipeline>") -> Pipeline:
    """`pipeline` reading `datasets` (written as Parquet); unchanged without them. Refused by
    name: datasets for a pipeline that reads files, or a ray_dataset pipeline without them."""
    data = pipeline.data
    if datasets is None:
        require_rows(pipeline, source)
        return pipeline
    problems = _problems(data, datasets)
    if problems:
        raise PipelineError(source, problems)
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
