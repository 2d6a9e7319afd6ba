"""Runs across Ray nodes in their own network namespaces, joined by shaped links
(tests/cluster_nodes.py; issue 28). Needs root, `ip` and `tc`: skipped with the reason
otherwise (README, "Running on a cluster")."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cluster_nodes import BIN, start_cluster, unavailable

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ["pipelines/quickstart.yaml", "--set", "run.seed=0", "--set", "training.epochs=3",
              "--set", "training.workers=2"]


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


def test_two_workers_on_two_nodes_train_as_two_workers_on_one(cluster, tmp_path):
    """STRICT_SPREAD puts one worker on each node; the run, its one noise draw per step and its
    epsilon are those of the same two workers on one node, to the last bit."""
    spread = tmp_path / "spread"
    done = cluster.run(cluster.head, [str(BIN / "raydp-train"), "run", *QUICKSTART,
                                      "--address", cluster.address,
                                      "--set", "training.placement=strict_spread",
                                      "--set", f"run.output_dir={spread}"], cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    across = record_of(spread)
    assert sorted(across["training"]["worker_nodes"]) == sorted(n.ip for n in cluster.nodes)

    alone = tmp_path / "alone"
    done = subprocess.run([str(BIN / "raydp-train"), "run", *QUICKSTART,
                           "--set", f"run.output_dir={alone}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, check=False, env=_embedded_env())
    assert done.returncode == 0, done.stderr[-3000:]
    single = record_of(alone)
    assert len(set(single["training"]["worker_nodes"])) == 1
    assert across["privacy"]["epsilon"] == single["privacy"]["epsilon"]
    assert across["metrics"] == [{**row, "elapsed_s": across_row["elapsed_s"]}
                                 for row, across_row in zip(single["metrics"], across["metrics"],
                                                            strict=True)]


def _embedded_env() -> dict:
    import os

    return {key: value for key, value in os.environ.items()
            if key not in ("RAY_ADDRESS",)} | {"RAY_USAGE_STATS_ENABLED": "0",
                                               "PATH": f"{BIN}:{os.environ['PATH']}",
                                               "PYTHON": sys.executable}
