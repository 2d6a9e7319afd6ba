"""Faults on a real local Ray: Ctrl-C on the driver, the budget actor killed mid-sweep.

(A Train worker dying mid-epoch: tests/test_distributed.py; a failed or full-disk ledger
write: tests/test_budget.py.)
"""

import json
import threading
from pathlib import Path

import dp_accounting
import pyarrow.parquet as pq
import pytest
from interrupted import ctrl_c_after

from raydp_train.budget.actor import actor_name
from raydp_train.budget.book import NAMESPACE
from raydp_train.budget.ledger_reading import budget_status, ledger_rows
from raydp_train.commands.cli import main
from raydp_train.train.charges import RunCharges
from raydp_train.train.context import newest_checkpoint

ROOT = Path(__file__).parents[1]


def _fragments(ledger: Path, budget: str) -> int:
    directory = ledger / budget
    if not directory.is_dir():
        return 0
    return sum(1 for f in directory.iterdir() if f.suffix == ".parquet" and f.name[0] != ".")


def _steps_in_ledger(status: dict, owner_suffix: str) -> int:
    """Steps a run counts in the budget: settled steps, or the full reservation if open."""
    return sum(entry["steps_spent"] + entry["steps_reserved"]
               for owner, entry in status["owners"].items() if owner.endswith(owner_suffix))


def checkpoints(run_dir: Path) -> list[Path]:
    return [c for c in run_dir.glob("checkpoint_*") if c.is_dir()]


@pytest.mark.long
@pytest.mark.slow
def test_ctrl_c_stops_before_the_next_epoch_and_the_same_command_resumes_within_the_target(
    ray_session, tmp_path, capsys
):
    """Ctrl-C lets the running epoch finish and checkpoint, then stops before the next one is
    charged; the resume starts from that newest checkpoint, so no step is charged twice and
    the final epsilon stays within privacy.target_epsilon."""
    overrides = [f"run.output_dir={tmp_path}/runs", f"budget.ledger={tmp_path}/budgets",
                 "budget.name=interrupted", "budget.epsilon=50", "budget.delta=1e-5",
                 "training.epochs=16", "privacy.noise_multiplier=null",
                 "privacy.target_epsilon=3"]
    options = [x for o in overrides for x in ("--set", o)]
    # The session's Ray, joined as on a cluster (test_first_hour presses Ctrl-C on an embedded
    # one): a Ray start and stop fewer.
    output = ctrl_c_after(["run", str(ROOT / "pipelines/quickstart.yaml"), *options], tmp_path,
                          "epoch   3/16", ray_session.get_runtime_context().gcs_address)
    assert "stopping after the epoch that is running" in output
    assert "INTERRUPTED: the last checkpoint is in" in output and "--resume" in output

    (run_dir,) = (tmp_path / "runs").glob("quickstart-*")
    newest = json.loads((newest_checkpoint(run_dir) / "progress.json").read_text())
    charged = RunCharges(str(run_dir)).total().steps
    assert newest["epoch"] >= 3
    assert len(checkpoints(run_dir)) <= 2  # run.keep_checkpoints: 2
    assert charged == newest["step"]  # every epoch charged was run and saved
    status = budget_status("interrupted", f"{tmp_path}/budgets")  # replays the ledger
    assert _steps_in_ledger(status, run_dir.name) == charged

    # The user presses the up arrow: the same command, no --resume, continues that run.
    assert main(["run", str(ROOT / "pipelines/quickstart.yaml"), *options]) == 0
    assert f"continuing the unfinished run {run_dir}" in capsys.readouterr().out
    assert [d.name for d in (tmp_path / "runs").iterdir()] == [run_dir.name]
    privacy = json.loads((run_dir / "privacy.json").read_text())
    assert privacy["steps"] == privacy["planned_steps"] == 200  # 16 epochs of 12.5 steps
    assert privacy["steps_run_again"] == 0
    assert privacy["epsilon"] <= 3.0
    never_interrupted = dp_accounting.rdp.RdpAccountant().compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(privacy["sampling_rate"], dp_accounting.GaussianDpEvent(
            privacy["noise_multiplier"])), 200)).get_epsilon(privacy["delta"])
    assert privacy["epsilon"] == pytest.approx(never_interrupted, rel=1e-12)
    kept = sorted(json.loads((c / "progress.json").read_text())["epoch"]
                  for c in checkpoints(run_dir))
    assert kept == [15, 16]  # only the newest two of 16 epochs' checkpoints stay
    status = budget_status("interrupted", f"{tmp_path}/budgets")
    assert _steps_in_ledger(status, run_dir.name) == 200
    assert list(status["owners"]) == [run_dir.name]  # one run in the ledger, not two


