"""Every search algorithm and scheduler runs a small sweep on one budget (local Ray): the epsilon
the budget counts is dp-accounting's composition, called here directly, of every step and
release its ledger charged, and it never exceeds the budget."""

import json
import re
from types import SimpleNamespace

import dp_accounting
import pyarrow.parquet as pq
import pytest
from dp_accounting import rdp

from raydp_train.budget.ledger_reading import ledger_rows
from raydp_train.commands.cli import main
from raydp_train.sweeps.progress import sweep_table

SWEEP = "pipelines/sweep_digits.yaml"
# One epoch of a trial costs epsilon 1.4-1.9 (sigma 2-1.2, with its noisy release): a budget
# of 4 pays two or three of them, so some searches also see a trial the budget refused.
BUDGET_EPSILON = 4.0
SPACES = {
    "random": "{privacy.noise_multiplier: {choice: [1.5, 2.0]}, training.lr: "
              "{loguniform: [0.003, 0.03]}}",
    "grid": "{privacy.noise_multiplier: {grid: [1.5, 2.0]}, training.lr: {grid: [0.01]}}",
    "optuna": "{privacy.noise_multiplier: {choice: [1.5, 2.0]}, training.lr: "
              "{loguniform: [0.003, 0.03]}}",
    "hyperopt": "{privacy.noise_multiplier: {uniform: [1.5, 2.0]}, training.lr: "
                "{loguniform: [0.003, 0.03]}}",
    "bayesopt": "{privacy.noise_multiplier: {uniform: [1.5, 2.0]}, training.lr: "
                "{uniform: [0.003, 0.03]}}",
}


def ledger_epsilon(rows: list[dict], delta: float) -> float:
    """dp-accounting on the ledger's charges: each reservation's steps and releases as settled,
    or in full while it is open."""
    settled = {r["reservation"]: r for r in rows if r["kind"] == "settle"}
    events = []
    for reserve in (r for r in rows if r["kind"] == "reserve"):
        used = settled.get(reserve["reservation"], reserve)
        events.append(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
            reserve["sampling_rate"], dp_accounting.GaussianDpEvent(reserve["noise_multiplier"])),
            used["steps"]))
        if used["releases"]:
            events.append(dp_accounting.SelfComposedDpEvent(
                dp_accounting.GaussianDpEvent(reserve["release_noise_multiplier"]),
                used["releases"]))
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent(events))
    return accountant.get_epsilon(delta)


def sweep(tmp_path, name: str, *overrides: str, epsilon: float = BUDGET_EPSILON
          ) -> tuple[dict, list[dict], list[dict]]:
    """`raydp-train tune` of the digits sweep on a fresh budget: its summary, its trials' rows
    and its ledger's rows, after checking what the budget counted."""
    settings = [f"run.output_dir={tmp_path}/runs", f"budget.ledger={tmp_path}/budgets",
                f"budget.name={name}", f"budget.epsilon={epsilon}", "run.seed=11",
                "tune.max_concurrent_trials=1", *overrides]
    assert main(["tune", SWEEP, *(x for o in settings for x in ("--set", o))]) == 0
    (directory,) = (tmp_path / "runs").glob("sweep-digits-sweep-*")
    summary = json.loads((directory / "sweep.json").read_text())
    trials = pq.read_table(directory / "results.parquet").to_pylist()
    rows = ledger_rows(name, f"{tmp_path}/budgets")
    counted = rows[-1]["running_epsilon"]
    assert max(r["running_epsilon"] for r in rows) <= epsilon
    assert counted == pytest.approx(ledger_epsilon(rows, 1e-5), rel=1e-9)
    assert summary["privacy"]["epsilon"] == pytest.approx(counted, rel=1e-9)
    assert not any("error" in t and t["error"] for t in trials), trials
    return summary, trials, rows


# bayesopt: make test-long (make test: the other searches, and test_sweep_config.py builds and
# seeds bayesopt)
@pytest.mark.parametrize("search", [pytest.param(s, marks=pytest.mark.long) if s == "bayesopt"
                                    else s for s in SPACES])
