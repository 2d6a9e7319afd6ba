"""`data.sampler: streaming` (ARCHITECTURE.md §2.13): each worker reads, step by step, the
rows that the per-row draws (privacy/step_draws.py, tested in test_step_draws.py) put in each
step; refused by name where it cannot serve; `auto` chooses by a worker's share of the file;
and a run on a training file several times the object store's memory."""

import itertools
import json
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydp_train.config.data import streaming_refusal
from raydp_train.config.errors import PipelineError
from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.data.streaming import (
    ROW,
    STEP,
    EpochDraws,
    choose_sampler,
    epoch_steps,
    steps_in_order,
    worker_rows,
)
from raydp_train.privacy.step_draws import row_steps


def _files(folder, rows=3000, width=4):
    for name, count in (("train", rows), ("test", 50)):
        ids = np.arange(count)
        values = np.random.default_rng(0).random((count, width), dtype=np.float32)
        values[:, 0] = ids  # the row's id, so a test can tell the rows read
        x = pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), width)
        pq.write_table(pa.table({"x": x, "label": ids % 2}), folder / f"{name}.parquet",
                       row_group_size=256)
    return folder / "train.parquet"


def _pipeline(folder, **data):
    return pipeline_from_dict({
        "name": "streamed",
        "data": {"source": "parquet", "path": str(folder / "train.parquet"),
                 "test_path": str(folder / "test.parquet"), "tensor_column": "x", **data},
        "model": {"kind": "logistic", "num_classes": 2},
        "privacy": {"noise_multiplier": 1.0},
        "training": {"workers": 2, "batch_size": 100},
    })


def test_steps_come_in_order_every_step_even_empty():
    schema = pa.schema([("x", pa.int64())])

    def batch(steps):
        return pa.table({"x": [10 * s for s in steps], STEP: steps, ROW: list(range(len(steps)))})

    # step 1 spans two batches; steps 0, 3, 5 and 6 have no rows
    batches = [batch([1, 1]), batch([1, 2, 2, 4]), batch([4])]
    steps = list(steps_in_order(batches, 7, schema))
    assert [table.column("x").to_pylist() for table in steps] == [
        [], [10, 10, 10], [20, 20], [], [40, 40], [], []]
    assert all(table.schema == schema for table in steps)  # no STEP or ROW column left
    assert [t.num_rows for t in steps_in_order([], 3, schema)] == [0, 0, 0]
    with pytest.raises(RuntimeError, match="out of step order"):
        list(steps_in_order([batch([2]), batch([1])], 3, schema))
    with pytest.raises(RuntimeError, match="out of step order"):
        list(steps_in_order([batch([0, 3])], 3, schema))


def test_worker_rows_partition_the_rows():
    for rows, workers in ((10, 3), (2, 4), (1000, 7)):
        runs = [worker_rows(rows, workers, rank) for rank in range(workers)]
        assert runs[0][0] == 0 and runs[-1][1] == rows
        assert all(a[1] == b[0] for a, b in itertools.pairwise(runs))
        assert max(b - a for a, b in runs) - min(b - a for a, b in runs) <= 1


@pytest.mark.parametrize(("data", "field"), [
    ({"test_path": None}, "data.sampler"),
    ({"max_rows": 100}, "data.max_rows"),
    ({"validation": {"fraction": 0.1, "private": False}}, "data.validation.fraction"),
])
def test_streaming_refused_by_name_where_it_cannot_serve(tmp_path, data, field):
    _files(tmp_path)
    with pytest.raises(PipelineError, match=field.replace(".", r"\.")):
        _pipeline(tmp_path, sampler="streaming", **data)
    assert choose_sampler(_pipeline(tmp_path, sampler="auto", sampler_memory_mb=1, **data)) == (
        "memory")  # auto never picks what is refused


def test_the_prefix_cache_and_one_worker_sweeps_are_refused_by_name(tmp_path):
    _files(tmp_path)
    data = _pipeline(tmp_path, sampler="streaming").data
    assert streaming_refusal(data) is None
    assert streaming_refusal(data, cache_frozen_prefix=True)[1] == "training.cache_frozen_prefix"
    assert "training.workers >= 2" in streaming_refusal(data, one_worker_sweep=True)[0]


def test_auto_streams_when_a_workers_share_exceeds_the_threshold(tmp_path):
    _files(tmp_path, rows=40_000, width=16)  # 2.7 MiB of x and labels, 1.4 MiB a worker
    assert choose_sampler(_pipeline(tmp_path, sampler="auto", sampler_memory_mb=1)) == "streaming"
    assert choose_sampler(_pipeline(tmp_path, sampler="auto", sampler_memory_mb=2)) == "memory"
    assert choose_sampler(_pipeline(tmp_path)) == "memory"  # the default threshold: 2 GiB
    assert choose_sampler(_pipeline(tmp_path, sampler="streaming")) == "streaming"


