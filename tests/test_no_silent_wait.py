"""No silent wait: what can never be placed is refused before anything is spent,
in one line; a wait for resources is said every 30 s; a driver outside the cluster joined by
its GCS address is refused with Ray Client's address; an embedded Ray that did not start is
tried once more, and says so."""

import threading
import time

import pytest

from raydp_train.commands.cli import main
from raydp_train.runs import resources, waits
from raydp_train.runs.resources import ResourceError


def test_strict_spread_with_fewer_nodes_than_workers_is_one_line(ray_session, tmp_path, capsys):
    started = time.monotonic()
    code = main(["run", "pipelines/quickstart.yaml", "--set", "training.workers=2",
                 "--set", "training.placement=strict_spread",
                 "--set", f"run.output_dir={tmp_path}/runs"])
    output = capsys.readouterr()
    lines = [line for line in (output.out + output.err).splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert "training.placement: strict_spread puts each of the 2 workers on a node of its own, " \
           "but the Ray cluster has 1 live node(s)" in lines[0]
    assert time.monotonic() - started < 30
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("address", ["10.0.0.5:6379", "10.0.0.5"])
def test_a_driver_outside_the_cluster_on_its_gcs_address_is_refused(monkeypatch, address):
    import ray

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "192.0.2.77")  # not here
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    with pytest.raises(ResourceError, match=r"this machine is not a node of that cluster .* "
                                            r"--address ray://10\.0\.0\.5:10001"):
        resources.check_driver_on_a_node(address)
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "127.0.0.1")  # a node here
    resources.check_driver_on_a_node(address)
    resources.check_driver_on_a_node("ray://10.0.0.5:10001")  # Ray Client: from anywhere


def test_an_embedded_ray_that_did_not_start_is_tried_once_more(monkeypatch, capsys):
    import ray

    from raydp_train.train import trainer

    tries = []

    def start(address, num_cpus, verbose):
        tries.append(resources.os.environ.get("RAY_gcs_server_port_wait_time_s"))
        if len(tries) < outcomes:
            raise RuntimeError("The current node timed out during startup.")

    monkeypatch.setattr(trainer, "ensure_ray", start)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(resources, "check_cluster", lambda training: None)
    monkeypatch.delenv("RAY_gcs_server_port_wait_time_s", raising=False)
    training = type("Training", (), {"use_gpu": False})()
    outcomes = 2  # the second start works
    resources.connect(None, training, 4)
    assert tries == [None, "90"]
    assert "did not start (The current node timed out during startup.); trying once more, " \
           "waiting up to 90 s" in capsys.readouterr().err
    assert "RAY_gcs_server_port_wait_time_s" not in resources.os.environ
    tries.clear()
    outcomes = 3  # neither works: one line that says it tried twice
    with pytest.raises(ResourceError, match="did not start twice, the second time waiting 90 s"):
        resources.connect(None, training, 4)


def test_a_wait_for_resources_is_said(monkeypatch):
    import ray

    table = {"pg": {"state": "PENDING", "strategy": "STRICT_SPREAD",
                    "bundles": {0: {"CPU": 1.0}, 1: {"CPU": 1.0}}}}
    monkeypatch.setattr(ray.util, "placement_group_table", lambda: table)
    monkeypatch.setattr(waits, "_free", lambda: "CPU 2, GPU 0, 1 live node(s)")
    said, stop = [], threading.Event()
    watcher = waits.watch_waits(stop, said.append, every=0.05)
    deadline = time.monotonic() + 5
    while not said and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    watcher.join(5)
    assert said[0].startswith("waiting 0 s for resources: 2 x {CPU: 1} (STRICT_SPREAD); free "
                              "now: CPU 2, GPU 0, 1 live node(s). It waits until they come")
    assert "Ctrl-C" in said[0] and not watcher.is_alive()
