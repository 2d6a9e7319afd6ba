"""Every search algorithm runs a small sweep on one budget (local Ray): the epsilon
the budget counts is dp-accounting's composition, called here directly, of every step and
release its ledger charged, and it never exceeds the budget."""

import json

import dp_accounting
import pyarrow.parquet as pq
import pytest
from dp_accounting import rdp

from raydp_train.budget.ledger_reading import ledger_rows
from raydp_train.commands.cli import main

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


def sweep(tmp_path, name: str, *overrides: str) -> tuple[dict, list[dict], list[dict]]:
    """`raydp-train tune` of the digits sweep on a fresh budget: its summary, its trials' rows
    and its ledger's rows, after checking what the budget counted."""
    settings = [f"run.output_dir={tmp_path}/runs", f"budget.ledger={tmp_path}/budgets",
                f"budget.name={name}", f"budget.epsilon={BUDGET_EPSILON}", "run.seed=11",
                "tune.max_concurrent_trials=1", *overrides]
    assert main(["tune", SWEEP, *(x for o in settings for x in ("--set", o))]) == 0
    (directory,) = (tmp_path / "runs").glob("sweep-digits-sweep-*")
    summary = json.loads((directory / "sweep.json").read_text())
    trials = pq.read_table(directory / "results.parquet").to_pylist()
    rows = ledger_rows(name, f"{tmp_path}/budgets")
    counted = rows[-1]["running_epsilon"]
    assert max(r["running_epsilon"] for r in rows) <= BUDGET_EPSILON
    assert counted == pytest.approx(ledger_epsilon(rows, 1e-5), rel=1e-9)
    assert summary["privacy"]["epsilon"] == pytest.approx(counted, rel=1e-9)
    assert not any("error" in t and t["error"] for t in trials), trials
    return summary, trials, rows


@pytest.mark.parametrize("search", list(SPACES))
def test_each_search_algorithm_spends_from_one_budget(ray_session, tmp_path, search):
    summary, trials, rows = sweep(tmp_path, f"search-{search}", "training.epochs=1",
                                  "tune.num_samples=3" if search != "grid" else "tune.num_samples=1",
                                  f"tune.search={search}", f"tune.search_space={SPACES[search]}")
    assert len(trials) == (2 if search == "grid" else 3)
    assert summary["best"] is not None and "completed" in [t["stop_reason"] for t in trials]
    if search == "grid":
        assert sorted(t["privacy.noise_multiplier"] for t in trials) == [1.5, 2.0]
    # Every trial that trained charged its epoch, and only those: one reservation each.
    trained = [t for t in trials if t["epochs"]]
    assert len([r for r in rows if r["kind"] == "reserve"]) == len(trained)

