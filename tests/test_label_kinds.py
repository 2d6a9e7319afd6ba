"""Labels that are not class ids: `data.label_kind` real (regression) and multi_hot
(multi-label). The default losses' clipped sums equal one backward pass per example (float64,
< 1e-9); the metrics and baselines equal numpy's; bad label columns and settings that cannot
be private are refused by name; a regression (JSON lines) and a multi-label run (Parquet,
noisy validation releases) train on 2 Ray Train workers, spend what dp-accounting says, and
`predict` gives back the run's own test metrics."""

import json
from pathlib import Path

import dp_accounting
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from oracles import assert_engine_is_the_per_example_loop

import raydp_train as rt
from raydp_train.commands.audit import check_auditable
from raydp_train.data.sources import load_data
from raydp_train.data.targets import LABEL_KINDS
from raydp_train.errors import DataError, UserError
from raydp_train.models.custom import training_loss

# Two real targets, linear in 4 features plus a little noise.
WEIGHTS = np.array([[1.0, -0.5, 0.0, 0.3], [0.0, 0.8, 0.6, 0.0]])


def regression_rows(rows: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (rows, 4))
    y = x @ WEIGHTS.T + rng.normal(0, 0.1, (rows, 2))
    return [{"a": a, "b": b, "c": c, "d": d, "target": list(t)}
            for (a, b, c, d), t in zip(x.tolist(), y.tolist(), strict=True)]


def multi_label_table(rows: int, seed: int) -> pa.Table:
    """Three tags per row, each a threshold of the 6 features."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (rows, 6))
    tags = np.stack([x[:, 0] > 0, x[:, 1] + x[:, 2] > 0, x[:, 3] < 0.5], 1).astype(int)
    return pa.table({"features": pa.array(x.tolist()), "tags": pa.array(tags.tolist())})


def write_json_lines(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("label_kinds")
    write_json_lines(regression_rows(2000, 0), folder / "reg_train.jsonl")
    write_json_lines(regression_rows(500, 1), folder / "reg_test.jsonl")
    pq.write_table(multi_label_table(2000, 0), folder / "multi_train.parquet")
    pq.write_table(multi_label_table(500, 1), folder / "multi_test.parquet")
    return folder


def regression(files: Path, out: Path, **data) -> dict:
    return {"name": "regression",
            "data": {"source": "json", "path": str(files / "reg_train.jsonl"),
                     "test_path": str(files / "reg_test.jsonl"),
                     "feature_columns": ["a", "b", "c", "d"], "label_column": "target",
                     "label_kind": "real", **data},
            "model": {"kind": "mlp", "hidden_sizes": [16]},
            "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-5},
            "training": {"epochs": 3, "batch_size": 200, "lr": 0.5, "workers": 2},
            "run": {"seed": 0, "output_dir": str(out)}}


def multi_label(files: Path, out: Path, **data) -> dict:
    return {"name": "tags",
            "data": {"source": "parquet", "path": str(files / "multi_train.parquet"),
                     "test_path": str(files / "multi_test.parquet"),
                     "tensor_column": "features", "label_column": "tags",
                     "label_kind": "multi_hot",
                     "validation": {"fraction": 0.2, "noise_multiplier": 4.0}, **data},
            "model": {"kind": "mlp", "hidden_sizes": [16]},
            "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-5},
            "training": {"epochs": 3, "batch_size": 200, "lr": 0.5, "workers": 2},
            "run": {"seed": 0, "output_dir": str(out)}}


# --- the math, without Ray ---------------------------------------------------------------------

@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("clip_norm", [1e-3, 1e3])  # every example clipped; none
@pytest.mark.parametrize("kind", ["real", "multi_hot"])
def test_the_default_losses_clipped_sums_are_the_per_example_loops(kind, clip_norm, files):
    torch.manual_seed(0)
    pipeline = rt.Pipeline.from_dict(regression(files, files) if kind == "real"
                                     else multi_label(files, files))
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    labels_kind = LABEL_KINDS[kind]
    losses = training_loss(pipeline.model, labels_kind)
    inputs = torch.randn(7, 5)
    labels = labels_kind.example_labels(7, 3, torch.Generator().manual_seed(1))
    assert labels.dtype == torch.float64 and labels.shape == (7, 3)
    assert_engine_is_the_per_example_loop(model, losses, inputs, labels, clip_norm)


def test_the_default_losses_are_the_textbook_ones():
    generator = torch.Generator().manual_seed(0)
    outputs, targets = torch.randn(6, 3, generator=generator), torch.randn(6, 3,
                                                                          generator=generator)
    squared = LABEL_KINDS["real"].loss(outputs, targets)
    assert torch.allclose(squared, ((outputs - targets) ** 2).mean(1))
    tags = (targets > 0).float()
    p = torch.sigmoid(outputs)
    by_hand = -(tags * torch.log(p) + (1 - tags) * torch.log(1 - p)).mean(1)
    assert torch.allclose(LABEL_KINDS["multi_hot"].loss(outputs, tags), by_hand, atol=1e-6)


def test_the_metrics_and_baselines_equal_numpys_and_add_over_ranks():
    rng = np.random.default_rng(0)
    outputs, values = rng.normal(size=(40, 3)), rng.normal(1.0, 2.0, size=(40, 3))
    tags = (rng.random((40, 3)) < [0.2, 0.5, 0.9]).astype(np.float32)
    real, multi = LABEL_KINDS["real"], LABEL_KINDS["multi_hot"]

    def over_two_ranks(kind, labels, method):
        halves = [method(torch.tensor(outputs[rows]), torch.tensor(labels[rows]))
                  for rows in (slice(0, 17), slice(17, None))]
        return [a + b for a, b in zip(*halves, strict=True)]

    sums = over_two_ranks(real, values, real.score)
    assert real.metrics(sums, "test")["test_mse"] == pytest.approx(
        np.mean((outputs - values) ** 2), rel=1e-12)
    baseline_sums = torch.cat([real.baseline_sums(torch.tensor(values[:17]), 3).reshape(1, -1),
                               real.baseline_sums(torch.tensor(values[17:]), 3).reshape(1, -1)])
    assert real.baselines(baseline_sums.sum(0).tolist())["test_mean_prediction_mse"] == (
        pytest.approx(np.var(values, axis=0).mean(), rel=1e-9))

    sums = over_two_ranks(multi, tags, multi.score)
    right = (outputs > 0) == (tags > 0.5)
    assert multi.metrics(sums, "test") == {
        "test_accuracy": pytest.approx(right.all(1).mean()),
        "test_label_accuracy": pytest.approx(right.mean())}
    assert multi.released_count(sums) == (right.all(1).sum(), 40)  # at most 1 per example
    shares = tags.mean(0)
    assert multi.baselines(multi.baseline_sums(torch.tensor(tags), 3).tolist()) == {
        "test_majority_per_label": pytest.approx(np.maximum(shares, 1 - shares).mean())}
    assert (multi.predict(torch.tensor(outputs)).numpy() == (outputs > 0)).all()


def test_real_labels_read_as_numbers_or_lists_of_numbers(tmp_path, files):
    pipeline = rt.Pipeline.from_dict(regression(files, tmp_path))
    dataset = load_data(pipeline.data)
    assert dataset.train_labels.shape == (2000, 2) and dataset.num_classes == 2
    assert dataset.train_labels.dtype == np.float32
    expected = np.array([row["target"] for row in regression_rows(500, 1)], np.float32)
    assert np.array_equal(dataset.test_labels, expected)
    scalar = tmp_path / "scalar.parquet"
    pq.write_table(pa.table({"x": [0.1, 0.2, 0.3, 0.4, 0.5], "y": [1, 2, 3, 4, 5]}), scalar)
    one = rt.Pipeline.from_dict({**regression(files, tmp_path), "data": {
        "source": "parquet", "path": str(scalar), "feature_columns": ["x"],
        "label_column": "y", "label_kind": "real", "train_fraction": 0.6}})
    assert load_data(one.data).num_classes == 1


USER_CODE = """\
import torch.nn.functional as F
from torch import nn

