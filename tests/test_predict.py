"""`raydp-train predict RUN_DIR --data FILE` and `load_model` refuse what they cannot
read, each in one error. (Each model kind rebuilt from its run directory reproduces the run's
test accuracy: tests/test_documented_inputs.py, on the documented runs.)"""

import json

import pytest

from raydp_train.models.predictions import PredictError, predict


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
