"""Ray Datasets through the Python API (`data.source: ray_dataset`, issue 29): the same rows
handed over as Ray Datasets (several blocks) give the same seeded run as Parquet files, and the
run records files that outlive the datasets; a pipeline and datasets that do not fit are
refused by name before anything is spent."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import raydp_train as rt
from raydp_train.cli import main
from raydp_train.ray_datasets import with_ray_datasets


def rows(count: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    features = rng.normal(0, 1, (count, 3))
    labels = (features @ np.array([1.0, -2.0, 0.5]) + rng.normal(0, 0.5, count) > 0)
    return pa.table({"a": features[:, 0], "b": features[:, 1], "c": features[:, 2],
                     "label": labels.astype(np.int64)})


def pipeline_dict(tmp_path, data: dict) -> dict:
    return {"name": "tables", "data": {"feature_columns": ["a", "b", "c"], **data},
            "model": {"kind": "logistic"},
            "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-4},
            "training": {"epochs": 2, "batch_size": 40, "workers": 2},
            "run": {"seed": 7, "output_dir": str(tmp_path / "runs")}}


def test_ray_datasets_train_as_the_same_rows_in_parquet(ray_session, tmp_path):
    import ray.data

    train, test = rows(400, 1), rows(100, 2)
    pq.write_table(train, tmp_path / "train.parquet")
    pq.write_table(test, tmp_path / "test.parquet")
    from_files = rt.run(rt.Pipeline.from_dict(pipeline_dict(tmp_path, {
        "source": "parquet", "path": str(tmp_path / "train.parquet"),
        "test_path": str(tmp_path / "test.parquet")})), on_line=None, on_epoch=None)
    datasets = {"train": ray.data.from_arrow(train).repartition(3),
                "test": ray.data.from_arrow(test)}
    assert datasets["train"].materialize().num_blocks() == 3
    handed = rt.run(rt.Pipeline.from_dict(pipeline_dict(tmp_path, {"source": "ray_dataset"})),
                    datasets=datasets, on_line=None, on_epoch=None)
    assert handed.status == from_files.status == "completed"
    assert handed.metrics[-1]["test_accuracy"] == from_files.metrics[-1]["test_accuracy"]
    assert [row["train_loss"] for row in handed.metrics] == pytest.approx(
        [row["train_loss"] for row in from_files.metrics], rel=1e-9)
    assert handed.epsilon == from_files.epsilon
    saved = yaml.safe_load((handed.run_dir / "pipeline.yaml").read_text())["data"]
    assert saved["source"] == "parquet"  # files that predict and a resumed run read again
    assert pq.read_table(saved["path"]).equals(train)
    assert pq.read_table(saved["test_path"]).equals(test)


def test_a_ray_dataset_pipeline_without_its_rows_is_refused_by_name(tmp_path, capsys,
                                                                   monkeypatch):
    import raydp_train.resources

    def no_ray(*_, **__):
        raise AssertionError("Ray was joined or started before the refusal")

    monkeypatch.setattr(raydp_train.resources, "connect", no_ray)
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
])
def test_datasets_that_do_not_fit_the_pipeline_are_refused_by_name(tmp_path, source, datasets,
                                                                   message):
    data = {"source": source}
    if source == "parquet":
        data["path"] = str(tmp_path / "train.parquet")
    pipeline = rt.Pipeline.from_dict(pipeline_dict(tmp_path, data))
    with pytest.raises(rt.UserError, match=message.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(").replace(")", r"\)")):
        with_ray_datasets(pipeline, datasets)
