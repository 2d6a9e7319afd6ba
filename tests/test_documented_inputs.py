"""Every field of the pipeline reference (docs/reference/pipeline.md) runs through a real
`raydp-train run` on a tiny dataset, not only through validate: a few pipelines that together set every field,
and a check (no Ray) that they do, so a field added to the schema fails here until a run uses
it; `predict` rebuilds each model kind from these runs (tests/conftest.py's session fixture:
they run once, and pytest-xdist keeps a file's tests on one worker). The churn run is a
newcomer's own table: raw columns, string labels as pandas writes them and as a plain Arrow
`string`, named by data.label_names, on 2 workers."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from test_bad_inputs import MINILM, TINY_BERT
from test_pipeline_reference import schema_fields

from raydp_train.commands.cli import main
from raydp_train.config.pipeline import Pipeline
from raydp_train.models.predictions import load_model, predict

# Fields a `run` cannot exercise on this machine, each with where it is run instead.
RUN_ELSEWHERE = {
    "training.use_gpu": "needs a CUDA GPU (tests/test_precision.py, benchmarks/gpu_check.sh)",
    "training.accelerator_type": "needs a GPU; refused where no node has the model: "
                                 "tests/test_no_silent_wait.py",
    "training.worker_resources": "a custom resource the test Ray's node lacks, refused: "
                                 "tests/test_no_silent_wait.py",
    "tune": "`raydp-train tune`: tests/test_budget_ray.py, tests/test_faults.py",
    "privacy.unit": "user: tests/test_user_level_ray.py (a sweep; each mechanism on 2 workers "
                    "in make test-long)",
    "privacy.rows_per_user": "unit user only: tests/test_user_level_ray.py",
    "privacy.user_contribution": "unit user only: tests/test_user_level.py (a local run)",
    "data.user_column": "unit user only: tests/test_user_level_ray.py",
    "data.sampler": "streaming: tests/test_streaming_sampler.py (2 workers; a file several "
                    "times the object store in the long mode)",
    "data.sampler_memory_mb": "auto's threshold: tests/test_streaming_sampler.py",
    "data.name": "source hf_dataset (a dataset in the local cache): tests/test_hf_datasets.py",
    "data.subset": "source hf_dataset, with data.name: tests/test_hf_datasets.py",
    "data.split": "source hf_dataset: tests/test_hf_datasets.py (validate; a run on 2 workers in "
                  "make test-long)",
    "data.test_split": "source hf_dataset: tests/test_hf_datasets.py",
    "data.validation_split": "source hf_dataset: tests/test_hf_datasets.py",
    "training.cpus_per_worker": "a ScalingConfig's resources_per_worker: tests/test_ray_configs.py "
                                "(mapped; a run in make test-long)",
    "training.sharding": "fsdp: tests/test_sharding_worker.py (the worker loop on 2 Gloo ranks, "
                         "sharded equal to whole; a Ray Train run: benchmarks/RESULTS.md)",
    "model.label_texts": "with head_init label_texts, a checkpoint's weights only (this "
                         "file's hf run is random): tests/test_label_text_head.py, a run: "
                         "benchmarks/sst2_accuracy.py (lora-all-label-eps3)",
    "model.task": "causal_lm: tests/test_causal_lm_run.py (a run on 2 workers, generate: make "
                  "test-long)",
    "model.lm_loss": "causal_lm only: tests/test_causal_lm_run.py",
    "model.factory": "model.kind torch: tests/test_custom_model.py (a run on 2 workers)",
    "model.kwargs": "model.kind torch: tests/test_custom_model.py",
    "model.loss": "model.kind torch: tests/test_custom_model.py (the example on 2 workers)",
    "model.tokenizer": "model.kind torch on text: tests/test_custom_model_layers.py (validate "
                       "--check-model of pipelines/sst2_lstm.yaml; its run: benchmarks/RESULTS.md)",
    "model.fix": "model.kind torch: tests/test_fixes.py (validate --check-model; the fixed "
                 "model against the per-example loop)",
    "data.label_kind": "real and multi_hot: tests/test_label_kinds.py (a regression and a "
                       "multi-label run on 2 workers, predict)",
    "data.max_rows": "tests/test_max_rows.py (a run on 2 workers)",
    "run.loggers": "tests/test_trackers.py (a run and a 2-trial sweep, the files read back)",
    "run.mlflow_tracking_uri": "tests/test_trackers.py (a local MLflow file store)",
}


def churn(rows: int, seed: int, string_type) -> pa.Table:
    """A churn table as a user has it: raw columns far from unit scale, yes/no labels."""
    rng = np.random.default_rng(seed)
    age = rng.integers(18, 80, rows)
    spend = rng.normal(50, 20, rows)
    churned = np.where(spend + rng.normal(0, 5, rows) > 50, "yes", "no")
    return pa.table({"age": pa.array(age), "spend": pa.array(spend),
                     "churn": pa.array(churned.tolist(), string_type)})


def digit_tensors(rows: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, rows)
    images = rng.normal(0, 1, (rows, 1, 6, 6)) + labels[:, None, None, None]
    return pa.table({"image": pa.array(images.tolist()), "label": pa.array(labels)})


def sentences(rows: int) -> pa.Table:
    return pa.table({"sentence": [f"a {'good' if i % 2 else 'dull'} film, number {i}"
                                  for i in range(rows)],
                     "label": [i % 2 for i in range(rows)]})


def write_files(folder: Path) -> Path:
    """The tables the documented runs read (each run with a test file is one that
    tests/test_predict.py predicts on)."""
    pq.write_table(churn(300, 0, pa.large_string()), folder / "churn_train.parquet")  # pandas'
    pq.write_table(churn(100, 1, pa.string()), folder / "churn_test.parquet")
    pq.write_table(churn(60, 2, pa.string()), folder / "churn_dev.parquet")
    pq.write_table(digit_tensors(180, 3), folder / "tensors.parquet")
    pq.write_table(digit_tensors(60, 4), folder / "tensors_test.parquet")
    pq.write_table(sentences(64), folder / "text.parquet")
    pq.write_table(sentences(40), folder / "text_test.parquet")
    return folder


def runs(files: Path, out: Path) -> dict[str, dict]:
    """Tiny pipelines that together set every field of the reference (RUN_ELSEWHERE aside)."""
    privacy = {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-4}
    return {
        "churn": {
            "name": "churn",
            "data": {"source": "parquet", "path": str(files / "churn_train.parquet"),
                     "test_path": str(files / "churn_test.parquet"),
                     "feature_columns": ["age", "spend"], "label_column": "churn",
                     "label_names": ["no", "yes"], "normalize": {"age": [50, 20]},
                     "validation": {"path": str(files / "churn_dev.parquet"), "private": True,
                                    "noise_multiplier": 2.0}},
            "model": {"kind": "mlp", "hidden_sizes": [8], "activation": "tanh",
                      "num_classes": 2},
            "privacy": {"noise_multiplier": 1.2, "clip_norm": 0.5, "delta": 1e-4,
                        "accountant": "pld",
                        "self_check": {"enabled": True, "examples": 3, "step_fraction": 0.5}},
            "training": {"epochs": 2, "batch_size": 40, "max_physical_batch": 16,
                         "optimizer": "adamw", "lr": 0.02, "weight_decay": 0.01,
                         "param_groups": [{"params": ["1.*"], "lr": 0.05,
                                           "weight_decay": 0.0}],
                         "schedule": "cosine", "warmup_steps": 2, "ema_decay": 0.8,
                         "workers": 2, "placement": "spread", "threads_per_worker": 1},
            "run": {"output_dir": str(out / "churn"), "seed": 7, "max_failures": 1,
                    "keep_checkpoints": 1, "on_interrupted": "refuse"},
            "budget": {"name": "documented", "epsilon": 40.0, "delta": 1e-4,
                       "accountant": "pld", "ledger": str(out / "ledger"),
                       "persist_across_jobs": False},
        },
        "tensors-cnn": {
            "name": "tensors-cnn",
            "data": {"source": "parquet", "path": str(files / "tensors.parquet"),
                     "test_path": str(files / "tensors_test.parquet"), "tensor_column": "image",
                     "validation": {"fraction": 0.2, "private": False}},
            "model": {"kind": "cnn", "channels": [4], "kernel_size": 3, "hidden_size": 8,
                      "num_classes": 3},
            "privacy": {"target_epsilon": 8.0, "clip_norm": 1.0, "delta": 1e-4,
                        "mechanism": "dpsgd", "other_layers": "refuse"},
            "training": {"epochs": 1, "batch_size": 30, "optimizer": "SGD", "momentum": 0.9,
                         "optimizer_options": {"foreach": True, "nesterov": True},
                         "lr": 0.05, "schedule": "linear", "warmup_fraction": 0.2,
                         "precision": "bf16"},
            "run": {"output_dir": str(out / "tensors"), "noise": "secure"},
        },
        "synthetic-lsg": {
            "name": "synthetic-lsg",
            "data": {"source": "synthetic", "n_samples": 300, "n_features": 12,
                     "n_informative": 4, "n_redundant": 2, "flip_y": 0.01, "random_state": 3,
                     "train_fraction": 0.7},
            "model": {"kind": "mlp", "hidden_sizes": [16]},
            "privacy": {**privacy, "mechanism": "lsg", "clipping": "automatic",
                        "stability": 0.02,
                        "lsg": {"rank": 2, "sparsity": 0.25, "layers": ["1"],
                                "train_other": "freeze", "refresh_every": 2,
                                "sparsity_start_epoch": 1}},
            "training": {"epochs": 2, "batch_size": 30, "lr": 0.1},
            "run": {"output_dir": str(out / "lsg")},
        },
        "digits-lora": {
            "name": "digits-lora",
            "data": {"source": "sklearn_digits", "train_fraction": 0.8, "random_state": 1},
            "model": {"kind": "mlp", "hidden_sizes": [16]},
            "privacy": {**privacy, "mechanism": "lora", "clipping": "adaptive",
                        "adaptive": {"target_quantile": 0.6, "learning_rate": 0.3,
                                     "count_noise": 4.0},
                        "lora": {"rank": 2, "alpha": 4.0, "dropout": 0.0, "layers": None,
                                 "train_other": "dpsgd"},
                        "self_check": {"enabled": False}},
            "training": {"epochs": 1, "batch_size": 100, "lr": 0.1},
            "run": {"output_dir": str(out / "lora")},
        },
        "text-hf": {
            "name": "text-hf",
            "data": {"source": "parquet", "path": str(files / "text.parquet"),
                     "test_path": str(files / "text_test.parquet"), "text_column": "sentence",
                     "max_length": 8},
            "model": {"kind": "hf", "name_or_path": MINILM, "config": TINY_BERT,
                      "num_labels": 2, "pooling": "mean", "normalize": True,
                      "head_init": "zeros", "trainable": {"last_k_layers": 1},
                      "frozen_dtype": "bf16", "dropout": 0.0},
            "privacy": privacy,
            "training": {"epochs": 1, "batch_size": 16, "lr": 0.1,
                         "cache_frozen_prefix": True, "trim_padding": True},
            "run": {"output_dir": str(out / "text")},
        },
        "nonprivate": {
            "name": "nonprivate",
            "data": {"source": "synthetic", "n_samples": 200},
            "model": {"kind": "logistic"},
            "privacy": {"mechanism": "none", "delta": 1e-4},
            "training": {"epochs": 1, "batch_size": 20},
            "run": {"output_dir": str(out / "nonprivate")},
        },
    }


def field_paths(value, prefix: str = "") -> set[str]:
    """The field paths a pipeline dict sets (list entries' fields without their index)."""
    paths = set()
    if isinstance(value, list):
        for entry in value:
            paths |= field_paths(entry, prefix)
    elif isinstance(value, dict):
        for key, inner in value.items():
            path = f"{prefix}{key}"
            if not prefix.endswith(("normalize.",)):
                paths.add(path)
            if key not in ("normalize", "config", "optimizer_options"):  # keyed by the user
                paths |= field_paths(inner, f"{path}.")
    return paths


def test_the_runs_set_every_documented_field(tmp_path):
    set_by_runs = set().union(*(field_paths(p) for p in runs(tmp_path, tmp_path).values()))
    documented = schema_fields(Pipeline)
    missing = sorted(path for path in documented - set_by_runs
                     if not any(path == f or path.startswith(f"{f}.") for f in RUN_ELSEWHERE))
    assert not missing, f"no run here sets: {', '.join(missing)}"
    assert set_by_runs <= documented | {"data.validation.path"}, set_by_runs - documented


@pytest.mark.parametrize("name", ["churn", "tensors-cnn", "synthetic-lsg", "digits-lora",
                                  "text-hf", "nonprivate"])
def test_each_documented_field_runs(name, documented_run):
    run_dir, output = documented_run(name)
    record = json.loads((run_dir / "record.json").read_text())
    assert record["privacy"]["steps"] > 0 and record["metrics"]
    assert "Traceback" not in output
    if name == "churn":  # string labels of both Arrow types, mapped on both workers
        assert sum(record["training"]["training_rows_per_worker"]) == 300
        assert 0.0 <= record["metrics"][-1]["test_accuracy"] <= 1.0
        assert "validation_accuracy" in record["metrics"][-1]
        import torch

        from raydp_train.train.context import STATE_FILE, newest_checkpoint

        state = torch.load(newest_checkpoint(run_dir) / STATE_FILE, weights_only=False)
        assert state["average"]["decay"] == 0.8  # the weight average, in the checkpoint
        assert sorted(tuple(a.shape) for a in state["average"]["average"]) == sorted(
            tuple(weights.shape) for weights in state["model"].values())
    if name == "digits-lora":  # adaptive clipping moved C from clip_norm, saved with the state
        import torch

        from raydp_train.train.context import STATE_FILE, newest_checkpoint

        state = torch.load(newest_checkpoint(run_dir) / STATE_FILE, weights_only=False)
        assert record["training"]["clipping"] == "adaptive" and state["clip_norm"] != 1.0


# `raydp-train predict` and `load_model` on each model kind as a documented run
# leaves it: rebuilt from the run directory, on the test file the run scored.
KINDS = {"mlp-string-labels": ("churn", "churn_test.parquet"),
         "cnn-tensors": ("tensors-cnn", "tensors_test.parquet"),
         "hf-mean-pooled": ("text-hf", "text_test.parquet")}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.slow
def test_predict_reproduces_the_runs_test_accuracy(kind, documented_run, tmp_path, capsys):
    name, test_name = KINDS[kind]
    run_dir, _ = documented_run(name)
    pipeline = yaml.safe_load((run_dir / "pipeline.yaml").read_text())
    test_file = Path(pipeline["data"]["test_path"])
    assert test_file.name == test_name
    test = pq.read_table(test_file)
    recorded = json.loads((run_dir / "record.json").read_text())["metrics"][-1]["test_accuracy"]
    result = predict(run_dir, test_file)
    # Rows whose two best logits tie within rounding may flip between the run's evaluation
    # (its batches, trimmed padding, cached prefix) and predict's; every other row must agree.
    # A bf16 frozen base rounds to 2**-8 of each value, float32 to about 1e-7.
    relative = 2.0 ** -5 if pipeline["model"].get("frozen_dtype") == "bf16" else 1e-5
    best_two = np.sort(result.outputs, axis=1)[:, -2:]
    tolerance = relative * float(np.abs(result.outputs).max())
    near_ties = int((best_two[:, 1] - best_two[:, 0] < tolerance).sum())
    assert abs(result.accuracy - recorded) <= near_ties / test.num_rows + 1e-6
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
