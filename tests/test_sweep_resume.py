"""A sweep whose driver is killed (kill -9) mid-sweep, then the same `raydp-train tune` command
again: Tune's own restore continues it in the same directory. The trial that had finished is
not run again, the one cut short continues from its checkpoint, no step is counted beyond
what was released (each trial's release logs, read here), and the epsilon the budget counts is
dp-accounting's composition, called here directly, of the steps and releases that happened.
The drivers run on an embedded Ray of their own, whose processes carry a marker: none of
them outlives the test."""

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import dp_accounting
import pytest
from dp_accounting import rdp
from pyarrow import fs
from ray_head import isolated_env, marked_processes, stop_marked
from test_sweep_search import ledger_epsilon

from raydp_train.budget.ledger_reading import ledger_rows
from raydp_train.train.release_log import read_marks

SWEEP = "pipelines/sweep_digits.yaml"
EPOCHS = 12
BUDGET = "resumed-sweep"
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # Ray's own, on every node


def tune_command(tmp_path) -> list[str]:
    settings = [f"run.output_dir={tmp_path}/runs", f"budget.ledger={tmp_path}/budgets",
                f"budget.name={BUDGET}", "budget.epsilon=500", "run.seed=5",
                f"training.epochs={EPOCHS}", "tune.search=grid", "tune.num_samples=1",
                "tune.max_concurrent_trials=1",
                "tune.search_space={training.lr: {grid: [0.03, 0.01, 0.003]}}"]
    return [sys.executable, "-m", "raydp_train", "tune", SWEEP,
            *(x for s in settings for x in ("--set", s))]


def trial_states(sweep: Path) -> tuple[set[str], set[str]]:
    """(trials that saved their final report, trials that charged two epochs or more and have
    not): finished, and cut short past a checkpoint."""
    finished = {p.parent.name for p in sweep.glob("trial_models/*/final.json")}
    charged = Counter(p.parent.parent.name for p in sweep.glob("train/*/charges/*.json"))
    return finished, {t for t, n in charged.items() if n >= 2 and t not in finished}


def kill_when_one_finished_and_one_midway(driver: subprocess.Popen, runs: Path) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and driver.poll() is None:
        sweeps = list(runs.glob("sweep-digits-sweep-*"))
        if sweeps and all(trial_states(sweeps[0])):
            driver.kill()  # SIGKILL: no handler runs, as when a node is lost
            driver.wait()
            return
        time.sleep(0.05)
    raise AssertionError(f"the sweep never had a finished and a mid-way trial: {driver.poll()}")


def end_marked(marker: str, within_s: float = 20) -> list[str]:
    """Kill, by PID, the marked processes still there after `within_s`; their commands."""
    deadline = time.monotonic() + within_s
    while marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = []
    for pid in marked_processes(marker):
        try:
            left.append(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode())
        except OSError:
            continue
    stop_marked(marker)
    assert marked_processes(marker) == []
    return left


def released(sweep: Path) -> dict[str, tuple[Counter, int]]:
    """By trial: how often each step's noisy gradient was released (every attempt's release
    log), and how many metric releases."""
    found: dict[str, tuple[Counter, int]] = {}
    for log in sweep.glob("train/*/charges/released-*.log"):
        trial = log.parent.parent.name.split("-")[0]
        steps, releases = read_marks(fs.LocalFileSystem(), str(log))
        counted, metrics = found.get(trial, (Counter(), 0))
        found[trial] = (counted + Counter(steps), metrics + len(releases))
    return found