def linear(feature_shape, num_classes):
    return nn.Linear(feature_shape[0], num_classes)

def huber(outputs, labels):
    return F.huber_loss(outputs, labels, reduction="none").sum(1)

def huber_mean(outputs, labels):
    return F.huber_loss(outputs, labels)
"""


@pytest.mark.parametrize("loss", ["huber", "huber_mean"])
def test_a_users_own_model_and_loss_get_the_real_labels(loss, files, tmp_path):
    (tmp_path / "user.py").write_text(USER_CODE)
    raw = regression(files, tmp_path)
    raw["model"] = {"kind": "torch", "factory": f"{tmp_path}/user.py:linear",
                    "loss": f"{tmp_path}/user.py:{loss}"}
    pipeline = rt.Pipeline.from_dict(raw)
    if loss == "huber_mean":  # a mean over the batch is refused before anything is spent
        with pytest.raises(UserError, match="must return one loss per example"):
            rt.validate(pipeline, check_model=True)
        return
    assert rt.validate(pipeline, check_model=True).steps == 30
    model = torch.nn.Linear(4, 2)
    outputs, labels = torch.randn(5, 4), torch.randn(5, 2)
    expected = torch.nn.functional.huber_loss(model(outputs), labels, reduction="none").sum(1)
    got = training_loss(pipeline.model, LABEL_KINDS["real"])(model, outputs, labels)
    assert torch.equal(got, expected)


BAD_LABELS = {
    "a multi_hot 2": ("multi_hot", [[0, 1], [2, 0], [1, 1]], "must hold lists of 0/1"),
    "ragged": ("real", [[0.5, 1.0], [0.5], [1.0, 2.0]], "must hold equal-length numbers"),
    "a null": ("real", [1.0, None, 2.0], "has 1 null values"),
    "a NaN": ("real", [1.0, float("nan"), 2.0], "has NaN or infinite values"),
    "strings": ("real", ["1", "2", "3"], "is string, expected numbers"),
}


@pytest.mark.parametrize("case", list(BAD_LABELS))
def test_a_label_column_unlike_its_kind_is_refused_naming_column_and_file(case, tmp_path, files):
    kind, labels, message = BAD_LABELS[case]
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"x": [0.1, 0.2, 0.3], "y": labels}), path)
    pipeline = rt.Pipeline.from_dict({**regression(files, tmp_path), "data": {
        "source": "parquet", "path": str(path), "test_path": str(path),
        "feature_columns": ["x"], "label_column": "y", "label_kind": kind}})
    with pytest.raises(DataError) as refused:
        load_data(pipeline.data)
    assert message in str(refused.value) and "'y'" in str(refused.value)
    assert str(path) in str(refused.value)


def test_a_model_width_unlike_the_labels_is_refused_by_field(files, tmp_path):
    raw = regression(files, tmp_path)
    raw["model"]["num_classes"] = 3
    with pytest.raises(DataError, match=r"model.num_classes: 3 outputs, but data.label_column "
                                        r"holds 2 values per row \(data.label_kind real\)"):
        rt.validate(rt.Pipeline.from_dict(raw))


SETTINGS_REFUSED = {
    "real validation": (lambda raw: raw["data"].update(validation={"fraction": 0.2}),
                        "data.validation: not with label_kind real yet"),
    "multi_hot names": (lambda raw: raw["data"].update(label_names=["a", "b", "c"]),
                        "data.label_names: not with label_kind multi_hot"),
}


@pytest.mark.parametrize("case", list(SETTINGS_REFUSED))
def test_settings_that_do_not_fit_the_label_kind_are_refused_before_anything_is_spent(
        case, files, tmp_path):
    change, message = SETTINGS_REFUSED[case]
    raw = regression(files, tmp_path) if case.startswith("real") else multi_label(files,
                                                                                  tmp_path)
    change(raw)
    with pytest.raises(UserError, match=message):
        rt.Pipeline.from_dict(raw)


def test_the_canary_audit_refuses_labels_that_are_not_classes(files, tmp_path):
    pipeline = rt.Pipeline.from_dict(regression(files, tmp_path))
    with pytest.raises(UserError, match="data.label_kind: the audit's canary is a class-id row"):
        check_auditable(pipeline.model_copy(update={"model": pipeline.model.model_copy(
            update={"kind": "logistic"})}), 8)


# --- runs on 2 Ray Train workers -------------------------------------------------------------

def rdp_epsilon(q: float, sigma: float, steps: int, delta: float, releases=()) -> float:
    events = [dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)]
    events += [dp_accounting.GaussianDpEvent(release) for release in releases]
    accountant = dp_accounting.rdp.RdpAccountant()
    return accountant.compose(dp_accounting.ComposedDpEvent(events)).get_epsilon(delta)


def test_a_regression_from_json_lines_trains_on_two_workers(ray_session, files, tmp_path):
    result = rt.run(rt.Pipeline.from_dict(regression(files, tmp_path)), on_line=None,
                    on_epoch=None, on_progress=None)
    record = json.loads(result.record.read_text())
    assert len(record["training"]["training_rows_per_worker"]) == 2
    final, mean_mse = result.metrics[-1], record["baselines"]["test_mean_prediction_mse"]
    truth = np.array([row["target"] for row in regression_rows(500, 1)])
    assert mean_mse == pytest.approx(np.var(truth, axis=0).mean(), rel=1e-5)
    assert final["test_mse"] < 0.25 * mean_mse  # learned the linear map, under the noise
    assert result.epsilon == pytest.approx(rdp_epsilon(0.1, 1.0, 30, 1e-5), rel=1e-9)
    predicted = rt.predict(result.run_dir, files / "reg_test.jsonl")
    assert predicted.classes.shape == (500, 2)
    assert predicted.metrics["mse"] == pytest.approx(final["test_mse"], rel=1e-5)
    assert predicted.metrics["mse"] == pytest.approx(
        np.mean((predicted.classes - truth) ** 2), rel=1e-4)


def test_a_multi_label_run_releases_validation_and_trains_on_two_workers(ray_session, files,
                                                                         tmp_path):
    result = rt.run(rt.Pipeline.from_dict(multi_label(files, tmp_path)), on_line=None,
                    on_epoch=None, on_progress=None)
    record = json.loads(result.record.read_text())
    final = result.metrics[-1]
    assert set(final) >= {"test_accuracy", "test_label_accuracy", "validation_accuracy"}
    assert final["test_label_accuracy"] > record["baselines"]["test_majority_per_label"]
    # 1600 training rows (a fifth held out), q = 200/1600; three noisy validation releases.
    assert result.epsilon == pytest.approx(
        rdp_epsilon(0.125, 1.0, 24, 1e-5, releases=[4.0] * 3), rel=1e-9)
    predicted = rt.predict(result.run_dir, files / "multi_test.parquet")
    assert set(np.unique(predicted.classes)) <= {0, 1} and predicted.classes.shape == (500, 3)
    assert predicted.metrics["accuracy"] == pytest.approx(final["test_accuracy"], abs=1e-9)
    assert predicted.metrics["label_accuracy"] == pytest.approx(final["test_label_accuracy"],
                                                                abs=1e-9)