def test_budget_actor_killed_mid_sweep_loses_no_reservation(ray_session, tmp_path, capsys):
    ray = ray_session
    ledger, name = tmp_path / "budgets", "killed-mid-sweep"
    overrides = [f"run.output_dir={tmp_path}/runs", f"budget.ledger={ledger}",
                 f"budget.name={name}", "budget.epsilon=30", "training.epochs=4",
                 "tune.num_samples=3", "tune.max_concurrent_trials=2", "run.seed=5"]
    kills, done = [], threading.Event()

    def kill_twice():
        # Once right after the first reservation, once later in the sweep.
        for fragments_seen in (2, 7):
            while _fragments(ledger, name) < fragments_seen:
                if done.wait(0.02):
                    return
            actor = ray.get_actor(actor_name(name), namespace=NAMESPACE)
            ray.kill(actor, no_restart=False)
            kills.append(_fragments(ledger, name))

    killer = threading.Thread(target=kill_twice, daemon=True)
    killer.start()
    try:
        code = main(["tune", "pipelines/sweep_digits.yaml"]
                    + [x for o in overrides for x in ("--set", o)])
    finally:
        done.set()
        killer.join()
    assert code == 0, capsys.readouterr().out
    assert len(kills) == 2, "the actor was not killed twice during the sweep"

    (sweep_dir,) = (tmp_path / "runs").glob("sweep-digits-sweep-*")
    trials = pq.read_table(sweep_dir / "results.parquet").to_pylist()
    assert [t["stop_reason"] for t in trials] == ["completed"] * 3
    rows = ledger_rows(name, str(ledger))  # no gap, no duplicate, every fragment readable
    request_ids = [r["request_id"] for r in rows if r["request_id"]]
    assert len(request_ids) == len(set(request_ids))  # a re-sent call was never done twice
    status = budget_status(name, str(ledger))  # replay recomposes the recorded epsilon
    for trial in trials:  # every epoch a trial ran was granted once and is on record
        assert _steps_in_ledger(status, "/" + trial["trial"]) == trial["steps_charged"] > 0
    assert status["steps_reserved"] == 0 and status["epsilon_counted"] <= 30
    assert status["epsilon_counted"] == pytest.approx(rows[-1]["running_epsilon"], rel=1e-9)


def test_cli_budget_reset_needs_force_and_is_a_ledger_row(ray_session, tmp_path, capsys):
    from raydp_train.budget.actor import open_budget
    from raydp_train.budget.terms import Spend
    from raydp_train.config.budget import BudgetConfig

    budget = open_budget(BudgetConfig(name="resettable", epsilon=10.0, delta=1e-5,
                                      ledger=str(tmp_path)))
    decision = budget.reserve("run-1", Spend(0.02, 1.0, 50))
    budget.settle(decision, steps_done=50)
    rows = ledger_rows("resettable", str(tmp_path))
    reset = ["budget", "reset", "resettable", "--ledger", str(tmp_path)]

    assert main(reset) == 2
    assert "refused without --force" in capsys.readouterr().err
    assert ledger_rows("resettable", str(tmp_path)) == rows

    assert main(reset + ["--force", "--reason", "new data release"]) == 0
    captured = capsys.readouterr()
    assert "WARNING: resetting budget 'resettable'" in captured.err
    after = ledger_rows("resettable", str(tmp_path))
    assert after[: len(rows)] == rows and after[-1]["kind"] == "reset"
    assert "new data release" in after[-1]["owner"]
    assert budget.status()["epsilon_counted"] == 0.0  # the live accountant took it in
    assert main(["budget", "history", "resettable", "--ledger", str(tmp_path)]) == 0
    assert "reset" in capsys.readouterr().out


def test_a_restart_on_other_nodes_keeps_the_nodes_of_the_attempts_before():
    """record.json's worker_nodes_ever: a failover's run lists the node it left, too."""
    from raydp_train.config.pipeline import pipeline_from_dict
    from raydp_train.train.context import LocalContext
    from raydp_train.train.plan import make_plan
    from raydp_train.train.worker import train

    pipeline = pipeline_from_dict({
        "name": "nodes", "data": {"source": "synthetic", "n_samples": 200},
        "model": {"kind": "logistic"}, "privacy": {"noise_multiplier": 1.0, "delta": 1e-4},
        "training": {"epochs": 2, "batch_size": 40}, "run": {"seed": 0}})
    plan, states = make_plan(pipeline, 160), []
    first = train(pipeline, plan, LocalContext(on_checkpoint=lambda row, state: states.append(
        state)))
    assert first.nodes_ever == first.nodes == ["this process"]
    # The first epoch's checkpoint, as an attempt on another node would have written it.
    restored = {**states[0], "nodes_ever": ["10.0.0.9"]}
    again = train(pipeline, plan, LocalContext(on_epoch=lambda row: None, restored=restored))
    assert again.nodes == ["this process"]
    assert again.nodes_ever == ["10.0.0.9", "this process"]
    assert [row["epoch"] for row in again.metrics] == [1, 2]
