"""`data.source: csv | json`: the same rows as CSV, JSON lines or a JSON array read
exactly as from Parquet (features, labels, splits), a bad file is refused naming it, and a
seeded run on CSV and on JSON lines gives the same accuracy and epsilon as on Parquet."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_documented_inputs import churn

from raydp_train.commands.cli import main
from raydp_train.config.pipeline import PipelineError, pipeline_from_dict
from raydp_train.data.columns import DataError
from raydp_train.data.sources import load_data

pd = pytest.importorskip("pandas", reason="writes the CSV and JSON files as users do")


def _files(folder, rows: int = 200, seed: int = 0) -> dict[str, str]:
    """The same churn rows as parquet, csv, JSON lines and a JSON array."""
    frame = churn(rows, seed, pa.string()).to_pandas().round({"spend": 6})  # as a user keeps it
    paths = {kind: str(folder / f"churn_{seed}.{suffix}") for kind, suffix in
             (("parquet", "parquet"), ("csv", "csv"), ("jsonl", "jsonl"), ("jsonarray", "json"))}
    frame.to_parquet(paths["parquet"])
    frame.to_csv(paths["csv"], index=False)
    frame.to_json(paths["jsonl"], orient="records", lines=True)
    frame.to_json(paths["jsonarray"], orient="records")
    return paths


def _pipeline(source: str, train: str, test: str, output: str = "runs") -> dict:
    return {"name": "churn", "data": {
                "source": source, "path": train, "test_path": test,
                "feature_columns": ["age", "spend"], "label_column": "churn",
                "label_names": ["no", "yes"], "normalize": {"age": [50, 20], "spend": [50, 20]}},
            "model": {"kind": "mlp", "hidden_sizes": [8]},
            "privacy": {"noise_multiplier": 1.0, "delta": 1e-3},
            "training": {"epochs": 2, "batch_size": 40, "lr": 0.2},
            "run": {"output_dir": output, "seed": 3}}


SOURCES = {"csv": "csv", "jsonl": "json", "jsonarray": "json"}


@pytest.mark.parametrize("kind", list(SOURCES))
def test_csv_and_json_rows_read_exactly_as_parquet(kind, tmp_path):
    train, test = _files(tmp_path, 200, 0), _files(tmp_path, 60, 1)
    expected = load_data(pipeline_from_dict(_pipeline("parquet", train["parquet"],
                                                      test["parquet"])).data)
    got = load_data(pipeline_from_dict(_pipeline(SOURCES[kind], train[kind], test[kind])).data)
    for name in ("train_features", "train_labels", "test_features", "test_labels"):
        np.testing.assert_array_equal(getattr(got, name), getattr(expected, name), err_msg=name)
    assert got.num_classes == 2 and got.train_labels.sum() > 0


def test_a_bad_csv_or_json_file_is_refused_naming_it(tmp_path):
    train = _files(tmp_path)
    (tmp_path / "broken.json").write_text('{"age": 3, "spend": \n')
    with pytest.raises(DataError, match="data.path: csv file not found: .*missing.csv"):
        load_data(pipeline_from_dict(_pipeline("csv", str(tmp_path / "missing.csv"),
                                               train["csv"])).data)
    with pytest.raises(DataError, match=r"data.test_path: cannot read .*broken.json as json"):
        load_data(pipeline_from_dict(_pipeline("json", train["jsonl"],
                                               str(tmp_path / "broken.json"))).data)
    with pytest.raises(DataError, match=r"column\(s\) \['churn'\] not in"):
        pd.DataFrame({"age": [1, 2], "spend": [3, 4]}).to_csv(tmp_path / "nolabel.csv",
                                                              index=False)
        load_data(pipeline_from_dict(_pipeline("csv", str(tmp_path / "nolabel.csv"),
                                               train["csv"])).data)
    tensors = {"name": "t", "data": {"source": "csv", "path": train["csv"],
                                     "tensor_column": "age"},
               "model": {"kind": "cnn"}, "privacy": {"noise_multiplier": 1.0}}
    with pytest.raises(PipelineError, match="a CSV cell holds no tensor"):
        pipeline_from_dict(tensors)


@pytest.mark.long  # make test: test_csv_and_json_rows_read_exactly_as_parquet
@pytest.mark.slow
def test_a_run_on_csv_or_json_is_the_run_on_parquet(ray_session, tmp_path, capsys):
    train, test = _files(tmp_path, 200, 0), _files(tmp_path, 60, 1)
    outcomes = {}
    # A JSON array reads as JSON lines do (the test above); its run would be the jsonl run.
    for kind, source in {"parquet": "parquet", "csv": "csv", "jsonl": "json"}.items():
        output = tmp_path / f"runs_{kind}"
        (tmp_path / f"{kind}.yaml").write_text(json.dumps(
            _pipeline(source, train[kind], test[kind], str(output))))
        assert main(["run", str(tmp_path / f"{kind}.yaml")]) == 0, capsys.readouterr().err
        (run_dir,) = output.iterdir()
        record = json.loads((run_dir / "record.json").read_text())
        outcomes[kind] = (record["metrics"][-1]["test_accuracy"], record["privacy"]["epsilon"])
        if kind != "parquet":  # the run's own format through predict
            assert main(["predict", str(run_dir), "--data", test[kind]]) == 0
            assert f"accuracy                {outcomes[kind][0]:.4f}" in capsys.readouterr().out
    assert len(set(outcomes.values())) == 1, outcomes
    assert pq.read_table(train["parquet"]).num_rows == 200
