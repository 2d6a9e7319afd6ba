"""Ray Datasets through the Python API (`data.source: ray_dataset`): the same rows
handed over as Ray Datasets (several blocks) give the same seeded run as Parquet files, with
no row written under run.output_dir (every file there scanned for each row's token); a
pipeline and datasets that do not fit are refused by name before anything is spent."""

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import raydp_train as rt
from raydp_train.commands.cli import main
from raydp_train.data.ray_datasets import check_datasets


def rows(count: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    features = rng.normal(0, 1, (count, 3))
    labels = (features @ np.array([1.0, -2.0, 0.5]) + rng.normal(0, 0.5, count) > 0)
    return pa.table({"a": features[:, 0], "b": features[:, 1], "c": features[:, 2],
                     "label": labels.astype(np.int64)})


def with_tokens(table: pa.Table, split: str) -> pa.Table:
    """Each row marked by a unique token (a column the pipeline does not read)."""
    return table.append_column("token", pa.array(
        [f"ROWTOKEN-{split}-{index:05d}" for index in range(table.num_rows)]))


def files_holding_rows(folder, tables: list[pa.Table]) -> list[str]:
    """Every file under `folder` that holds a row's token or a feature's float64 bytes."""
    needles = [token.encode() for table in tables for token in table.column("token").to_pylist()]
    needles += [np.float64(value).tobytes() for table in tables
                for value in table.column("a").to_pylist()[:50]]
    return sorted(str(path) for path in folder.rglob("*") if path.is_file()
                  and any(needle in path.read_bytes() for needle in needles))


def pipeline_dict(tmp_path, data: dict) -> dict:
    return {"name": "tables", "data": {"feature_columns": ["a", "b", "c"], **data},
            "model": {"kind": "logistic", "num_classes": 2},
            "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-4},
            "training": {"epochs": 2, "batch_size": 40, "workers": 2},
            "run": {"seed": 7, "output_dir": str(tmp_path / "runs")}}


def test_ray_datasets_train_as_the_same_rows_in_parquet(ray_session, tmp_path):
    import ray.data

    train, test, dev = rows(400, 1), rows(100, 2), rows(60, 3)
    for name, table in (("train", train), ("test", test), ("dev", dev)):
        pq.write_table(table, tmp_path / f"{name}.parquet")
    from_files = rt.run(rt.Pipeline.from_dict(pipeline_dict(tmp_path, {
        "source": "parquet", "path": str(tmp_path / "train.parquet"),
        "test_path": str(tmp_path / "test.parquet"),
        "validation": {"path": str(tmp_path / "dev.parquet"), "private": False}})),
        on_line=None, on_epoch=None)
    marked = [with_tokens(train, "train"), with_tokens(test, "test"), with_tokens(dev, "dev")]
    datasets = {"train": ray.data.from_arrow(marked[0]).repartition(3),
                "test": ray.data.from_arrow(marked[1]), "validation": ray.data.from_arrow(marked[2])}
    assert datasets["train"].materialize().num_blocks() == 3
    output = tmp_path / "handed"
    raw = pipeline_dict(tmp_path, {"source": "ray_dataset", "validation": {"private": False}})
    raw["run"]["output_dir"] = str(output)
    handed = rt.run(rt.Pipeline.from_dict(raw), datasets=datasets, on_line=None, on_epoch=None)
    assert handed.status == from_files.status == "completed"
    assert files_holding_rows(output, marked) == []
    assert files_holding_rows(tmp_path, marked[:1]) == [str(tmp_path / "train.parquet")]
    assert handed.metrics[-1]["test_accuracy"] == from_files.metrics[-1]["test_accuracy"]
    assert [row["validation_accuracy"] for row in handed.metrics] == [
        row["validation_accuracy"] for row in from_files.metrics]
    assert [row["train_loss"] for row in handed.metrics] == pytest.approx(
        [row["train_loss"] for row in from_files.metrics], rel=1e-9)
    assert handed.epsilon == from_files.epsilon
    saved = yaml.safe_load((handed.run_dir / "pipeline.yaml").read_text())["data"]
    assert saved["source"] == "ray_dataset"  # no files: a resumed run is given the datasets
    # predict reads a dataset in memory as the workers read their shards, labelled or not
    predicted = rt.predict(handed.run_dir, datasets["test"])
    assert predicted.accuracy == pytest.approx(handed.metrics[-1]["test_accuracy"])
    unlabeled = rt.predict(handed.run_dir, marked[1].drop_columns(["label"]))
    np.testing.assert_array_equal(unlabeled.classes, predicted.classes)
    assert files_holding_rows(output, marked) == []


@pytest.mark.slow
def test_a_ray_dataset_pipeline_without_its_rows_is_refused_by_name(tmp_path, capsys,
                                                                   monkeypatch):
    import raydp_train.runs.resources

    def no_ray(*_, **__):
        raise AssertionError("Ray was joined or started before the refusal")

    monkeypatch.setattr(raydp_train.runs.resources, "connect", no_ray)
    raw = pipeline_dict(tmp_path, {"source": "ray_dataset"})
    with pytest.raises(rt.UserError, match="data.source: ray_dataset needs the rows"):
        rt.validate(rt.Pipeline.from_dict(raw))
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(raw))
    assert main(["run", str(tmp_path / "p.yaml")]) == 2
    error = capsys.readouterr().err
    assert "the command line reads files" in error and "Traceback" not in error
    assert not (tmp_path / "runs").exists()  # nothing written, nothing spent