def test_each_worker_reads_the_rows_its_draws_put_in_each_step(ray_session, tmp_path):
    """The rows two ranks read for each step are exactly the step's draws over the file,
    each rank its own run of rows: the union is one Poisson sample of the whole file."""
    path = _files(tmp_path)
    draws = EpochDraws(seed=11, epoch=2, steps=30, sampling_rate=0.03)
    read = [list(epoch_steps(path, ["x", "label"], worker_rows(3000, 2, rank), draws))
            for rank in range(2)]
    rows, step_ids = row_steps(11, 2, 0, 3000, 30, 0.03)
    for rank, steps in enumerate(read):
        first, stop = worker_rows(3000, 2, rank)
        assert len(steps) == 30
        for step, table in enumerate(steps):
            ids = [int(v[0]) for v in table.column("x").to_pylist()]  # x holds the row id
            drawn = rows[(step_ids == step) & (rows >= first) & (rows < stop)]
            assert ids == drawn.tolist(), (rank, step)


@pytest.mark.long
def test_a_restarted_run_draws_the_same_rows_for_the_epoch_it_repeats(ray_session, tmp_path):
    """A worker fails in epoch 2 and the group restarts from epoch 1's checkpoint: the epoch
    run again samples exactly the rows the uninterrupted run sampled (the draws are keyed by
    seed, epoch and row; the in-memory sampler's generator would start over instead)."""
    import faults
    import ray

    from raydp_train.train.plan import make_plan
    from raydp_train.train.trainer import fit

    ray.cloudpickle.register_pickle_by_value(faults)
    _files(tmp_path, rows=600)
    pipeline = _pipeline(tmp_path, sampler="streaming").model_copy(deep=True)
    pipeline.training.batch_size, pipeline.training.epochs = 60, 3  # 10 steps an epoch
    pipeline.run.seed, pipeline.run.max_failures = 5, 1
    plan = make_plan(pipeline, 600)
    seen = {}
    for name, after_step in (("once", None), ("restarted", faults.FailOnce(15))):
        result = fit(pipeline, plan, tmp_path / name, on_epoch=lambda row: None,
                     after_step=after_step)
        assert result.sampler == "streaming" and result.steps_done == 30
        seen[name] = [row["examples_seen"] for row in result.metrics]
    assert (tmp_path / "restarted" / ".injected_failure").exists()
    assert seen["restarted"] == seen["once"]
    assert len(set(seen["once"])) > 1  # the epochs draw differently


RUN = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np, pyarrow as pa, pyarrow.parquet as pq, ray
    folder, rows, width, store_mib = Path(sys.argv[1]), *map(int, sys.argv[2:])
    for name, count in (("train", rows), ("test", 200)):
        x = np.random.default_rng(0).standard_normal((count, width), dtype=np.float32)
        table = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), width),
                          "label": (x[:, 0] > 0).astype(np.int64)})
        pq.write_table(table, folder / f"{name}.parquet", row_group_size=2048,
                       compression="none")
    ray.init(address="local", num_cpus=4, object_store_memory=store_mib << 20,
             include_dashboard=False, log_to_driver=False)
    import raydp_train
    from raydp_train.config.pipeline import pipeline_from_dict
    result = raydp_train.run(pipeline_from_dict({
        "name": "streamed",
        "data": {"source": "parquet", "path": str(folder / "train.parquet"),
                 "test_path": str(folder / "test.parquet"), "tensor_column": "x",
                 "sampler": "auto", "sampler_memory_mb": store_mib // 4},
        "model": {"kind": "logistic", "num_classes": 2},
        "privacy": {"noise_multiplier": 1.0, "delta": 1e-7},
        "training": {"workers": 2, "epochs": 1, "batch_size": rows // 10,
                     "max_physical_batch": 1024},
        "run": {"seed": 3, "output_dir": str(folder / "runs")},
    }), on_line=None)
    print(json.dumps({"metrics": result.metrics}))
""")


@pytest.mark.cluster
def test_a_run_streams_a_training_file_several_times_the_object_store(tmp_path, request):
    """Its own Ray with a 75 MiB object store (Ray's least) and 300 MiB of training rows.
    Minutes on 2 cores (the sort passes every row through the object store and the disk it
    spills to; RESULTS.md): in the long mode only, `pytest --long`, so `make test` keeps its
    20 minutes; benchmarks/streaming_sampler.py measures the same run."""
    if request.config.getoption("--long") is None:
        pytest.skip("minutes on 2 cores: run with --long (make test keeps its 20 minutes)")
    rows, width, store_mib = 300_000, 256, 75  # 1 KiB a row
    done = subprocess.run([sys.executable, "-c", RUN, str(tmp_path), str(rows), str(width),
                           str(store_mib)], capture_output=True, text=True, timeout=900,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "train.parquet").stat().st_size > 4 * (store_mib << 20)
    (record_path,) = (tmp_path / "runs").rglob("record.json")
    record = json.loads(record_path.read_text())
    assert record["training"]["sampler"] == "streaming"  # auto: 150 MiB a worker > 18 MiB
    assert record["training"]["training_rows_per_worker"] == [rows // 2, rows // 2]
    (epoch,) = json.loads(done.stdout.splitlines()[-1])["metrics"]
    assert epoch["steps"] == 10
    assert abs(epoch["examples_seen"] - rows) < 5 * np.sqrt(rows)  # one epoch: each row ~once
    # a worker's resident data (its test rows) is a sliver of its 150 MiB of training rows
    assert max(record["memory"]["worker_data_mb"]) < 30
