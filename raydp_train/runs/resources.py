"""Preflight of resources: the cluster answers and has what the pipeline asks for, checked
before any budget is reserved, so a missing GPU or a dead address is one line, not a traceback
after minutes of Ray retrying (`ray.init` retries an unreachable GCS for minutes; Ray Train
waits for GPUs that never come)."""

from __future__ import annotations

import math
import os
import socket
import sys

from raydp_train.errors import UserError

# Long enough for a head across a slow network, short enough for a user to wait through.
ADDRESS_TIMEOUT_S = 3.0
# An embedded Ray that did not start in Ray's 30 s is tried once more, its GCS given this long.
RETRY_START_WAIT_S = 90
RAY_GCS_PORT = 6379
RAY_CLIENT_PORT = 10001


class ResourceError(UserError, RuntimeError):
    """The cluster cannot run the pipeline (unreachable, or short of GPUs or CPUs)."""


def check_address(address: str | None) -> None:
    """Refuse an address whose port does not accept a connection within ADDRESS_TIMEOUT_S.
    "auto" and "local" name no port: Ray finds (or starts) those itself."""
    if not address or address in ("auto", "local"):
        return
    host, port = _host_port(address)
    try:
        with socket.create_connection((host, port), timeout=ADDRESS_TIMEOUT_S):
            return
    except OSError as error:
        reason = "no answer" if isinstance(error, TimeoutError) else (error.strerror or error)
        raise ResourceError(
            f"--address {address} (or RAY_ADDRESS): nothing answers at {host}:{port} within "
            f"{ADDRESS_TIMEOUT_S:g} s ({reason}); is the Ray head running (`ray start --head`)?"
            " Unset it to run on an embedded local Ray") from None


def _host_port(address: str) -> tuple[str, int]:
    client = address.startswith("ray://")
    hostport = address.removeprefix("ray://").rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host:
        return hostport, RAY_CLIENT_PORT if client else RAY_GCS_PORT
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise ResourceError(f"--address {address}: expected HOST:PORT, e.g. 10.0.0.5:6379") \
            from None


def check_local_gpu(training) -> None:
    """Before starting an embedded Ray: its GPUs are this machine's, one for each worker."""
    import torch

    if training.use_gpu and not torch.cuda.is_available():
        raise ResourceError("training.use_gpu: true, but this machine has no GPU that torch can "
                            "use (torch.cuda.is_available() is False); set it to false or run "
                            "on a cluster with GPUs (--address)")
    if training.use_gpu and torch.cuda.device_count() < training.workers:
        raise ResourceError(f"training.workers: {training.workers} workers need a GPU each "
                            f"(training.use_gpu: true), but this machine has "
                            f"{torch.cuda.device_count()}; lower training.workers or run on a "
                            "cluster with more GPUs (--address)")


def local_cpus() -> int:
    """The CPUs this process may run on (a container's or taskset's share, not the host's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def ray_running() -> bool:
    """Ray is initialized in this process already (then its resources are checked instead)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def warn_if_oversubscribed(training, cpus: int) -> None:
    """Before starting an embedded Ray: more workers than this machine's CPUs still run (the
    embedded Ray is given a CPU for each), but share them; one line says so."""
    if training.workers > cpus:
        print(f"warning: training.workers: {training.workers} workers on this machine's {cpus} "
              f"CPUs share them, so each step waits for the slowest (the same epsilon; up to "
              f"{cpus} workers train faster here)", file=sys.stderr, flush=True)


def check_cluster(training) -> None:
    """After joining Ray: some live node can hold a worker (its CPU, or GPU and GPU model, and
    custom resources: Ray would wait for such a node for ever), the live nodes can hold them
    all, and with strict_spread each on a node of its own. Counted from the nodes' totals: a
    busy node frees its resources later, and train/waits.py says such a wait."""
    import ray

    bundle, workers = training.worker_bundle(), training.workers
    nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
    places = [_workers_fitting(node, bundle) for node in nodes]
    if not any(places):
        raise ResourceError(_no_node_holds(training, bundle, nodes))
    holding = sum(1 for place in places if place)
    if training.placement == "strict_spread" and holding < workers:
        which = "" if holding == len(nodes) else f", {holding} of them able to hold a worker"
        raise ResourceError(
            f"training.placement: strict_spread puts each of the {workers} workers on a node of "
            f"its own, but the Ray cluster has {len(nodes)} live node(s){which}: it would wait "
            "for nodes forever; use placement: spread or pack, lower training.workers, or add "
            "nodes")
    if sum(places) < workers:
        raise ResourceError(_too_few(training, bundle, nodes, sum(places)))


def _workers_fitting(node: dict, bundle: dict) -> int:
    """How many workers asking for `bundle` a node with these resources holds at once."""
    return min(math.floor(node.get(key, 0.0) / amount + 1e-9) for key, amount in bundle.items())


