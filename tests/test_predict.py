"""`raydp-train predict RUN_DIR --data FILE` and `load_model` (issue 31): each model kind,
rebuilt from its run directory, reproduces the run's recorded test accuracy on the run's own
test file; a file without labels gets the same predictions and no accuracy."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from raydp_train.commands.cli import main
from raydp_train.models.predictions import PredictError, load_model, predict

# Each model kind as a documented run (tests/test_documented_inputs.py) leaves it: the run
# directory, and the test file it scored.
KINDS = {"mlp-string-labels": ("churn", "churn_test.parquet"),
         "cnn-tensors": ("tensors-cnn", "tensors_test.parquet"),
         "hf-mean-pooled": ("text-hf", "text_test.parquet")}


@pytest.mark.parametrize("kind", list(KINDS))
def test_predict_reproduces_the_runs_test_accuracy(kind, documented_run, tmp_path, capsys):
    name, test_name = KINDS[kind]
    run_dir, _ = documented_run(name)
    pipeline = yaml.safe_load((run_dir / "pipeline.yaml").read_text())
    test_file = Path(pipeline["data"]["test_path"])
    assert test_file.name == test_name
    test = pq.read_table(test_file)
    recorded = json.loads((run_dir / "record.json").read_text())["metrics"][-1]["test_accuracy"]
    result = predict(run_dir, test_file)
    assert result.accuracy == pytest.approx(recorded, abs=1e-6)
    assert len(result.classes) == test.num_rows
    assert not load_model(run_dir).training

    capsys.readouterr()
    assert main(["predict", str(run_dir), "--data", str(test_file), "--output",
                 str(tmp_path / "out.parquet")]) == 0
    assert f"accuracy                {recorded:.4f}" in capsys.readouterr().out
    written = pq.read_table(tmp_path / "out.parquet").column("prediction").to_numpy()
    assert (written == result.classes).all()

    label = pipeline["data"].get("label_column") or "label"
    unlabeled = tmp_path / "unlabeled.parquet"
    pq.write_table(test.drop_columns([label]), unlabeled)
    blind = predict(run_dir, unlabeled)
    assert blind.accuracy is None and (blind.classes == result.classes).all()
    if pipeline["model"]["kind"] == "hf":
        _check_transformers_alone(run_dir, test, recorded, list(result.classes))


# transformers alone, in a fresh process as a consumer of the folder runs it: the predicted
# class ids with trust_remote_code, and what loading without it raised.
CONSUMER = """
import json, sys, transformers
folder, sentences = sys.argv[1], json.load(sys.stdin)
classify = transformers.pipeline("text-classification", model=folder, trust_remote_code=True)
ids = classify.model.config.label2id
predicted = [ids[o["label"]] for o in classify(sentences, truncation=True, max_length=8)]
try:
    transformers.pipeline("text-classification", model=folder, trust_remote_code=False)
    refusal = None
except ValueError as error:
    refusal = str(error)
print(json.dumps({"predicted": predicted, "refusal": refusal}))
"""


def _check_transformers_alone(run_dir: Path, test, recorded: float, classes: list) -> None:
    """The mean-pooled `model/` with transformers' pipeline alone: the run's accuracy with
    trust_remote_code (its pooling is custom code), a refusal without it, never [CLS]."""
    pytest.importorskip("transformers", reason="a runtime dependency")
    sentences = test.column("sentence").to_pylist()
    done = subprocess.run([sys.executable, "-c", CONSUMER, str(run_dir / "model")],
                          input=json.dumps(sentences), capture_output=True, text=True,
                          check=True, timeout=300)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    predicted = seen["predicted"]
    assert predicted == classes
    accuracy = sum(p == y for p, y in zip(predicted, test.column("label").to_pylist(),
                                          strict=True)) / len(sentences)
    assert accuracy == pytest.approx(recorded, abs=1e-6)
    assert seen["refusal"] is not None and "trust_remote_code" in seen["refusal"]


def test_predict_refuses_what_is_not_a_finished_run(tmp_path):
    with pytest.raises(PredictError, match="not the directory of a finished run"):
        predict(tmp_path, tmp_path / "x.parquet")



def test_a_file_that_is_not_parquet_is_one_error(tmp_path):
    """A run directory as `run` leaves it (logistic on one column), and a text file as data."""
    import torch

    from raydp_train.config.pipeline import dump_pipeline, pipeline_from_dict
    from raydp_train.models.builders import build_model

    pipeline = pipeline_from_dict({
        "name": "p", "data": {"source": "parquet", "path": "x.parquet", "feature_columns": ["a"]},
        "model": {"kind": "logistic"}, "privacy": {"noise_multiplier": 1.0}})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "pipeline.yaml").write_text(dump_pipeline(pipeline))
    (run_dir / "record.json").write_text(json.dumps(
        {"model": {"feature_shape": [1], "num_classes": 2}}))
    torch.save(build_model(pipeline.model, (1,), 2).state_dict(), run_dir / "model.pt")
    (tmp_path / "notes.parquet").write_text("not parquet")
    with pytest.raises(PredictError, match="not a Parquet file"):
        predict(run_dir, tmp_path / "notes.parquet")
