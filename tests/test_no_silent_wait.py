"""No silent wait: what can never be placed is refused before anything is spent,
in one line; a wait for resources is said every 30 s; a driver outside the cluster joined by
its GCS address is refused with Ray Client's address; an embedded Ray that did not start is
tried once more, and says so."""

import threading
import time

import pytest

from raydp_train.commands.cli import main
from raydp_train.runs import resources
from raydp_train.runs.resources import ResourceError
from raydp_train.train import waits


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_resource_no_node_has_is_one_line_before_any_budget(ray_session, tmp_path, capsys):
    """The session's embedded Ray has CPUs only: a custom resource per worker, a GPU or a GPU
    model would be waited for ever by Ray Train; each is refused before the budget opens."""
    from raydp_train.config.training import TrainingConfig

    code = main(["run", "pipelines/quickstart.yaml", "--set",
                 "training.worker_resources={big_memory: 1}",
                 "--set", f"run.output_dir={tmp_path}/runs", "--set", "budget.name=b",
                 "--set", f"budget.ledger={tmp_path}/ledger", "--set", "budget.epsilon=10",
                 "--set", "budget.delta=1e-5"])
    output = capsys.readouterr()
    lines = [line for line in (output.out + output.err).splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (
        "error: training.worker_resources: each worker asks for 1 big_memory, but no live node "
        "of the Ray cluster has that much big_memory; start nodes with it (`ray start "
        "--resources='{\"big_memory\": 1}'`) or remove it")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "ledger").exists()
    with pytest.raises(ResourceError, match="training.use_gpu: true, but no live node of the "
                                            "Ray cluster has a GPU; set use_gpu: false"):
        resources.check_cluster(TrainingConfig(use_gpu=True))
    no_model = TrainingConfig(use_gpu=True, accelerator_type="A100").worker_bundle()
    assert no_model == {"GPU": 1.0, "accelerator_type:A100": 0.001}


def _nodes(monkeypatch, *nodes: dict) -> None:
    import ray

    listed = [{"Alive": True, "Resources": node} for node in nodes]
    monkeypatch.setattr(ray, "nodes", lambda: [*listed, {"Alive": False, "Resources": {
        "CPU": 64.0, "GPU": 8.0, "accelerator_type:H100": 1.0}}])  # a dead node counts nothing


def test_workers_are_placed_node_by_node_not_from_the_cluster_s_sums(monkeypatch):
    from raydp_train.config.training import TrainingConfig

    _nodes(monkeypatch, {"CPU": 8.0, "GPU": 1.0, "accelerator_type:A10G": 1.0},
           {"CPU": 8.0, "GPU": 1.0, "accelerator_type:A10G": 1.0, "fast_disk": 1.0})
    resources.check_cluster(TrainingConfig(workers=2, use_gpu=True, accelerator_type="A10G"))
    with pytest.raises(ResourceError, match="training.accelerator_type: H100, but no live node "
                                            r"of the Ray cluster has that GPU model \(its nodes "
                                            r"have: A10G\); name one of those, or null"):
        resources.check_cluster(TrainingConfig(use_gpu=True, accelerator_type="H100"))
    with pytest.raises(ResourceError, match=r"has 2 GPU\(s\)"):
        resources.check_cluster(TrainingConfig(workers=3, use_gpu=True))
    with pytest.raises(ResourceError, match=r"2 workers each asking for \{CPU: 1, fast_disk: "
                                            r"1\}, but the live nodes of the Ray cluster hold 1"):
        resources.check_cluster(TrainingConfig(workers=2, worker_resources={"fast_disk": 1}))
    with pytest.raises(ResourceError, match="2 live node.s., 1 of them able to hold a worker"):
        resources.check_cluster(TrainingConfig(workers=2, placement="strict_spread",
                                               worker_resources={"fast_disk": 0.5}))
    _nodes(monkeypatch, {"CPU": 8.0, "GPU": 1.0}, {"CPU": 8.0, "fast_disk": 1.0})
    with pytest.raises(ResourceError, match=r"each worker asks for \{GPU: 1, fast_disk: 1\}, "
                                            "but no live node of the Ray cluster has all of it"):
        resources.check_cluster(TrainingConfig(use_gpu=True, worker_resources={"fast_disk": 1}))
    _nodes(monkeypatch)  # only a dead node
    with pytest.raises(ResourceError, match=r"each worker asks for \{CPU: 1\}, but no live node"):
        resources.check_cluster(TrainingConfig())


def test_resources_named_twice_are_refused_by_field():
    from raydp_train.config.pipeline import PipelineError, pipeline_from_dict

    base = {"name": "p", "data": {"source": "synthetic"}, "model": {"kind": "logistic"},
            "privacy": {"noise_multiplier": 1.0}}
    refusals = (
        ({"accelerator_type": "A100"},
         "training.accelerator_type: a GPU model is asked for GPUs: set use_gpu: true too"),
        ({"worker_resources": {"GPU": 1}},
         "training.worker_resources: GPU: not a custom resource"),
        ({"worker_resources": {"x": 0}}, "training.worker_resources.x: must be > 0"))
    for training, said in refusals:
        with pytest.raises(PipelineError, match=said.replace(".", r"\.")):
            pipeline_from_dict({**base, "training": training})


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
    training = type("Training", (), {"use_gpu": False, "workers": 1})()
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
