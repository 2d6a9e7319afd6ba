"""One budget, several processes with a Ray of their own each: the ledger keeps the promise.

Real processes, real Ray: two `raydp-train run` started together (two embedded Rays), and two
writer processes (two local clusters, two accountant actors) racing, one of whose actors is
killed with SIGKILL mid-race. Oracle: the number of reservations one accountant alone grants.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from budget_writer import fits_alone
from ray_head import BIN, isolated_env, stop_marked

from raydp_train.budget.book import replay
from raydp_train.budget.ledger_reading import budget_status, ledger_rows
from raydp_train.budget.terms import Spend

ROOT = Path(__file__).parents[1]
WRITER = Path(__file__).parent / "budget_writer.py"
pytestmark = pytest.mark.cluster


def _wait_for(condition, processes, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        failed = [p for p in processes if p.poll() is not None]
        if failed or time.monotonic() > deadline:
            outputs = [p.communicate()[1][-2000:] if p.poll() is not None else "" for p in failed]
            pytest.fail(f"waiting for {what}: {outputs or 'timed out'}")
        time.sleep(0.1)


def _last_json_line(output: str) -> str:
    """The writer's answer (Ray may log to stdout after it)."""
    return [line for line in output.splitlines() if line.startswith("{")][-1]


@pytest.mark.parametrize("kill", [False, True], ids=["two-clusters", "one-actor-kill-9ed"])
def test_accountants_of_two_local_clusters_grant_exactly_what_fits(tmp_path, kill):
    epsilon = 8.0
    fits = fits_alone(epsilon, str(tmp_path / "alone"))
    ledger, sync = tmp_path / "shared", tmp_path / "sync"
    sync.mkdir()
    marker = str(tmp_path)
    writers = [subprocess.Popen(
        [sys.executable, str(WRITER), str(ledger), str(epsilon), str(fits), str(sync)]
        + (["--kill"] if kill and number == 0 else []),
        env=isolated_env(tmp_path), cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for number in range(2)]
    try:
        _wait_for(lambda: len(list(sync.glob("ready-*"))) == 2, writers, "two ready writers")
        (sync / "start").touch()  # both fire 'fits' requests at once: twice what fits
        outputs = [writer.communicate(timeout=300) for writer in writers]
    finally:
        stop_marked(marker)
    assert [writer.returncode for writer in writers] == [0, 0], [o[1][-2000:] for o in outputs]
    answers = [json.loads(_last_json_line(out)) for out, _ in outputs]
    granted = [reservation for answer in answers for reservation in answer["granted"]]
    assert len(granted) == fits
    rows = ledger_rows("shared", str(ledger))  # readable: no gap, no duplicate number
    assert sorted(r["reservation"] for r in rows if r["kind"] == "reserve") == sorted(granted)
    request_ids = [r["request_id"] for r in rows if r["request_id"]]
    assert len(request_ids) == len(set(request_ids))  # nothing decided twice
    assert replay(rows).epsilon <= epsilon
    if kill:
        assert answers[0]["killed_pid"]


# make test: the same race of two processes' Rays on one ledger:
# test_accountants_of_two_local_clusters_grant_exactly_what_fits
@pytest.mark.long
def test_two_embedded_runs_started_together_grant_exactly_what_fits(tmp_path):
    # Quickstart at batch 80 of its 800 examples: q = 0.1, 10 steps an epoch, one epoch a
    # reservation, so every reservation is the same and the budget fits exactly `fits` epochs.
    epoch = Spend(0.1, 2.0, 10)
    epsilon = 2.0
    fits = fits_alone(epsilon, str(tmp_path / "alone"), epoch)
    assert 4 < fits < 8  # each run asks for 4 epochs: together they ask for more than fits
    overrides = ["training.workers=1", "training.batch_size=80", "training.epochs=4",
                 "budget.name=two-runs", f"budget.epsilon={epsilon}", "budget.delta=1e-5",
                 f"budget.ledger={tmp_path}/budgets", f"run.output_dir={tmp_path}/runs"]
    # --new: the same pipeline twice at once on purpose (otherwise the second, finding the
    # first unfinished with its driver alive, would refuse: runs/reruns.py)
    command = [str(BIN / "raydp-train"), "run", "pipelines/quickstart.yaml", "--new",
               *[part for override in overrides for part in ("--set", override)]]
    env = isolated_env(tmp_path)  # no RAY_ADDRESS: embedded, as a user runs it
    runs = [subprocess.Popen(command, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT) for _ in range(2)]
    try:
        outputs = [run.communicate(timeout=600)[0] for run in runs]
    finally:
        stop_marked(str(tmp_path))
    codes = [run.returncode for run in runs]
    assert set(codes) <= {0, 3} and 3 in codes, outputs  # 3: stopped "budget exhausted"
    rows = ledger_rows("two-runs", str(tmp_path / "budgets"))
    assert sum(row["kind"] == "reserve" for row in rows) == fits
    status = budget_status("two-runs", str(tmp_path / "budgets"))  # replays
    assert status["steps_spent"] == fits * epoch.steps and status["steps_reserved"] == 0
    assert len(status["owners"]) == 2 and status["epsilon_counted"] <= epsilon
