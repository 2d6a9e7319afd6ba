"""Progress within a long epoch: rank 0 shows where it is every PROGRESS_EVERY_S
seconds, the driver prints it apart from the epoch rows, with the time left. No Ray: the loop
in this process with a context that keeps what it shows, and the driver's printer reading the
lines rank 0 appends to the run directory (train/progress_lines.py)."""

import threading

import numpy as np
import torch

from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.reports.console import epoch_printer, progress_printer
from raydp_train.train import trainer, worker
from raydp_train.train.context import LocalContext
from raydp_train.train.plan import make_plan
from raydp_train.train.progress_lines import PROGRESS_LINES, RowReader, append_row


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


def test_the_driver_prints_progress_apart_from_epoch_rows(tmp_path, capsys):
    rows = [{"epoch": 1, "step": 50, "first_step": 0, "last_step": 200,
             "epoch_elapsed_s": 30.0, "within_epoch": True}, {"epoch": 1, "steps": 200}]
    for use_progress in (True, False):
        reader, epochs, progress = RowReader(tmp_path), [], []
        for row in rows:
            append_row(tmp_path, row)
        stop = threading.Event()
        stop.set()  # the run has ended: print what it wrote, then return
        trainer._print_progress(reader, epochs.append,
                                progress.append if use_progress else None, stop)
        assert epochs == [{"epoch": 1, "steps": 200}]
        assert progress == (rows[:1] if use_progress else [])  # no printer: dropped
    progress_printer(3)(rows[0])
    line = capsys.readouterr().out
    assert "epoch   1/3" in line and "50/200 of the epoch's steps" in line
    assert "(30s, about 90s left)" in line


def test_an_epoch_line_shows_the_epochs_own_time_and_the_time_elapsed(capsys):
    show = epoch_printer(3)
    row = {"steps": 10, "train_loss": 0.5, "test_accuracy": 0.9, "epsilon": 1.0}
    for epoch, elapsed in ((1, 10.0), (2, 25.5), (3, 4.0)):  # 3: after the workers restarted
        show({**row, "epoch": epoch, "elapsed_s": elapsed})
    lines = capsys.readouterr().out.splitlines()
    assert [line.rsplit("  ", 1)[1] for line in lines] == [
        "(10.0s; 10.0s elapsed)", "(15.5s; 25.5s elapsed)", "(4.0s; 4.0s elapsed)"]


def test_the_driver_reads_each_new_row_once_and_whole(tmp_path):
    append_row(tmp_path, {"epoch": 1})  # an earlier attempt's row, before the reader
    reader = RowReader(tmp_path)
    assert reader.new_rows() == []
    append_row(tmp_path, {"epoch": 2, "loss": np.float32(0.5), "steps": torch.tensor(7)})
    with open(tmp_path / PROGRESS_LINES, "a") as lines:
        lines.write('{"epoch": 3, "lo')  # rank 0 is writing: half a line so far
    assert reader.new_rows() == [{"epoch": 2, "loss": 0.5, "steps": 7}]
    assert reader.new_rows() == []
    with open(tmp_path / PROGRESS_LINES, "a") as lines:
        lines.write('ss": NaN}\n')
    (third,) = reader.new_rows()
    assert third["epoch"] == 3 and np.isnan(third["loss"])
    reader.remove()
    assert not (tmp_path / PROGRESS_LINES).exists() and reader.new_rows() == []


def test_a_row_written_while_the_run_ends_is_still_shown(tmp_path):
    """The printer reads once more after the run has ended: a row the workers wrote just
    before fit returned is not lost."""
    reader, epochs, stop = RowReader(tmp_path), [], threading.Event()
    printer = threading.Thread(target=trainer._print_progress,
                               args=(reader, epochs.append, None, stop))
    printer.start()
    append_row(tmp_path, {"epoch": 1})
    stop.set()
    printer.join(timeout=10)
    assert not printer.is_alive() and epochs == [{"epoch": 1}]