@pytest.mark.parametrize("source, datasets, message", [
    ("parquet", {"train": "rows"}, ("data.source: parquet reads files; set data.source: "
                                   "ray_dataset")),
    ("ray_dataset", {"test": "rows"}, "datasets: needs 'train'"),
    ("ray_dataset", {"train": "rows", "dev": "rows"}, "'dev' is not a split"),
    ("ray_dataset", {"train": [1, 2]}, "datasets['train']: must be a ray.data.Dataset, got list"),
    ("ray_dataset", None, "data.source: ray_dataset needs the rows"),
    ("hf_dataset", {"train": "rows"}, "datasets: data.source hf_dataset reads its own splits"),
])
def test_datasets_that_do_not_fit_the_pipeline_are_refused_by_name_before_ray(
        tmp_path, monkeypatch, source, datasets, message):
    """By run and by tune (a sweep, resumed or not), before Ray starts and any budget."""
    import raydp_train.runs.resources

    def no_ray(*_, **__):
        raise AssertionError("Ray was joined or started before the refusal")

    monkeypatch.setattr(raydp_train.runs.resources, "connect", no_ray)
    data = {"source": source, "validation": {"fraction": 0.2, "private": False}}
    if source != "ray_dataset":
        data["path"] = str(tmp_path / "train")
        (tmp_path / "train").mkdir()
    raw = pipeline_dict(tmp_path, data)
    raw["budget"] = {"name": "refused", "epsilon": 5.0, "delta": 1e-4,
                     "ledger": str(tmp_path / "ledger")}
    raw["tune"] = {"num_samples": 1, "search_space": {"training.lr": {"grid": [0.1, 0.2]}}}
    pipeline = rt.Pipeline.from_dict(raw)
    for call in (rt.run, rt.tune):
        with pytest.raises(rt.UserError, match=re.escape(message)):
            call(pipeline, datasets=datasets, on_line=None)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ledger").exists()


@pytest.mark.parametrize("validation, given, message", [
    (None, True, "datasets['validation']: set data.validation (private, noise_multiplier)"),
    ({"private": False}, False, "data.validation: its rows are missing"),
    ({"fraction": 0.2, "private": False}, True, "data.validation.fraction cuts a validation"),
])
def test_a_validation_dataset_and_the_validation_section_must_agree(tmp_path, validation, given,
                                                                    message):
    data = {"source": "ray_dataset", **({"validation": validation} if validation else {})}
    pipeline = rt.Pipeline.from_dict(pipeline_dict(tmp_path, data))
    datasets = {"train": "rows", **({"validation": "rows"} if given else {})}
    with pytest.raises(rt.UserError, match=re.escape(message)):
        check_datasets(pipeline, datasets)


