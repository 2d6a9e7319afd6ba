"""run.loggers: a run and a 2-trial sweep write CSV, TensorBoard and MLflow files
that read back with epsilon per epoch (dp-accounting's) and the budget left; a logger whose
package is missing is refused by name before anything is spent."""

import csv
import struct
from pathlib import Path

import dp_accounting
import pytest
import yaml

import raydp_train as rt

ROOT = Path(__file__).parents[1]
LOGGERS = ["csv", "tensorboard", "mlflow"]


def _dp_accounting_epsilons(rate: float, sigma: float, steps: int) -> tuple[float, float]:
    """(RDP, PLD) epsilon at delta 1e-5 of `steps` Poisson-sampled Gaussian steps."""
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        rate, dp_accounting.GaussianDpEvent(sigma)), steps)
    rdp = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
    pld = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(1e-5)
    return rdp, pld


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every event file under `folder`, read record by record
    (TFRecord framing: length, its CRC, the Event proto, its CRC)."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    for path in folder.rglob("events.out.tfevents.*"):
        data = path.read_bytes()
        while data:
            (length,) = struct.unpack("<Q", data[:8])
            event = event_pb2.Event.FromString(data[12:12 + length])
            data = data[12 + length + 4:]
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def mlflow_runs(uri: str, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return client, client.search_runs([found.experiment_id])


def test_a_run_logs_each_epoch_with_both_epsilons_and_the_budget_left(ray_session, tmp_path):
    uri = (tmp_path / "mlruns").as_uri()
    pipeline = rt.Pipeline.from_yaml(ROOT / "pipelines/quickstart.yaml", overrides=[
        "training.epochs=3", f"run.output_dir={tmp_path / 'runs'}", f"run.loggers={LOGGERS}",
        f"run.mlflow_tracking_uri={uri}", "budget.name=tracked", "budget.epsilon=10",
        "budget.delta=1e-5", f"budget.ledger={tmp_path / 'ledger'}"])
    result = rt.run(pipeline, on_line=None, on_epoch=None)
    assert result.status == "completed"
    with (result.run_dir / "metrics.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [int(row["epoch"]) for row in rows] == [1, 2, 3]
    assert [int(float(row["steps_charged"])) for row in rows] == [12, 25, 37]
    for row in rows:
        rdp, pld = _dp_accounting_epsilons(64 / 800, 2.0, int(float(row["steps_charged"])))
        assert float(row["epsilon_rdp"]) == pytest.approx(rdp, rel=1e-9)
        assert float(row["epsilon_pld"]) == pytest.approx(pld, rel=1e-6)
        assert float(row["budget_epsilon_left"]) == pytest.approx(10 - rdp, rel=1e-6)
    scalars = tensorboard_scalars(result.run_dir / "tensorboard")
    for name in ("epsilon_rdp", "epsilon_pld", "budget_epsilon_left", "test_accuracy"):
        assert scalars[name] == pytest.approx({int(r["epoch"]): float(r[name]) for r in rows},
                                              rel=1e-6), name
    client, (run,) = mlflow_runs(uri, "quickstart")
    assert run.info.status == "FINISHED" and run.data.params["noise_multiplier"] == "2.0"
    history = client.get_metric_history(run.info.run_id, "epsilon_pld")
    assert {m.step: m.value for m in history} == pytest.approx(
        {int(r["epoch"]): float(r["epsilon_pld"]) for r in rows}, rel=1e-9)


def test_a_two_trial_sweep_logs_every_trial_through_tunes_callbacks(ray_session, tmp_path):
    raw = yaml.safe_load((ROOT / "pipelines/sweep_digits.yaml").read_text())
    uri = (tmp_path / "mlruns").as_uri()
    raw["training"]["epochs"] = 2
    raw["run"] = {"output_dir": str(tmp_path / "runs"), "loggers": LOGGERS,
                  "mlflow_tracking_uri": uri}
    # A name of its own: the session's Ray keeps one accountant actor per budget name.
    raw["budget"].update(name="tracked-sweep", ledger=str(tmp_path / "ledger"))
    raw["tune"].update(num_samples=1, max_concurrent_trials=1,
                       search_space={"privacy.noise_multiplier": {"grid": [1.5, 3.0]}})
    sweep = rt.tune(rt.Pipeline.from_dict(raw), on_line=None)
    assert len(sweep.trials) == 2 and len(sweep.result_grid) == 2  # and Tune's ResultGrid
    assert {result.config["privacy.noise_multiplier"] for result in sweep.result_grid} == {1.5, 3.0}
    progress = sorted((sweep.directory / "trials").glob("*/progress.csv"))
    assert len(progress) == 2
    for path in progress:
        with path.open() as file:
            rows = [row for row in csv.DictReader(file) if row["epoch"] in ("1", "2")]
        assert [row["epoch"] for row in rows][:2] == ["1", "2"]
        for row in rows:  # RDP is the pipeline's accountant: its epsilon column
            assert float(row["epsilon_rdp"]) == pytest.approx(float(row["epsilon"]), rel=1e-9)
            assert 0 < float(row["epsilon_pld"]) < float(row["epsilon_rdp"])
        lefts = [float(row["budget_epsilon_left"]) for row in rows[:2]]
        assert 10 > lefts[0] > lefts[1] > 0
        scalars = tensorboard_scalars(path.parent)
        logged = {value for tag, steps in scalars.items() if tag.endswith("epsilon_pld")
                  for value in steps.values()}
        for row in rows[:2]:
            assert any(value == pytest.approx(float(row["epsilon_pld"]), rel=1e-6)
                       for value in logged), row["epoch"]
    client, runs = mlflow_runs(uri, "sweep-digits")
    assert len(runs) == 2
    sigmas = sorted(float(run.data.params["privacy.noise_multiplier"]) for run in runs)
    assert sigmas == [1.5, 3.0]
    for run in runs:
        history = client.get_metric_history(run.info.run_id, "epsilon_pld")
        assert len({m.value for m in history}) >= 2  # one value per epoch, growing


def test_a_logger_without_its_package_is_refused_before_anything_is_spent(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mlflow" else real(name, *a))
    pipeline = rt.Pipeline.from_yaml(ROOT / "pipelines/quickstart.yaml",
                                     overrides=["run.loggers=[csv, mlflow]"])
    with pytest.raises(rt.UserError, match=r"run.loggers: mlflow needs the mlflow package.*"
                                           r"raydp-train\[mlflow\]"):
        rt.validate(pipeline)
