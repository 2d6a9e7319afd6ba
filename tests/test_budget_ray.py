"""The budget accountant as a real Ray actor, and sweeps that spend from it (local Ray)."""

import json
import re
from pathlib import Path

import dp_accounting
import pyarrow.parquet as pq
import pytest
import torch
from dp_accounting import rdp
from sweep_draws import drawn

from raydp_train.budget.actor import actor_name, open_budget
from raydp_train.budget.book import NAMESPACE
from raydp_train.budget.ledger import as_uri
from raydp_train.budget.ledger_reading import ledger_rows
from raydp_train.budget.terms import Spend
from raydp_train.commands.cli import EXIT_BUDGET_EXHAUSTED, main
from raydp_train.config.budget import BudgetConfig
from raydp_train.config.pipeline import load_pipeline
from raydp_train.models.builders import build_model

SPEND = Spend(0.02, 1.0, 50)


def _epsilon_of(reservations: int) -> float:
    """dp-accounting itself on `reservations` copies of SPEND."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.0)), 50)
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent([event] * reservations))
    return accountant.get_epsilon(1e-5)


def test_concurrent_reservations_never_overspend(ray_session, tmp_path):
    ray = ray_session
    fits = 7
    budget_epsilon = (_epsilon_of(fits) + _epsilon_of(fits + 1)) / 2  # room for exactly 7
    budget = open_budget(BudgetConfig(name="concurrent", epsilon=budget_epsilon, delta=1e-5,
                                      ledger=str(tmp_path)))

    @ray.remote  # 1 CPU each: Ray reuses a few worker processes instead of starting 50
    def ask(owner):
        return budget.reserve(owner, SPEND)

    decisions = ray.get([ask.remote(f"task-{i}") for i in range(50)])
    granted = [d for d in decisions if d.granted]
    assert len(granted) == fits
    assert all("budget exhausted" in d.reason for d in decisions if not d.granted)
    assert _epsilon_of(len(granted)) <= budget_epsilon
    status = budget.status()
    assert status["steps_reserved"] == fits * SPEND.steps
    assert len([r for r in ledger_rows("concurrent", str(tmp_path)) if r["kind"] == "reserve"]) == fits


def test_killed_or_replaced_actor_comes_back_identical(ray_session, tmp_path):
    ray = ray_session
    config = BudgetConfig(name="restartable", epsilon=20.0, delta=1e-5, ledger=str(tmp_path))
    budget = open_budget(config)
    first = budget.reserve("a", SPEND)
    budget.reserve("b", Spend(0.05, 1.3, 20, release_noise_multiplier=4.0, releases=1))
    assert budget.settle(first, steps_done=20) == 30
    before = budget.status()

    # Killed between reservations: Ray restarts it and it rebuilds from the ledger.
    ray.kill(ray.get_actor(actor_name("restartable"), namespace=NAMESPACE), no_restart=False)
    assert budget.status() == before
    # Gone for good: a fresh actor over the same ledger path.
    ray.kill(ray.get_actor(actor_name("restartable"), namespace=NAMESPACE), no_restart=True)
    assert open_budget(config).status() == before
    # And it keeps spending from where it was.
    assert budget.reserve("c", SPEND).epsilon_after > before["epsilon_counted"]


def test_sweep_spends_one_budget_until_it_is_exhausted(ray_session, tmp_path, capsys):
    pipeline = "pipelines/sweep_digits.yaml"
    overrides = [f"run.output_dir={tmp_path}/runs", f"budget.ledger={tmp_path}/budgets",
                 "budget.name=test-sweep", "budget.epsilon=4.5", "training.epochs=3",
                 "tune.num_samples=4", "tune.max_concurrent_trials=1", "run.seed=3"]
    # One trial costs epsilon 2.4-4.04 (sigma 2-1.2): the first always fits, all 4 (>= 5.13) never.
    args = ["tune", pipeline] + [x for o in overrides for x in ("--set", o)]
    assert main(args) == 0
    output = capsys.readouterr().out
    (sweep_dir,) = (tmp_path / "runs").glob("sweep-digits-sweep-*")
    trials = pq.read_table(sweep_dir / "results.parquet").to_pylist()
    stops = [t["stop_reason"] for t in trials]
    assert len(trials) == 4 and "completed" in stops and "budget exhausted" in stops, stops
    # run.seed: the trials ran the configurations the seeded sampler draws, whatever the run.
    space = load_pipeline(pipeline, overrides)
    keys = list(space.tune.search_space)
    assert sorted(tuple(t[k] for k in keys) for t in trials) == sorted(
        tuple(c[k] for k in keys) for c in drawn(space))
    assert (sweep_dir / "privacy_utility.png").stat().st_size > 0
    assert (sweep_dir / "best.yaml").is_file()
    summary = json.loads((sweep_dir / "sweep.json").read_text())
    # The ledger never holds more than the budget, and the sweep is all that spent from it.
    rows = ledger_rows("test-sweep", f"{tmp_path}/budgets")
    assert max(r["running_epsilon"] for r in rows) <= 4.5
    assert summary["privacy"]["epsilon"] == pytest.approx(rows[-1]["running_epsilon"], rel=1e-6)
    assert "privacy of the whole sweep: epsilon" in output and "budget exhausted" in output
    assert f"ledger: {as_uri(str(tmp_path / 'budgets'))}" in output  # printed by what spends
    assert_best_model_loads(sweep_dir, summary["best"])

    # A run on the same, now (nearly) spent, budget stops cleanly where the budget ends. Which
    # trials the sweep stopped where depends on timing, so an epoch of this run may still fit
    # (seen under heavy load): its directory is kept only if it trained, never an untrained
    # model.pt, and the ledger still holds no more than the budget.
    run_args = ["run", pipeline] + [x for o in overrides for x in ("--set", o)]
    assert main(run_args) == EXIT_BUDGET_EXHAUSTED
    assert "STOPPED: budget exhausted" in capsys.readouterr().out
    for run_dir in [p for p in (tmp_path / "runs").iterdir() if p.name != sweep_dir.name]:
        assert json.loads((run_dir / "privacy.json").read_text())["steps"] > 0, run_dir
    assert max(r["running_epsilon"]
               for r in ledger_rows("test-sweep", f"{tmp_path}/budgets")) <= 4.5
    assert load_pipeline(sweep_dir / "best.yaml").budget.name == "test-sweep"

    # A second sweep on the spent budget trains nothing and writes nothing.
    assert main(args) == EXIT_BUDGET_EXHAUSTED
    output = capsys.readouterr().out
    assert "STOPPED before any trial: budget exhausted" in output and "best (" not in output
    assert len(list((tmp_path / "runs").glob("sweep-digits-sweep-*"))) == 1


def assert_best_model_loads(sweep_dir, best: dict) -> None:
    """The sweep ends with the best trial's trained model, its record, and no other model."""
    model_dir = sweep_dir / "best_model"
    assert best["model"] == str(model_dir) and not (sweep_dir / "trial_models").exists()
    best_yaml = (sweep_dir / "best.yaml").read_text()
    assert f"already saved: {model_dir}" in best_yaml and "SPENDS AGAIN" in best_yaml
    record = json.loads((model_dir / "record.json").read_text())
    assert record["written_to"]["run_dir"] == str(model_dir.resolve())  # where it was moved
    best_pipeline = load_pipeline(sweep_dir / "best.yaml")
    assert record["pipeline"] == best_pipeline.model_dump(mode="json")
    assert record["privacy"]["steps"] > 0 and record["privacy"]["for_release"] is False  # seeded
    assert record["metrics"][-1]["validation_accuracy"] == best["validation_accuracy"]
    model = build_model(best_pipeline.model, (64,), 10)  # sklearn digits: 8x8 pixels, 10 classes
    model.load_state_dict(torch.load(model_dir / "model.pt"))
    assert model(torch.zeros(1, 64)).shape == (1, 10)


