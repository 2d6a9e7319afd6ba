"""Preflight of resources: the cluster answers and has what the pipeline asks for, checked
before any budget is reserved, so a missing GPU or a dead address is one line, not a traceback
after minutes of Ray retrying (`ray.init` retries an unreachable GCS for minutes; Ray Train
waits for GPUs that never come)."""

from __future__ import annotations

import os
import socket
import sys

from raydp_train.errors import UserError

# Long enough for a head across a slow network, short enough for a user to wait through.
ADDRESS_TIMEOUT_S = 3.0
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
    """After joining Ray: the cluster has a GPU per worker if asked, and a CPU per worker."""
    import ray

    available = ray.cluster_resources()
    workers = training.workers
    if training.use_gpu and available.get("GPU", 0) < workers:
        raise ResourceError(
            f"training.use_gpu: true with training.workers {workers}, but the Ray cluster has "
            f"{available.get('GPU', 0):g} GPU(s); set use_gpu: false or add GPU nodes")
    if available.get("CPU", 0) < workers:
        raise ResourceError(
            f"training.workers: {workers} workers need {workers} CPUs, but the Ray cluster has "
            f"{available.get('CPU', 0):g}; lower training.workers or add nodes")


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
        raise ResourceError(ray_start_problem(address, error)) from error
    check_cluster(training)


def ray_start_problem(address: str | None, error: Exception) -> str:
    """One line for a Ray that would not start or let us join: its cause, and what to try."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = (lines[0] if lines else type(error).__name__)[:200]
    if address and address != "local":
        return (f"--address {address}: could not join the Ray cluster ({cause}); check that "
                "it runs the same Ray version as this machine (`ray --version`) and that this "
                "machine can reach every node, or unset it to run on an embedded local Ray")
    return (f"an embedded local Ray did not start ({cause}); Ray gives its processes 30 s: "
            "on a busy machine try again with fewer other processes running, point RAY_TMPDIR "
            "at a short local folder with free space, or start Ray yourself (`ray start "
            "--head`) and pass --address")
