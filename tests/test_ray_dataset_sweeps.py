"""A sweep over Ray Datasets (`tune(pipeline, datasets=...)`): its splits cut (seeded) and
checked once on the driver, every trial's workers reading the same rows from the object store:
the same metrics and epsilons as a sweep over those rows in Parquet, no row written under
run.output_dir (every file scanned for each row's token), the budget's spend dp-accounting's;
a saved Hugging Face dataset sweeps too; datasets that do not fit are refused before Ray."""

import json
import math

import dp_accounting
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dp_accounting import rdp
from test_ray_datasets import files_holding_rows, pipeline_dict, rows, with_tokens

import raydp_train as rt

SIGMAS = [1.0, 2.0]


def sweep_dict(tmp_path, data: dict, name: str, sigmas=SIGMAS, epochs: int = 2,
               workers: int = 1) -> dict:
    """Trials of `workers` workers, one per sigma, on a budget of its own `name`."""
    raw = pipeline_dict(tmp_path, data)
    raw["training"].update(epochs=epochs, workers=workers)
    raw["run"]["output_dir"] = str(tmp_path / name)
    raw["budget"] = {"name": name, "epsilon": 50.0, "delta": 1e-4,
                     "ledger": str(tmp_path / f"{name}-ledger")}
    raw["tune"] = {"num_samples": 1, "max_concurrent_trials": 1,
                   "metric": "validation_accuracy", "mode": "max",
                   "search_space": {"privacy.noise_multiplier": {"grid": sigmas}}}
    return raw


def trials(sweep) -> list[dict]:
    return sorted(sweep.trials, key=lambda trial: trial["privacy.noise_multiplier"])


def composed_epsilon(trial_rows: list[dict], rate: float, delta: float) -> float:
    """dp-accounting's epsilon of every trial's steps, each at its own sigma."""
    events = [dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        rate, dp_accounting.GaussianDpEvent(trial["privacy.noise_multiplier"])),
        trial["steps_charged"]) for trial in trial_rows]
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.ComposedDpEvent(events))
    return accountant.get_epsilon(delta)


# make test: test_a_saved_hugging_face_dataset_sweeps (a sweep over Ray Datasets, no row
# written) and test_ray_datasets.py's run on 2 workers; workers=2 runs with --long only
@pytest.mark.long
@pytest.mark.parametrize("workers", [1, 2])
def test_a_sweep_over_ray_datasets_trains_as_over_the_same_rows_in_parquet(ray_session,
                                                                           tmp_path, request,
                                                                           workers):
    """One-worker trials read the datasets in their own process; two-worker trials are Ray
    Train runs whose workers read their shards (get_dataset_shard): in the long mode only."""
    import ray
    import ray.data

    if workers == 2 and request.config.getoption("--long") is None:
        pytest.skip("minutes on 2 cores: run with --long (make test keeps its 20 minutes)")

    from raydp_train.data.ray_datasets import ray_splits

    marked = [with_tokens(rows(500, 1), "train"), with_tokens(rows(100, 2), "test")]
    datasets = {"train": ray.data.from_arrow(marked[0]).repartition(3),
                "test": ray.data.from_arrow(marked[1])}
    handed = rt.Pipeline.from_dict(sweep_dict(tmp_path, {
        "source": "ray_dataset", "validation": {"fraction": 0.2, "private": False}},
        f"handed-{workers}", workers=workers))
    # The seeded cut every trial reads, written OUTSIDE run.output_dir for the Parquet sweep.
    paths = {}
    for name, split in ray_splits(handed, datasets).items():
        paths[name] = str(tmp_path / f"{name}.parquet")
        pq.write_table(pa.concat_tables(ray.get(split.to_arrow_refs())), paths[name])
    files = rt.Pipeline.from_dict(sweep_dict(tmp_path, {
        "source": "parquet", "path": paths["train"], "test_path": paths["test"],
        "validation": {"path": paths["validation"], "private": False}}, f"files-{workers}",
        workers=workers))
    swept = rt.tune(handed, datasets=datasets, on_line=None)
    from_files = rt.tune(files, on_line=None)
    assert files_holding_rows(tmp_path / f"handed-{workers}", marked) == []
    # the scan finds rows: the train and validation files cut from the train rows
    assert files_holding_rows(tmp_path, marked[:1]) == [paths["train"], paths["validation"]]
    assert len(swept.trials) == len(from_files.trials) == 2
    for trial, same in zip(trials(swept), trials(from_files), strict=True):
        assert trial["stop_reason"] == same["stop_reason"] == "completed"
        assert trial["steps_charged"] == same["steps_charged"] == 2 * 400 // 40
        for key in ("validation_accuracy", "test_accuracy", "epsilon"):
            assert trial[key] == same[key], key
    assert swept.privacy["epsilon"] == pytest.approx(
        composed_epsilon(trials(swept), 40 / 400, 1e-4), rel=1e-9)
    assert swept.privacy["epsilon"] == pytest.approx(from_files.privacy["epsilon"], rel=1e-12)