def test_random_stopping_sweep_is_one_reservation_made_before_its_trials(ray_session, tmp_path,
                                                                        capsys):
    overrides = [f"run.output_dir={tmp_path}/runs", f"budget.ledger={tmp_path}/budgets",
                 "budget.name=test-random-stopping", "budget.epsilon=20", "training.epochs=1",
                 "tune.selection=random_stopping", "tune.random_stopping={mean_trials: 2}",
                 "tune.max_concurrent_trials=2", "run.seed=5",
                 # Its trials are DP-LoRA's: a sweep and its budget take any mechanism.
                 "privacy.mechanism=lora", "privacy.lora={rank: 4, layers: ['1']}",
                 # A parameter group's lr is searched like any field (the head: layer 3).
                 "training.param_groups=[{params: ['3.*'], lr: 0.01}]",
                 # Trials differ in q and steps too: the reservation bounds them all.
                 ("tune.search_space={privacy.noise_multiplier: {choice: [1.2, 1.5, 2.0]}, "
                  "'training.param_groups[0].lr': {loguniform: [0.003, 0.03]}, "
                  "training.batch_size: {choice: [64, 128]}}")]
    session = Path(ray_session.init(ignore_reinit_error=True).address_info["session_dir"])
    staged_before = set(session.glob("artifacts/*/trials"))  # other sweeps' Tune staging
    assert main(["tune", "pipelines/sweep_digits.yaml"]
                + [x for o in overrides for x in ("--set", o)]) == 0
    printed = capsys.readouterr().out
    assert set(session.glob("artifacts/*/trials")) == staged_before  # Tune's copy removed
    (sweep_dir,) = (tmp_path / "runs").glob("sweep-digits-sweep-*")
    summary = json.loads((sweep_dir / "sweep.json").read_text())
    # Its guarantee covers the best trial's outputs alone: neither how many trials ran nor any
    # other trial's progress, metrics, Tune records or model is written or printed.
    (best,) = summary["trials"]
    assert best["trial"] == summary["best"]["trial"] == "best"
    assert "trials_drawn" not in summary["privacy"] and "trials" not in summary["privacy"]
    assert sorted(path.name for path in sweep_dir.iterdir()) == [
        "best.yaml", "best_model", "pipeline.yaml", "privacy_utility.png", "results.parquet",
        "sweep.json"]
    tune_trial_id = re.compile(r"_\d{5}\b")  # Tune's trial ids count the trials
    written = [sweep_dir / "sweep.json", sweep_dir / "best.yaml",
               *(sweep_dir / "best_model").glob("*.json")]
    for text in (printed, *(path.read_text() for path in written)):
        assert not tune_trial_id.search(text), tune_trial_id.search(text)
    assert " epoch 1" not in printed and pq.read_table(sweep_dir / "results.parquet").num_rows == 1
    assert 0.003 <= best["training.param_groups[0].lr"] <= 0.03
    assert "error" not in best  # the trial applied it
    rows = ledger_rows("test-random-stopping", f"{tmp_path}/budgets")
    # One random-stopping reservation (mean_trials > 0) of DP-LoRA trials, settled in full.
    assert [(r["kind"], r["mechanism"], r["mean_trials"]) for r in rows[1:]] == [
        ("reserve", "lora", 2.0), ("settle", "lora", 2.0)]
    assert rows[1]["noise_multiplier"] == 1.2  # the costliest trial the space allows
    # N = 1150 training rows: the largest q (batch 128) and the most steps (batch 64: 17)
    assert (rows[1]["sampling_rate"], rows[1]["steps"]) == (128 / 1150, 17)
    assert best["training.batch_size"] in {64, 128}
    assert summary["privacy"]["epsilon"] == pytest.approx(rows[1]["running_epsilon"])


