"""The trackers Ray users read (`run.loggers`): each epoch's row, with epsilon by both
accountants and the global budget's epsilon left, also goes to

- `csv`: `<run_dir>/metrics.csv`, one line per epoch;
- `tensorboard`: TensorBoard event files in `<run_dir>/tensorboard/` (tensorboardX);
- `mlflow`: one MLflow run per run, in the experiment named like the pipeline, at
  `run.mlflow_tracking_uri` (else $MLFLOW_TRACKING_URI, else a file store `<output_dir>/mlruns`).

A run logs from the driver as its epochs arrive. A sweep logs every trial through Ray Tune's
own logger callbacks (`tune_callbacks`: progress.csv and TensorBoard events in each trial's
folder, an MLflow run per trial).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import time
from pathlib import Path

from raydp_train.config.pipeline import Pipeline, PipelineError

# The package each logger needs (installed by the extras raydp-train[tensorboard|mlflow]).
PACKAGES = {"tensorboard": "tensorboardX", "mlflow": "mlflow"}
EXTRAS = {"tensorboard": "tensorboard", "mlflow": "mlflow"}
# A run's status as MLflow ends its run (interrupted, nothing trained: KILLED).
MLFLOW_STATUS = {"completed": "FINISHED", "stopped": "FINISHED", "failed": "FAILED"}


def check_loggers(pipeline: Pipeline, source: str) -> None:
    """Every logger asked for can be imported: refused by name before anything is spent."""
    for logger in pipeline.run.loggers:
        package = PACKAGES.get(logger)
        if package is not None and importlib.util.find_spec(package) is None:
            problem = (f"run.loggers: {logger} needs the {package} package, which is not "
                       f"installed: pip install 'raydp-train[{EXTRAS[logger]}]'")
            raise PipelineError(source, [problem])


def tracking_uri(pipeline: Pipeline) -> str:
    """Where MLflow runs go; a local file store is allowed explicitly (MLflow 3 keeps it in
    maintenance mode and refuses it unless told)."""
    uri = (pipeline.run.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
           or (Path(pipeline.run.output_dir).resolve() / "mlruns").as_uri())
    if uri.startswith("file:") or "://" not in uri:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return uri


def numeric(row: dict) -> dict[str, float]:
    """The row's numbers (what a tracker plots), the epoch left out: it is the step axis."""
    return {key: float(value) for key, value in row.items()
            if isinstance(value, int | float) and not isinstance(value, bool) and key != "epoch"}


class RunTrackers:
    """The writers of one run, fed each epoch's row on the driver."""

    def __init__(self, pipeline: Pipeline, run_dir: Path, plan):
        self.loggers = pipeline.run.loggers
        self.run_dir = run_dir
        self._csv_columns: list[str] | None = None
        self._tensorboard = self._mlflow = self._mlflow_run = None
        if "tensorboard" in self.loggers:
            from tensorboardX import SummaryWriter

            self._tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        if "mlflow" in self.loggers:
            self._open_mlflow(pipeline, plan)

    def log(self, row: dict) -> None:
        metrics, epoch = numeric(row), int(row["epoch"])
        if "csv" in self.loggers:
            self._write_csv({"epoch": epoch, **metrics})
        if self._tensorboard is not None:
            for key, value in metrics.items():
                self._tensorboard.add_scalar(key, value, global_step=epoch)
            self._tensorboard.flush()
        if self._mlflow is not None:
            from mlflow.entities import Metric

            stamp = int(time.time() * 1000)
            self._mlflow.log_batch(self._mlflow_run, metrics=[
                Metric(key, value, stamp, epoch) for key, value in metrics.items()])

    def close(self, status: str) -> None:
        """`status`: the run's (completed, stopped, interrupted, failed)."""
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._mlflow is not None:
            self._mlflow.set_tag(self._mlflow_run, "raydp_train.status", status)
            self._mlflow.set_terminated(self._mlflow_run, MLFLOW_STATUS.get(status, "KILLED"))

    def _write_csv(self, values: dict) -> None:
        path = self.run_dir / "metrics.csv"
        if self._csv_columns is None:
            # A resumed run appends to the lines its first attempt wrote.
            self._csv_columns = (next(csv.reader(path.open())) if path.is_file()
                                 else list(values))
            if not path.is_file():
                with path.open("w", newline="") as file:
                    csv.writer(file).writerow(self._csv_columns)
        with path.open("a", newline="") as file:
            csv.DictWriter(file, self._csv_columns, extrasaction="ignore").writerow(values)

    def _open_mlflow(self, pipeline: Pipeline, plan) -> None:
        from mlflow.tracking import MlflowClient

        self._mlflow = MlflowClient(tracking_uri(pipeline))
        experiment = self._mlflow.get_experiment_by_name(pipeline.name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self._mlflow.create_experiment(pipeline.name))
        run = self._mlflow.create_run(experiment_id, run_name=self.run_dir.name,
                                      tags={"raydp_train.run_dir": str(self.run_dir)})
        self._mlflow_run = run.info.run_id
        for key, value in _plan_params(plan).items():
            self._mlflow.log_param(self._mlflow_run, key, value)


def tune_callbacks(pipeline: Pipeline) -> list:
    """Ray Tune's own logger callbacks for the loggers asked for: every trial is logged."""
    callbacks = []
    if "csv" in pipeline.run.loggers:
        from ray.tune.logger import CSVLoggerCallback

        callbacks.append(CSVLoggerCallback())
    if "tensorboard" in pipeline.run.loggers:
        from ray.tune.logger import TBXLoggerCallback

        callbacks.append(TBXLoggerCallback())
    if "mlflow" in pipeline.run.loggers:
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        callbacks.append(MLflowLoggerCallback(tracking_uri(pipeline),
                                              experiment_name=pipeline.name))
    return callbacks


def _plan_params(plan) -> dict:
    return {"sampling_rate": plan.sampling_rate, "noise_multiplier": plan.noise_multiplier,
            "clip_norm": plan.clip_norm, "delta": plan.delta, "planned_steps": plan.steps,
            "mechanism": plan.mechanism.name, "accountant": plan.accountant}