def test_a_saved_hugging_face_dataset_sweeps(ray_session, tmp_path):
    datasets = pytest.importorskip("datasets")
    marked = {"train": with_tokens(rows(300, 1), "train"), "test": with_tokens(rows(80, 2), "test"),
              "dev": with_tokens(rows(60, 3), "dev")}
    datasets.DatasetDict({name: datasets.Dataset(table) for name, table in marked.items()}
                         ).save_to_disk(str(tmp_path / "hf"))
    pipeline = rt.Pipeline.from_dict(sweep_dict(tmp_path, {
        "source": "hf_dataset", "path": str(tmp_path / "hf"), "validation_split": "dev",
        "validation": {"private": False}}, "hf-sweep", sigmas=[1.0], epochs=1))
    swept = rt.tune(pipeline, on_line=None)
    assert [trial["stop_reason"] for trial in swept.trials] == ["completed"]
    assert all(0 < trial["validation_accuracy"] <= 1 for trial in swept.trials)
    assert not any(math.isnan(trial["test_accuracy"]) for trial in swept.trials)
    assert files_holding_rows(tmp_path / "hf-sweep", list(marked.values())) == []


# A driver of its own: a sweep over Ray Datasets made in this process from fixed seeds.
DRIVER = """
import sys
sys.path.insert(0, sys.argv[3])
import ray.data
from test_ray_dataset_sweeps import sweep_dict
from test_ray_datasets import rows, with_tokens
import raydp_train as rt
from pathlib import Path
tmp_path, given = Path(sys.argv[1]), sys.argv[2] == "rows"
raw = sweep_dict(tmp_path, {"source": "ray_dataset", "validation": {"private": False}},
                 "resumed-rows", epochs=40)
raw["run"]["seed"] = 5
tables = [with_tokens(rows(400, 1), "train"), with_tokens(rows(100, 2), "test"),
          with_tokens(rows(60, 3), "dev")]
datasets = {name: ray.data.from_arrow(table) for name, table in
            zip(("train", "test", "validation"), tables)} if given else None
try:
    rt.tune(rt.Pipeline.from_dict(raw), datasets=datasets)
except rt.UserError as error:
    print(error, file=sys.stderr)
    sys.exit(2)
"""


@pytest.mark.slow
def test_a_killed_sweep_over_ray_datasets_continues_when_given_them_again(tmp_path, request):
    """kill -9 of the driver once a trial finished and one is mid-way: without the datasets
    the same call is refused in one line; with them Tune's restore continues the sweep, the
    finished trial not run again, and still no row is written. In the long mode only."""
    if request.config.getoption("--long") is None:
        pytest.skip("minutes on 2 cores: run with --long (make test keeps its 20 minutes)")
    import shutil
    import subprocess
    import sys
    import tempfile
    import time
    from pathlib import Path

    from ray_head import isolated_env, stop_marked
    from test_sweep_resume import trial_states

    temp = Path(tempfile.mkdtemp(prefix="rdp", dir="/tmp"))  # short: Ray's socket paths
    env = isolated_env(temp, ray_tmpdir=temp)
    tests = str(Path(__file__).parent)

    def driver(rows_given: str) -> list[str]:
        return [sys.executable, "-c", DRIVER, str(tmp_path), rows_given, tests]

    try:
        first = subprocess.Popen(driver("rows"), env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and first.poll() is None:
            sweeps = list((tmp_path / "resumed-rows").glob("tables-sweep-*"))
            if sweeps and all(trial_states(sweeps[0])):
                first.kill()
                first.wait()
                break
            time.sleep(0.05)
        assert first.returncode == -9, "the sweep never had a finished and a mid-way trial"
        stop_marked(str(temp))
        (sweep,) = (tmp_path / "resumed-rows").glob("tables-sweep-*")
        finished, _ = trial_states(sweep)
        charged = {trial: len(list(sweep.glob(f"train/{trial}*/charges/*.json")))
                   for trial in finished}
        refused = subprocess.run(driver("none"), env=env, capture_output=True, text=True,
                                 timeout=600, check=False)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "data.source: ray_dataset needs the rows" in refused.stderr
        assert "given again to continue a run or sweep" in refused.stderr
        again = subprocess.run(driver("rows"), env=env, capture_output=True, text=True,
                               timeout=900, check=False)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert "continuing the unfinished sweep" in again.stdout
    finally:
        stop_marked(str(temp))
        shutil.rmtree(temp, ignore_errors=True)
    summary = json.loads((sweep / "sweep.json").read_text())
    assert [t["stop_reason"] for t in summary["trials"]] == ["completed"] * 2, summary["trials"]
    for trial, count in charged.items():  # not run again: no epoch charged after the kill
        assert len(list(sweep.glob(f"train/{trial}*/charges/*.json"))) == count, trial
    marked = [with_tokens(rows(400, 1), "train"), with_tokens(rows(100, 2), "test"),
              with_tokens(rows(60, 3), "dev")]
    assert files_holding_rows(tmp_path / "resumed-rows", marked) == []