def test_a_file_sources_validation_still_names_its_rows(tmp_path):
    raw = pipeline_dict(tmp_path, {"source": "parquet", "path": str(tmp_path / "t.parquet"),
                                   "validation": {"private": False}})
    with pytest.raises(rt.UserError, match=r"data.validation.fraction: set exactly one of "
                                           r"fraction or path \(got neither\)"):
        rt.Pipeline.from_dict(raw)
    raw["data"] = {"source": "ray_dataset", "feature_columns": ["a"],
                   "validation": {"path": "dev.parquet"}}
    with pytest.raises(rt.UserError, match="data.validation.path: not read with source "
                                           "ray_dataset"):
        rt.Pipeline.from_dict(raw)


def test_a_bad_row_is_refused_naming_the_dataset_before_anything_is_written(ray_session,
                                                                          tmp_path):
    """Ray Data tasks check every batch; the error names the dataset, not a file."""
    import ray.data

    bad = rows(300, 1)
    values = bad.column("b").to_pylist()
    values[7] = float("nan")
    bad = bad.set_column(1, "b", pa.array(values))
    pipeline = rt.Pipeline.from_dict(pipeline_dict(tmp_path, {"source": "ray_dataset"}))
    with pytest.raises(rt.UserError, match=r"data: datasets\['train'\] has NaN or inf features "
                                           r"in rows \[7\]"):
        rt.run(pipeline, datasets={"train": ray.data.from_arrow(bad),
                                   "test": ray.data.from_arrow(rows(50, 2))}, on_line=None)
    nulls = rows(60, 2).set_column(0, "a", pa.array([None] * 60, pa.float64()))
    with pytest.raises(rt.UserError, match=r"column 'a' in datasets\['test'\] has 60 null"):
        rt.run(pipeline, datasets={"train": ray.data.from_arrow(rows(300, 1)),
                                   "test": ray.data.from_arrow(nulls)}, on_line=None)
    assert not (tmp_path / "runs").exists()  # nothing written, nothing spent


def test_a_test_split_is_cut_from_the_train_rows_on_the_cluster(ray_session, tmp_path):
    import ray.data

    from raydp_train.data.ray_datasets import ray_splits

    table = rows(500, 1).append_column("id", pa.array(np.arange(500)))
    pipeline = rt.Pipeline.from_dict(pipeline_dict(tmp_path, {
        "source": "ray_dataset", "train_fraction": 0.8}))
    splits = ray_splits(pipeline, {"train": ray.data.from_arrow(table)})
    ids = {name: [row["id"] for row in split.take_all()] for name, split in splits.items()}
    assert (len(ids["train"]), len(ids["test"])) == (400, 100)
    assert sorted(ids["train"] + ids["test"]) == list(range(500))
    assert ids["test"] != list(range(400, 500))  # a seeded random cut, not the last rows
    again = ray_splits(pipeline, {"train": ray.data.from_arrow(table)})
    assert [row["id"] for row in again["test"].take_all()] == ids["test"]


def test_text_batches_are_checked_and_summarized_without_their_tokens(tmp_path):
    """The driver's summary of text rows: token zeros of the run's shape, the labels; a null
    or a non-string text refused naming the dataset (checked here on Arrow tables, as
    validate checks a Hugging Face dataset; Ray Data tasks run the same check)."""
    from raydp_train.data.ray_dataset_checks import checked_datasets

    data = rt.Pipeline.from_dict({**pipeline_dict(tmp_path, {}), "data": {
        "source": "ray_dataset", "text_column": "text", "max_length": 16}}).data
    texts = pa.table({"text": ["a fine film", "a dull one", "fine"], "label": [1, 0, 1]})
    summary = checked_datasets({"train": texts, "test": texts.slice(1)}, data, 2, "tok",
                               "model.num_classes")
    assert summary.train_features.shape == (3, 2, 16) and summary.features_read is False
    assert summary.train_features.dtype == np.int32 and not summary.train_features.any()
    np.testing.assert_array_equal(summary.test_labels, [0, 1])
    null = texts.set_column(0, "text", pa.array(["x", None, "y"]))
    with pytest.raises(rt.UserError, match=r"'text' in datasets\['train'\] has 1 null rows"):
        checked_datasets({"train": null, "test": texts}, data, 2, "tok", "model.num_classes")
    numbers = texts.set_column(0, "text", pa.array([1, 2, 3]))
    with pytest.raises(rt.UserError, match=r"column 'text' in datasets\['test'\] is int64"):
        checked_datasets({"train": texts, "test": numbers}, data, 2, "tok", "model.num_classes")
