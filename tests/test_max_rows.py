"""`data.max_rows`: quick tries on big data. A run reads at most that many rows of the training
file, a subset drawn with `data.random_state` and kept in file order, the same rows on every
reader, for Parquet and for CSV; a subset is read by the driver (it is small), never from
Ray Data shards on other nodes, where the cached copy is not."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import raydp_train as rt
from raydp_train.commands.cli import main
from raydp_train.data.sources import load_data
from raydp_train.data.table_files import with_max_rows


def _table(rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, rows)
    return pa.table({"x": x, "row": np.arange(rows, dtype=np.float64),
                     "label": (x + rng.normal(0, 0.5, rows) > 0).astype(np.int64)})


def _pipeline(folder: Path, source: str = "parquet", **data) -> rt.Pipeline:
    suffix = source
    return rt.Pipeline.from_dict({
        "name": "subset",
        "data": {"source": source, "path": str(folder / f"train.{suffix}"),
                 "test_path": str(folder / f"test.{suffix}"), "feature_columns": ["x", "row"],
                 "label_names": ["no", "yes"], "normalize": {"row": [500, 300]}, **data},
        "model": {"kind": "logistic"},
        "privacy": {"noise_multiplier": 1.0, "delta": 1e-3},
        "training": {"epochs": 1, "batch_size": 20, "workers": 2},
        "run": {"output_dir": str(folder / "runs")}})


@pytest.fixture
def files(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RAYDP_TRAIN_CACHE", str(tmp_path / "cache"))
    pq.write_table(_table(1000, 0), tmp_path / "train.parquet")
    pq.write_table(_table(200, 1), tmp_path / "test.parquet")
    for name in ("train", "test"):
        pa.csv.write_csv(pq.read_table(tmp_path / f"{name}.parquet"), tmp_path / f"{name}.csv")
    return tmp_path


def _rows(pipeline: rt.Pipeline) -> list[float]:
    """The original row numbers of the training rows a run would read (features unscaled)."""
    dataset = load_data(pipeline.data, 2)
    return sorted((dataset.train_features[:, 1] * 300 + 500).round().astype(int).tolist())


@pytest.mark.parametrize("source", ["parquet", "csv"])
def test_a_seeded_subset_of_the_training_rows(files, source):
    whole = _rows(_pipeline(files, source))
    some = _rows(_pipeline(files, source, max_rows=100))
    assert len(whole) == 1000 and len(some) == 100 and set(some) <= set(whole)
    assert _rows(_pipeline(files, source, max_rows=100)) == some  # the same rows again
    other = _rows(_pipeline(files, source, max_rows=100, random_state=7))
    assert len(other) == 100 and other != some
    assert _rows(_pipeline(files, source, max_rows=5000)) == whole  # fewer rows than that
    if source == "parquet":  # the file the run reads: rows in file order
        subset = pq.read_table(with_max_rows(_pipeline(files, max_rows=100).data).path)
        assert subset.column("row").to_pylist() == sorted(subset.column("row").to_pylist())
    assert rt.validate(_pipeline(files, source, max_rows=100)).steps == 5  # q = 20/100, 1 epoch


def test_validate_prints_the_subsets_size(files, capsys):
    (files / "p.yaml").write_text(_pipeline(files, max_rows=150).model_dump_json())
    assert main(["validate", str(files / "p.yaml")]) == 0
    assert "training examples N     150 (test 200)" in capsys.readouterr().out


def test_a_run_on_two_workers_trains_on_the_subset(files, ray_session, capsys):
    result = rt.run(_pipeline(files, max_rows=120), on_epoch=None, on_line=None)
    record = json.loads(result.record.read_text())
    assert result.status == "completed"
    assert sum(record["training"]["training_rows_per_worker"]) == 120
    assert result.privacy["sampling_rate"] == pytest.approx(20 / 120)
