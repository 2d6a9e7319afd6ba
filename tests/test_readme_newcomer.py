"""A newcomer follows README.md's "Your own CSV and your own PyTorch model": in an empty
folder, the three files as the README shows them and its four commands in order, with the
installed `raydp-train` on the path, nothing else of the repository at hand. Each command
succeeds and says what the README says it does, in well under the ten minutes the README
promises a newcomer (on this 2-core machine)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from doc_blocks import marked_block

from raydp_train.models.predictions import predict

BIN = Path(sys.executable).parent
FILES = ("make_data.py", "model.py", "patients.yaml")


def _commands() -> list[str]:
    text = marked_block("README.md", "newcomer commands").replace("\\\n", " ")
    return [line.split("  #", 1)[0].strip() for line in text.splitlines() if line.strip()]


def _shell(command: str, folder: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


def test_the_readme_walk_from_an_empty_folder(tmp_path):
    folder = tmp_path / "my-project"
    folder.mkdir()
    for name in FILES:
        (folder / name).write_text(marked_block("README.md", f"newcomer {name}"))
    # The newcomer's shell: the environment's executables first, a cache and home of their own.
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "RAYDP_TRAIN_CACHE": str(tmp_path / "cache"), "RAYDP_TRAIN_HOME": str(tmp_path / "home")}
    env.pop("RAY_ADDRESS", None)
    commands = _commands()
    assert [c.split()[:2] for c in commands] == [
        ["python", "make_data.py"], ["raydp-train", "validate"], ["raydp-train", "run"],
        ["raydp-train", "predict"]]

    started = time.monotonic()
    outputs = []
    for command in commands:
        done = _shell(command, folder, env)
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        assert "Traceback" not in done.stdout + done.stderr, command
        outputs.append(done.stdout)
    elapsed = time.monotonic() - started
    assert elapsed < 600, f"the walk took {elapsed:.0f} s"

    _, validated, trained, predicted = outputs
    assert {p.name for p in folder.glob("patients*.csv")} == {"patients.csv",
                                                               "patients_test.csv"}
    assert "epsilon" in validated and "noise multiplier" in validated.lower()
    (run_dir,) = (folder / "runs").glob("patients-*")
    record = json.loads((run_dir / "record.json").read_text())
    privacy = json.loads((run_dir / "privacy.json").read_text())
    # The target is spent, not passed: sigma was calibrated to epsilon 3.
    assert privacy["epsilon"] == pytest.approx(3.0, abs=0.05) and privacy["epsilon"] <= 3.0
    assert f"epsilon {privacy['epsilon']:.4f}" in trained
    assert privacy["workers"] == 2 and len(record["metrics"]) == 10
    assert sum(record["training"]["training_rows_per_worker"]) == 800
    accuracy = record["metrics"][-1]["test_accuracy"]
    assert accuracy > 0.7  # learned: the classes are about even, so chance is near 0.5
    assert f"accuracy                {accuracy:.4f}" in predicted
    result = predict(run_dir, folder / "patients_test.csv")
    assert result.accuracy == pytest.approx(accuracy, abs=1e-6)
