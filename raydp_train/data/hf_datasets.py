"""`data.source: hf_dataset`: a Hugging Face `datasets` dataset, as HF users hold their text.

    data: {source: hf_dataset, path: ./sst2, text_column: sentence, label_column: label}

`path` is a folder written by `save_to_disk` (a DatasetDict, or one Dataset: then it is the
split `split` names); `name` a dataset loaded by `load_dataset` from the local Hugging Face
cache, offline (nothing is downloaded, no host is asked: a name not cached is refused by
name), `subset` its configuration where several are cached (GLUE's sst2, cola, ...). Its splits are
taken by name (`split`, `test_split`, `validation_split`) as the Arrow tables `datasets`
memory-maps; `run` hands them to Ray Data and trains as on Ray Datasets handed to it
(data/ray_datasets.py: checked by Ray Data tasks, each worker reading its shard, nothing
copied under run.output_dir); `validate` checks them here, batch by batch, without Ray.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa

from raydp_train.errors import DataError


def split_names(data) -> dict[str, str]:
    """{"train", "test", "validation"} -> the dataset's split of that role, where named."""
    names = {"train": data.split, "test": data.test_split, "validation": data.validation_split}
    return {role: name for role, name in names.items() if name is not None}


def where(data, role: str) -> str:
    """What an error about a role's rows names: the dataset and its split."""
    return f"{data.path or data.name}, split {split_names(data).get(role, role)!r}"


def hf_tables(data) -> dict[str, pa.Table]:
    """The named splits' rows as Arrow tables (memory-mapped, not read into memory)."""
    loaded = _load(data)
    tables = {}
    for role, name in split_names(data).items():
        if name not in loaded:
            field = {"train": "split", "test": "test_split"}.get(role, "validation_split")
            raise DataError(f"data.{field}: {data.path or data.name} has no split {name!r}; it "
                            f"has {', '.join(map(repr, loaded))}")
        dataset = loaded[name]
        if dataset._indices is not None:  # a select/shuffle not yet written out
            dataset = dataset.flatten_indices()
        tables[role] = dataset.data.table
    return tables


def local_splits(data) -> dict[str, pa.Table]:
    """validate's splits, without Ray: as many rows in each as `run` trains on (a test or
    validation split cut from train here by position; `run` cuts a seeded random one)."""
    tables = hf_tables(data)
    cuts = [("test", 1 - data.train_fraction, "data.train_fraction")] if "test" not in tables \
        else []
    if data.validation is not None and data.validation.fraction is not None:
        cuts.append(("validation", data.validation.fraction, "data.validation.fraction"))
    for role, fraction, field in cuts:
        rows = tables["train"].num_rows
        held = round(fraction * rows)
        if held == 0 or held == rows:
            raise DataError(f"{field}: {fraction:g} of {rows} training rows leaves an empty "
                            "split")
        tables[role] = tables["train"].slice(rows - held)
        tables["train"] = tables["train"].slice(0, rows - held)
    return tables


def hf_ray_datasets(data) -> dict:
    """The named splits as Ray Datasets (the tables put in Ray's object store)."""
    import ray.data

    return {role: ray.data.from_arrow(table) for role, table in hf_tables(data).items()}


def _load(data) -> dict:
    try:
        import datasets
    except ImportError:
        raise DataError("data.source: hf_dataset needs Hugging Face's datasets package: pip "
                        "install 'raydp-train[hf]'") from None
    if data.path is not None:
        if not (Path(data.path) / "dataset_dict.json").is_file() and not (
                Path(data.path) / "state.json").is_file():
            raise DataError(f"data.path: {data.path} is not a folder written by a Hugging Face "
                            "dataset's save_to_disk")
        loaded = datasets.load_from_disk(data.path)
        return {data.split: loaded} if isinstance(loaded, datasets.Dataset) else dict(loaded)
    return _from_cache(datasets, data.name, data.subset)


def _from_cache(datasets, name: str, subset: str | None) -> dict:
    """`load_dataset(name)` with the hub unreachable by choice: from the local cache alone."""
    previous = datasets.config.HF_HUB_OFFLINE, os.environ.get("HF_DATASETS_OFFLINE")
    datasets.config.HF_HUB_OFFLINE = True
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        return dict(datasets.load_dataset(name, subset))
    except Exception as error:  # noqa: BLE001 -- any failure to find it: one line
        message = " ".join(str(error).split())[:300]
        if subset is None and "configurations in the cache" in message:
            cached = message.split("in the cache:")[-1].split(" Please")[0].strip()
            raise DataError(f"data.subset: {name!r} has several configurations in the local "
                            f"Hugging Face cache ({cached}); name one in data.subset") from None
        raise DataError(f"data.name: {name!r} is not in the local Hugging Face cache (loaded "
                        f"offline: {message}); load it once online, or save_to_disk and give "
                        "data.path") from None
    finally:
        datasets.config.HF_HUB_OFFLINE = previous[0]
        if previous[1] is None:
            os.environ.pop("HF_DATASETS_OFFLINE", None)
        else:
            os.environ["HF_DATASETS_OFFLINE"] = previous[1]