# make test: test_ledger_witness.py's test_a_ledger_restored_from_an_older_copy_is_refused_
# before_any_grant (the accountant and validate's read of the book refuse it)
@pytest.mark.long
@pytest.mark.slow
def test_a_ledger_restored_from_an_older_copy_grants_nothing(ray_session, tmp_path, capsys):
    """The restore-from-copy reproduction: the ledger copied after one run, a second run, the copy put
    back: validate, run and tune refuse it in one line naming the witness, before any grant."""
    import shutil

    ledger, runs = tmp_path / "LT", tmp_path / "runsT"
    args = ["pipelines/quickstart.yaml"] + [x for o in (
        "training.epochs=1", "budget.name=bt", "budget.epsilon=2.1", "budget.delta=1e-5",
        f"budget.ledger={ledger}", f"run.output_dir={runs}") for x in ("--set", o)]
    assert main(["run", *args]) == 0
    shutil.copytree(ledger, tmp_path / "LT_after1")
    assert main(["run", *args]) == 0
    records = [json.loads(p.read_text())["budget"] for p in runs.glob("*/record.json")]
    assert sorted(r["ledger_head"]["seq"] for r in records) == [2, 4]
    capsys.readouterr()
    shutil.rmtree(ledger)
    shutil.copytree(tmp_path / "LT_after1", ledger)
    fragments = sorted((ledger / "bt").glob("*.parquet"))
    sweep = ["pipelines/sweep_digits.yaml", *args[1:]]  # the same budget, ledger and runs
    for command, pipeline in (("validate", args), ("run", args), ("tune", sweep)):
        assert main([command, *pipeline]) == 2
        output = capsys.readouterr()
        (line,) = [x for x in output.err.splitlines() if "witness" in x]
        assert f"{tmp_path}/LT.witness/bt.json names fragment 000000000004.parquet" in line
        assert "Traceback" not in output.err + output.out
    assert sorted((ledger / "bt").glob("*.parquet")) == fragments  # nothing granted
    assert len(list(runs.iterdir())) == 2  # and no run directory made
