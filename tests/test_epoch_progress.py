"""Progress within a long epoch (issue 31): rank 0 shows where it is every PROGRESS_EVERY_S
seconds, the driver prints it apart from the epoch rows, with the time left. No Ray: the loop
in this process with a context that keeps what it shows, and the driver's printer fed by a
queue stand-in."""

import threading

from ray.util.queue import Empty

from raydp_train.commands.console import progress_printer
from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.train import trainer, worker
from raydp_train.train.context import LocalContext
from raydp_train.train.plan import make_plan


class ShowingContext(LocalContext):
    def __init__(self):
        super().__init__(on_epoch=lambda row: None)
        self.shown = []

    def show_progress(self, row: dict) -> None:
        self.shown.append(row)


def test_the_loop_shows_its_place_within_each_epoch(monkeypatch):
    monkeypatch.setattr(worker, "PROGRESS_EVERY_S", 0.0)  # every step
    pipeline = pipeline_from_dict({
        "name": "progress", "data": {"source": "synthetic", "n_samples": 200},
        "model": {"kind": "logistic"}, "privacy": {"noise_multiplier": 1.0, "delta": 1e-4},
        "training": {"epochs": 2, "batch_size": 40}, "run": {"seed": 0}})
    plan = make_plan(pipeline, 160)
    context = ShowingContext()
    result = worker.train(pipeline, plan, context)
    assert [row["step"] for row in context.shown] == list(range(1, result.steps_done + 1))
    first_epoch = [row for row in context.shown if row["epoch"] == 1]
    assert {row["first_step"] for row in first_epoch} == {0}
    assert {row["last_step"] for row in first_epoch} == {result.metrics[0]["steps"]}
    assert all(row["epoch_elapsed_s"] >= 0 for row in context.shown)


class Rows:
    """Ray's Queue as the printer sees it: get(timeout), Empty when drained."""

    def __init__(self, rows):
        self.rows = list(rows)

    def get(self, timeout):
        if not self.rows:
            raise Empty
        return self.rows.pop(0)


def test_the_driver_prints_progress_apart_from_epoch_rows(capsys):
    epochs, progress = [], []
    stop = threading.Event()
    stop.set()  # print what is queued, then return
    rows = [{"epoch": 1, "step": 50, "first_step": 0, "last_step": 200,
             "epoch_elapsed_s": 30.0, "within_epoch": True}, {"epoch": 1, "steps": 200}]
    trainer._print_progress(Rows(rows), epochs.append, progress.append, stop)
    assert epochs == [{"epoch": 1, "steps": 200}] and len(progress) == 1
    trainer._print_progress(Rows(rows), epochs.append, None, stop)  # no printer: dropped
    assert len(epochs) == 2
    progress_printer(3)(progress[0])
    line = capsys.readouterr().out
    assert "epoch   1/3" in line and "50/200 of the epoch's steps" in line
    assert "(30s, about 90s left)" in line
