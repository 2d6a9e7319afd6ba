"""A newcomer follows README.md's "Your own CSV and your own PyTorch model": in an empty
folder, the three files as the README shows them and its four commands in order, with the
installed `raydp-train` on the path, nothing else of the repository at hand. Each command
succeeds and says what the README says it does, in well under ten minutes on this 2-core
machine. Then their third day with the run: `predict --data` reads the format its extension
names (a Parquet file on a CSV run), `--output` writes the format its extension names, and
an error names their file, never the cached Parquet copy of it."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.csv
import pyarrow.parquet as pq
import pytest
from doc_blocks import marked_block

from raydp_train.commands.cli import main
from raydp_train.models.predictions import predict

# Every test here starts processes (Ray, the CLI's embedded Ray or a subprocess).
pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
FILES = ("make_data.py", "model.py", "patients.yaml")


def _commands() -> list[str]:
    text = marked_block("README.md", "newcomer commands").replace("\\\n", " ")
    return [line.split("  #", 1)[0].strip() for line in text.splitlines() if line.strip()]


def _shell(command: str, folder: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=600, check=False)


@pytest.mark.long
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
    _third_day(run_dir, folder, result.classes, accuracy, env)


def _third_day(run_dir: Path, folder: Path, classes, accuracy: float, env: dict) -> None:
    test = pyarrow.csv.read_csv(folder / "patients_test.csv")
    pq.write_table(test, folder / "test.parquet")  # the same rows, as Parquet
    pyarrow.csv.write_csv(test.drop_columns(["bmi"]), folder / "no_bmi.csv")
    read = {"csv": pyarrow.csv.read_csv, "parquet": pq.read_table,
            "json": lambda path: [json.loads(line) for line in path.read_text().splitlines()]}
    for data, written in (("test.parquet", "csv"), ("patients_test.csv", "json"),
                          ("patients_test.csv", "parquet")):
        output = folder / f"predictions.{written}"
        done = _shell(f"raydp-train predict {run_dir} --data {data} --output {output.name}",
                      folder, env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"accuracy                {accuracy:.4f}" in done.stdout
        table = read[written](output)
        rows = table if written == "json" else table.to_pylist()
        assert [row["prediction"] for row in rows] == list(classes), written
        assert [row["row"] for row in rows] == list(range(len(classes)))

    # The using-a-model guide's lines, as written.
    for command in marked_block("docs/guides/using-a-model.md", "predict").splitlines():
        done = _shell(command, folder, env)
        assert done.returncode == 0, command + done.stdout + done.stderr
        assert f"accuracy                {accuracy:.4f}" in done.stdout, command

    refused = _shell(f"raydp-train predict {run_dir} --data patients_test.csv --output p.txt",
                     folder, env)
    assert refused.returncode == 2 and "--output: p.txt names no format" in refused.stderr
    assert not (folder / "p.txt").exists()
    assert main(["predict", str(run_dir), "--data", str(folder / "no_bmi.csv")]) == 2
    missing = _shell(f"raydp-train predict {run_dir} --data no_bmi.csv", folder, env)
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert f"not in {folder / 'no_bmi.csv'};" in missing.stderr, missing.stderr
    assert ".parquet" not in missing.stderr and "cache" not in missing.stderr