@pytest.mark.long
@pytest.mark.slow
def test_the_same_command_continues_a_sweep_whose_driver_was_killed(tmp_path):
    temp = Path(tempfile.mkdtemp(prefix="rdp", dir="/tmp"))  # short: Ray's socket paths
    env = isolated_env(temp, ray_tmpdir=temp)
    marker = str(temp)
    try:
        first = subprocess.Popen(tune_command(tmp_path), env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        kill_when_one_finished_and_one_midway(first, tmp_path / "runs")
        # Ray's own helpers may outlive a driver killed under them: ended here, by PID,
        # before the same command runs again. Never a trial's process, which could charge.
        survivors = end_marked(marker)
        assert not [s for s in survivors if s.startswith("ray::") and s not in RAY_AGENTS
                    or "raydp_train" in s], survivors
        (sweep,) = (tmp_path / "runs").glob("sweep-digits-sweep-*")
        finished, midway = trial_states(sweep)
        before = ledger_rows(BUDGET, f"{tmp_path}/budgets")
        again = subprocess.run(tune_command(tmp_path), env=env, capture_output=True, text=True,
                               check=False,
                               timeout=900)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert "continuing the unfinished sweep" in again.stdout, again.stdout[:4000]
        assert end_marked(marker, within_s=60) == [], "Ray processes outlived the driver"
    finally:
        stop_marked(marker)
        shutil.rmtree(temp, ignore_errors=True)
    assert list((tmp_path / "runs").glob("sweep-digits-sweep-*")) == [sweep]
    summary = json.loads((sweep / "sweep.json").read_text())
    assert summary["best"] is not None and (sweep / "best_model" / "model.pt").is_file()
    assert [t["stop_reason"] for t in summary["trials"]] == ["completed"] * 3, summary["trials"]
    rows = ledger_rows(BUDGET, f"{tmp_path}/budgets")
    reserves = [r for r in rows if r["kind"] == "reserve"]

    def reserved(trial: str, in_rows: list[dict]) -> list[str]:
        return [r["request_id"] for r in in_rows if r["kind"] == "reserve"
                and r["owner"].endswith(f"/{trial}")]

    for trial in finished:  # not run again: not one reservation more
        assert reserved(trial, rows) == reserved(trial, before), trial
    settled = {r["reservation"]: r for r in rows if r["kind"] == "settle"}
    counted = Counter()
    for reserve in reserves:
        used = settled.get(reserve["reservation"], reserve)
        counted[reserve["owner"].split("/")[-1]] += used["steps"]
    releases = released(sweep)
    assert set(counted) == set(releases) and len(counted) == 3
    steps_per_epoch = max(r["steps"] for r in reserves)
    planned = sum(r["steps"] for r in before if r["kind"] == "reserve"
                  and r["owner"].endswith(f"/{min(finished)}"))
    for trial, (steps, _) in releases.items():
        # Every step counted was released, once for each time it was: 0 counted twice.
        assert counted[trial] == sum(steps.values()), (trial, counted[trial], steps)
        assert max(steps) + 1 == planned  # it trained to the end
        twice = [step for step, n in steps.items() if n > 1]
        # Only the trial cut short ran steps again: those past its checkpoint, in one epoch.
        assert len(twice) <= (steps_per_epoch if trial in midway else 0), (trial, twice)
    assert rows[-1]["running_epsilon"] == pytest.approx(
        released_epsilon(reserves, releases), rel=1e-9)
    assert ledger_epsilon(rows, 1e-5) == pytest.approx(
        rows[-1]["running_epsilon"], rel=1e-9)


def released_epsilon(reserves: list[dict], releases: dict) -> float:
    """dp-accounting's epsilon of every step and metric release that happened, each trial at
    its own (sampling rate, sigma)."""
    events = []
    for trial, (steps, metrics) in releases.items():
        terms = next(r for r in reserves if r["owner"].endswith(f"/{trial}"))
        events.append(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            terms["sampling_rate"], dp_accounting.GaussianDpEvent(terms["noise_multiplier"])),
            sum(steps.values())))
        events.append(dp_accounting.SelfComposedDpEvent(
            dp_accounting.GaussianDpEvent(terms["release_noise_multiplier"]), metrics))
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent(events))
    return accountant.get_epsilon(1e-5)
