"""privacy.unit user through `raydp-train run` on 2 workers, for every mechanism: the record,
the summary and `budget status` say per user, and the per-user budget refuses a per-example
run by name before reserving anything (ARCHITECTURE.md §2.14)."""

import json

import pyarrow.parquet as pq
import pytest
import yaml
from test_user_level import write_users_file

from raydp_train.commands.cli import main

MECHANISMS = {"dpsgd": {}, "lsg": {"lsg": {"rank": 2, "layers": ["1"]}},
              "lora": {"lora": {"rank": 2, "layers": ["1"]}}}


def write_pipeline(tmp_path, mechanism: str):
    write_users_file(tmp_path / "train.parquet", rows=400, users=60)
    write_users_file(tmp_path / "test.parquet", rows=80, seed=1)
    pipeline = {
        "name": f"users-{mechanism}",
        "data": {"source": "parquet", "path": "train.parquet", "test_path": "test.parquet",
                 "feature_columns": ["f0", "f1", "f2", "f3"], "user_column": "author"},
        "model": {"kind": "mlp", "hidden_sizes": [8], "num_classes": 2},
        "privacy": {"mechanism": mechanism, "noise_multiplier": 1.0, "clip_norm": 1.0,
                    "unit": "user", "rows_per_user": 4, **MECHANISMS[mechanism]},
        "training": {"epochs": 1, "batch_size": 10, "max_physical_batch": 16, "lr": 0.1,
                     "workers": 2},
        "budget": {"name": "authors", "epsilon": 50.0, "delta": 1e-5,
                   "ledger": str(tmp_path / "ledger")},
        "run": {"output_dir": str(tmp_path / "runs")},
    }
    path = tmp_path / f"{mechanism}.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    return path


# make test: test_user_level.py's local run of each mechanism, test_user_budget.py's refusal
# by unit, and the per-user sweep below
@pytest.mark.long
@pytest.mark.thorough
def test_every_mechanism_runs_per_user_on_two_workers(ray_session, tmp_path, capsys):
    for mechanism in MECHANISMS:
        assert main(["run", str(write_pipeline(tmp_path, mechanism))]) == 0, mechanism
        printed = capsys.readouterr().out
        assert "per user (all of a user's rows; at most 4 a step)" in printed
        (run_dir,) = (tmp_path / "runs").glob(f"users-{mechanism}-*")
        privacy = json.loads((run_dir / "privacy.json").read_text())
        assert privacy["unit"] == "user" and privacy["rows_per_user"] == 4
        assert privacy["workers"] == 2 and privacy["num_examples"] <= 60  # users, not rows
        assert privacy["sampling_rate"] == pytest.approx(10 / privacy["num_examples"])
    ledger = str(tmp_path / "ledger")
    assert main(["budget", "status", "authors", "--ledger", ledger]) == 0
    assert "per user" in capsys.readouterr().out
    example = ["--set", "privacy.unit=example", "--set", "data.user_column=null",
               "--set", "privacy.rows_per_user=null"]
    assert main(["run", str(write_pipeline(tmp_path, "dpsgd")), *example]) == 2
    assert "privacy.unit: budget 'authors' counts epsilon per user" in capsys.readouterr().err
    assert len(list((tmp_path / "runs").iterdir())) == 3  # the refused run made nothing


@pytest.mark.thorough
def test_a_sweep_spends_per_user_from_a_per_user_budget(ray_session, tmp_path, capsys):
    """Two trials per user, selected on a private validation file released per user: each
    trial's charges (steps and its noisy release) are per user, and the budget says so."""
    path = write_pipeline(tmp_path, "dpsgd")
    write_users_file(tmp_path / "dev.parquet", rows=60, seed=2)
    pipeline = yaml.safe_load(path.read_text())
    pipeline["data"]["validation"] = {"path": "dev.parquet", "noise_multiplier": 5.0}
    pipeline["training"]["workers"] = 1
    pipeline["budget"]["name"] = "authors-sweep"
    pipeline["tune"] = {"num_samples": 2, "max_concurrent_trials": 1,
                        "metric": "validation_accuracy", "mode": "max",
                        "search_space": {"training.lr": {"choice": [0.05, 0.2]}}}
    pipeline["run"]["seed"] = 0
    path.write_text(yaml.safe_dump(pipeline))
    assert main(["tune", str(path)]) == 0
    capsys.readouterr()
    assert main(["budget", "status", "authors-sweep", "--ledger", str(tmp_path / "ledger"),
                 "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    users = len(set(pq.read_table(tmp_path / "train.parquet").column("author").to_pylist()))
    assert status["unit"] == "user" and status["steps_spent"] == 2 * (users // 10)
    assert sum(owner["releases"] for owner in status["owners"].values()) == 2  # one a trial