def test_each_search_algorithm_spends_from_one_budget(ray_session, tmp_path, capsys, search):
    summary, trials, rows = sweep(tmp_path, f"search-{search}", "training.epochs=1",
                                  "tune.num_samples=3" if search != "grid" else "tune.num_samples=1",
                                  f"tune.search={search}", f"tune.search_space={SPACES[search]}")
    # The sweep's table, at each trial's end (and every 30 s).
    tables = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sweep: ")]
    assert len(tables) >= len(trials) and re.fullmatch(
        r"sweep: \d running, \d finished, 0 pending; best validation_accuracy 0\.\d{4}; budget "
        rf"epsilon {rows[-1]['running_epsilon']:.3f} counted, [\d.]+ left of 4", tables[-1])
    assert len(trials) == (2 if search == "grid" else 3)
    assert summary["best"] is not None and "completed" in [t["stop_reason"] for t in trials]
    if search == "grid":
        assert sorted(t["privacy.noise_multiplier"] for t in trials) == [1.5, 2.0]
    # Every trial that trained charged its epoch, and only those: one reservation each.
    trained = [t for t in trials if t["epochs"]]
    assert len([r for r in rows if r["kind"] == "reserve"]) == len(trained)



def test_the_sweep_table_counts_trials_by_state_and_shows_the_budget_left():
    trials = [SimpleNamespace(status=s) for s in ("RUNNING", "TERMINATED", "ERROR", "PENDING")]
    line = sweep_table(trials, {"a": 0.5, "b": 0.75}, "validation_accuracy", max,
                       {"epsilon": 10.0, "epsilon_counted": 4.25})
    assert line == ("sweep: 1 running, 2 finished, 1 pending; best validation_accuracy 0.7500; "
                    "budget epsilon 4.250 counted, 5.750 left of 10")
    assert "best validation_accuracy none yet" in sweep_table(
        trials, {}, "validation_accuracy", min, {"epsilon": 1.0, "epsilon_counted": 0.0})


def charged_requests(directory) -> dict[str, set[str]]:
    """The budget requests each trial's Ray Train runs recorded before their epochs (their
    write-ahead charge files), by trial."""
    requests: dict[str, set[str]] = {}
    for charge in directory.glob("train/*/charges/*.json"):
        trial = charge.parent.parent.name.split("-")[0]
        requests.setdefault(trial, set()).add(json.loads(charge.read_text())["request"])
    return requests


# make test: the sweeps above and PBT's below (Tune ends, stops and continues their one-worker
# trials); ASHA also in test_first_hour.py (long)
@pytest.mark.long
def test_asha_stops_a_two_worker_trial_and_its_run_ends_there(ray_session, tmp_path):
    """ASHA stops the second trial (lr 1e-4) at its first rung, behind the first (lr 0.03): its
    Ray Train run stops before charging the epoch after the one in flight (it ran to the end
    before), the sweep goes on, and the budget holds exactly what the runs charged."""
    summary, trials, rows = sweep(
        tmp_path, "asha-workers", "training.workers=2", "training.epochs=3",
        "tune.scheduler=asha", "tune.search=grid", "tune.num_samples=1",
        "tune.search_space={training.lr: {grid: [0.03, 0.0001]}}")
    stops = {t["training.lr"]: (t["stop_reason"], t["epochs"]) for t in trials}
    assert stops == {0.03: ("completed", 3), 0.0001: ("stopped by scheduler", 1)}, trials
    assert summary["best"]["training.lr"] == 0.03
    requests = charged_requests(next((tmp_path / "runs").glob("sweep-*")))
    reserved = {r["request_id"] for r in rows if r["kind"] == "reserve"}
    trial_of = {t["training.lr"]: t["trial"] for t in trials}
    assert reserved <= set().union(*requests.values())  # nothing no run charged
    assert len(requests[trial_of[0.03]] & reserved) == 3
    # Its first epoch, and at most the one in flight when ASHA stopped it.
    assert 1 <= len(requests[trial_of[0.0001]] & reserved) <= 2


def final_reports(directory) -> dict[str, dict]:
    """Each trial's final report to Tune, by trial id (the last line of its result.json)."""
    finals = {}
    for results in directory.glob("trials/*/result.json"):
        for line in results.read_text().splitlines():
            report = json.loads(line)
            if report.get("final"):
                finals[report["trial_id"]] = report
    return finals