def _no_node_holds(training, bundle: dict, nodes: list[dict]) -> str:
    """One line: the resource of a worker that no live node has, its field and the fix."""
    lacking = [key for key, amount in bundle.items()
               if max((node.get(key, 0.0) for node in nodes), default=0.0) < amount]
    key = lacking[0] if lacking else None
    models = sorted({name.split(":", 1)[1] for node in nodes for name in node
                     if name.startswith("accelerator_type:")})
    if key == "GPU":
        return ("training.use_gpu: true, but no live node of the Ray cluster has a GPU; set "
                "use_gpu: false or add GPU nodes")
    if key is not None and key.startswith("accelerator_type:"):
        return (f"training.accelerator_type: {training.accelerator_type}, but no live node of "
                f"the Ray cluster has that GPU model (its nodes have: "
                f"{', '.join(models) or 'none Ray names'}); name one of those, or null")
    if key is not None and key in training.worker_resources:
        return (f"training.worker_resources: each worker asks for {bundle[key]:g} {key}, but no "
                f"live node of the Ray cluster has that much {key}; start nodes with it (`ray "
                f"start --resources='{{\"{key}\": {bundle[key]:g}}}'`) or remove it")
    return (f"training: each worker asks for {_text(bundle)}, but no live node of the Ray "
            "cluster has all of it at once; ask for less per worker (training.use_gpu, "
            "accelerator_type, worker_resources) or add a node that has it")


def _too_few(training, bundle: dict, nodes: list[dict], fitting: int) -> str:
    """One line: the live nodes hold fewer workers than training.workers."""
    workers = training.workers
    total = {key: sum(node.get(key, 0.0) for node in nodes) for key in bundle}
    if bundle == {"CPU": 1.0}:
        return (f"training.workers: {workers} workers need {workers} CPUs, but the Ray cluster "
                f"has {total['CPU']:g}; lower training.workers or add nodes")
    if bundle == {"GPU": 1.0}:
        return (f"training.use_gpu: true with training.workers {workers}, but the Ray cluster has "
                f"{total['GPU']:g} GPU(s); set use_gpu: false or add GPU nodes")
    return (f"training.workers: {workers} workers each asking for {_text(bundle)}, but the "
            f"live nodes of the Ray cluster hold {fitting} at once; lower training.workers or "
            "add nodes")


def _text(bundle: dict) -> str:
    return "{" + ", ".join(f"{key}: {amount:g}" for key, amount in bundle.items()) + "}"


def check_driver_on_a_node(address: str | None) -> None:
    """A driver that joined a cluster by its GCS address (HOST:6379) must run on one of its
    nodes: from another machine it borrows a node's address it does not have, and Ray Train's
    controller waits for ever. Ray Client (ray://) is the way in from outside."""
    import ray

    if not address or address in ("auto", "local") or address.startswith("ray://"):
        return
    borrowed = ray.util.get_node_ip_address()  # the node this driver joined through
    if not _is_local_address(borrowed):
        host, _ = _host_port(address)
        ray.shutdown()
        raise ResourceError(
            f"--address {address}: this machine is not a node of that cluster (its node "
            f"{borrowed} is not an address here), and a driver joined by the GCS address "
            f"waits for ever from outside; use Ray Client, --address "
            f"ray://{host}:{RAY_CLIENT_PORT}, or `ray job submit`")


def _is_local_address(ip: str) -> bool:
    """Whether `ip` is an address of this machine: a socket can be bound to it."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((ip, 0))
        return True
    except OSError:
        return False


def connect(address: str | None, training, num_cpus: int, verbose: bool = False) -> None:
    """Join (or start) Ray for a pipeline, after and then before the checks that can fail."""
    from raydp_train.train.trainer import ensure_ray

    check_address(address)
    if not address:
        check_local_gpu(training)
        if not ray_running():  # an embedded Ray is about to start, on this machine's CPUs
            warn_if_oversubscribed(training, local_cpus())
    try:
        ensure_ray(address, num_cpus=num_cpus, verbose=verbose)
    except UserError:
        raise
    except Exception as error:
        if address:
            raise ResourceError(ray_start_problem(address, error)) from error
        _start_again(num_cpus, verbose, error)
    check_driver_on_a_node(address)
    check_cluster(training)


def _start_again(num_cpus: int, verbose: bool, error: Exception) -> None:
    """An embedded Ray that did not start (a busy machine: two runs starting at once) is
    tried once more, its GCS given RETRY_START_WAIT_S instead of 30 s; says so."""
    import ray

    from raydp_train.train.trainer import ensure_ray

    print(f"an embedded local Ray did not start ({_cause(error)}); trying once more, waiting "
          f"up to {RETRY_START_WAIT_S} s", file=sys.stderr, flush=True)
    ray.shutdown()
    wait = "RAY_gcs_server_port_wait_time_s"
    before = os.environ.get(wait)
    os.environ[wait] = before or str(RETRY_START_WAIT_S)
    try:
        ensure_ray(None, num_cpus=num_cpus, verbose=verbose)
    except Exception as again:
        raise ResourceError(ray_start_problem(None, again, tried_twice=True)) from again
    finally:
        if before is None:
            os.environ.pop(wait, None)


def _cause(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return (lines[0] if lines else type(error).__name__)[:200]


def ray_start_problem(address: str | None, error: Exception, tried_twice: bool = False) -> str:
    """One line for a Ray that would not start or let us join: its cause, and what to try."""
    cause = _cause(error)
    if address and address != "local":
        return (f"--address {address}: could not join the Ray cluster ({cause}); check that "
                "it runs the same Ray version as this machine (`ray --version`) and that this "
                "machine can reach every node, or unset it to run on an embedded local Ray")
    tries = f"twice, the second time waiting {RETRY_START_WAIT_S} s" if tried_twice else ""
    return (f"an embedded local Ray did not start{' ' + tries if tries else ''} ({cause}); "
            "Ray gives its processes 30 s: "
            "on a busy machine try again with fewer other processes running, point RAY_TMPDIR "
            "at a short local folder with free space, or start Ray yourself (`ray start "
            "--head`) and pass --address")
