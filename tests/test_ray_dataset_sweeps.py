"""A sweep over Ray Datasets (`tune(pipeline, datasets=...)`): its splits cut (seeded) and
checked once on the driver, every trial's workers reading the same rows from the object store:
the same metrics and epsilons as a sweep over those rows in Parquet, no row written under
run.output_dir (every file scanned for each row's token), the budget's spend dp-accounting's;
a saved Hugging Face dataset sweeps too; datasets that do not fit are refused before Ray."""

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