def test_pbt_counts_every_step_of_every_trial_copied_or_not(ray_session, tmp_path):
    """PBT continues the trial behind (lr 1e-4) from the checkpoint of the one ahead (lr
    0.03) at epoch c. The budget counts each epoch under the trial that ran it: the one ahead,
    never continued, all E of its epochs; the copied epochs once, under it; the continued
    trial, its own epochs before the copy and the E - c it ran after. One-worker trials, long
    enough to overlap; PBT between 2-worker trials: the synchronous test below."""
    epochs = 8
    _, trials, rows = sweep(
        tmp_path, "pbt-1", "training.workers=1", f"training.epochs={epochs}",
        "tune.scheduler=pbt", "tune.pbt={perturbation_interval: 1, quantile_fraction: 0.5}",
        "tune.search=grid", "tune.num_samples=1", "tune.max_concurrent_trials=2",
        "tune.search_space={training.lr: {grid: [0.0001, 0.03]}}", epsilon=30.0)
    finals = final_reports(next((tmp_path / "runs").glob("sweep-*")))
    assert len(finals) == 2 and all(t["stop_reason"] == "completed" for t in trials), trials
    copied = {trial: final["continued_from_epoch"] for trial, final in finals.items()}
    assert any(copied.values()), copied
    for trial, epoch in copied.items():
        reserved = [r for r in rows if r["kind"] == "reserve" and r["owner"].endswith(trial)]
        if epoch == 0:  # ran every epoch itself
            assert len(reserved) == epochs, (trial, len(reserved))
        else:  # at least one epoch before PBT continued it, and every epoch after
            assert len(reserved) >= 1 + epochs - epoch, (trial, epoch, len(reserved))


def released_steps(directory) -> dict[str, int]:
    """By trial: the steps its runs released (every run folder's release logs: its own, and
    those PBT made when it continued from a checkpoint)."""
    from pyarrow import fs

    from raydp_train.train.release_log import read_marks

    released: dict[str, int] = {}
    for log in directory.glob("train/*/charges/released-*.log"):
        trial = log.parent.parent.name.split("-")[0]
        steps, _ = read_marks(fs.LocalFileSystem(), str(log))
        released[trial] = released.get(trial, 0) + len(steps)
    return released


@pytest.mark.long
def test_pbt_copies_between_two_worker_trials_and_counts_every_step(ray_session, tmp_path):
    """Synchronous PBT with 2-worker trials (they cannot run at once on the session's 4 CPUs:
    each pauses at the interval until the other gets there, unless on a loaded machine the
    one ahead runs past it before Tune pauses it): the trial behind continues from the
    checkpoint of the one ahead, in a new run folder whose charges start at the copied step.
    The budget counts each trial's every step once, copied or not: the ledger's count for
    each trial is the steps its runs released (their release logs), at least its planned
    epochs, and the copied epochs are counted once, under the trial that ran them."""
    epochs = 2
    _, trials, rows = sweep(
        tmp_path, "pbt-copy-workers", "training.workers=2", f"training.epochs={epochs}",
        "tune.scheduler=pbt",
        "tune.pbt={perturbation_interval: 1, quantile_fraction: 0.5, synch: true}",
        "tune.search=grid", "tune.num_samples=1", "tune.max_concurrent_trials=2",
        "tune.search_space={training.lr: {grid: [0.0001, 0.03]}}", epsilon=30.0)
    assert all(t["stop_reason"] == "completed" for t in trials), trials
    check_pbt_counts(next((tmp_path / "runs").glob("sweep-*")), rows)


def check_pbt_counts(directory, rows) -> None:
    """A PBT sweep's run folders and ledger rows: every trial continued from the copied
    epoch 1 or ran every step itself, and each step released is counted once."""
    finals = final_reports(directory)
    assert len(finals) == 2, finals
    continued = {t for t, final in finals.items() if final["continued_from_epoch"] == 1}
    assert continued and all(finals[t]["continued_from_epoch"] == 0
                             for t in set(finals) - continued), finals
    copies = [json.loads(c.read_text()) for c in
              directory.glob("train/*-*/checkpoint_continued/progress.json")]
    assert len(copies) >= len(continued) and {c["epoch"] for c in copies} == {1}, copies
    copied_step = copies[0]["step"]  # the steps of epoch 1
    settled = {r["reservation"]: r for r in rows if r["kind"] == "settle"}
    counted: dict[str, int] = {}
    for reserve in (r for r in rows if r["kind"] == "reserve"):
        trial = reserve["owner"].split("/")[-1]
        counted[trial] = counted.get(trial, 0) + settled.get(reserve["reservation"],
                                                             reserve)["steps"]
    assert counted == released_steps(directory), (counted, released_steps(directory))
    assert set(counted) == set(finals), counted
    for trial, final in finals.items():
        if trial not in continued:  # ran every step itself, each counted once
            assert counted[trial] == final["steps_charged"], (trial, counted)
            continue
        # Each continued run charged from the copied step on.
        first = min(json.loads(c.read_text())["first_step"] for c in
                    directory.glob(f"train/{trial}-1/charges/*.json"))
        assert first == copied_step
        # Its own epoch 1 before the copy, and every step after it (steps_charged: its
        # continued run's), each counted once.
        assert counted[trial] >= copied_step + final["steps_charged"], (trial, counted)
