"""A failure on the workers reaches the user as one line (runs/worker_errors.py): the user's own
error found under Ray's wrappers, built here from Ray's real exception classes (no Ray
running); anything else a bug line naming the trace file. (On a real Ray, through `run`:
the churn test in tests/test_documented_inputs.py.)"""

import pytest
from ray.exceptions import RayTaskError, UserCodeException
from ray.train import WorkerGroupError

from raydp_train.commands.cli import main
from raydp_train.data.columns import DataError
from raydp_train.runs.worker_errors import ERROR_LOG, WorkerBug, explain


def remote(error: Exception) -> Exception:
    """`error` as Ray hands it over from a remote task: a RayTaskError posing as its cause."""
    return RayTaskError("map_batches", "Traceback (most recent call last):\n  ...",
                        error).as_instanceof_cause()


def data_task_failure(error: Exception) -> Exception:
    """A Ray Data UDF failure as a Train worker sees it, raised from the remote one."""
    wrapper = UserCodeException("UDF failed to process a data block.")
    wrapper.__cause__ = remote(error)
    return wrapper


def test_the_users_error_under_a_worker_group_error_is_found(tmp_path):
    cause = DataError("data: column 'churn' in train.parquet is string, expected numbers")
    failure = WorkerGroupError("worker 1 failed", {1: data_task_failure(cause),
                                                   0: RuntimeError("gloo: peer closed")})
    explained = explain(failure, tmp_path)
    assert explained is cause
    assert "UDF failed" in (tmp_path / ERROR_LOG).read_text()  # the full trace is kept


def test_anything_else_is_a_bug_in_one_line_naming_the_trace(tmp_path):
    failure = WorkerGroupError("worker 0 failed", {0: remote(ZeroDivisionError("division by "
                                                                               "zero"))})
    explained = explain(failure, tmp_path)
    assert isinstance(explained, WorkerBug)
    assert "ZeroDivisionError: division by zero" in str(explained)
    assert str(tmp_path / ERROR_LOG) in str(explained) and "\n" not in str(explained)


@pytest.mark.parametrize("verbose", [False, True])
def test_the_cli_prints_a_bug_in_one_line_and_exits_1(monkeypatch, tmp_path, capsys, verbose):
    def failing_validate(args):
        raise explain(WorkerGroupError("w", {0: remote(KeyError("x"))}), tmp_path)

    monkeypatch.setattr("raydp_train.commands.cli.validate", failing_validate)
    argv = ["validate", "pipelines/quickstart.yaml"] + (["--verbose"] if verbose else [])
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: the run failed: KeyError")
    assert ("Traceback" in err) == verbose



def test_a_failed_trial_shows_the_users_error_in_the_sweep_table():
    from types import SimpleNamespace

    from raydp_train.sweeps.runner import _trial_row

    cause = DataError("data: column 'churn' in train.parquet is string, expected numbers")
    failed = SimpleNamespace(metrics={}, config={"training.lr": 0.1},
                             error=WorkerGroupError("worker 0 failed", {0: remote(cause)}))
    row = _trial_row(failed, SimpleNamespace(search_space={"training.lr": None}))
    assert row["stop_reason"] == "failed" and row["error"] == str(cause)
