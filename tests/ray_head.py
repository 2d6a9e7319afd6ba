"""A real `ray start --head` on loopback for tests and benchmarks, isolated from every other Ray
on the machine: its own ports, its own temporary directory, and a marker in the environment
of every process it starts, so it is stopped by killing exactly those processes (`ray stop`
would stop every Ray of this user, other people's test sessions included).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BIN = Path(sys.executable).parent
MARKER = "RAYDP_TRAIN_TEST_PROCESSES"
_PORT_OPTIONS = ("--port", "--dashboard-port", "--ray-client-server-port",
                 "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                 "--metrics-export-port", "--runtime-env-agent-port", "--node-manager-port",
                 "--object-manager-port")


@dataclass
class RayHead:
    temp: Path  # short (Unix socket paths are limited): /tmp/rdp...
    env: dict  # for clients: RAY_TMPDIR of the head, no RAY_ADDRESS, auth off, the marker
    address: str  # GCS, for RAY_ADDRESS
    dashboard: str  # http://..., for `ray job submit --address`
    blocking: subprocess.Popen | None = None  # `ray start --block`: the head lives as long


def isolated_env(marker: Path, ray_tmpdir: Path | None = None) -> dict:
    """An environment whose processes carry `marker` (see stop_marked), with no RAY_ADDRESS,
    and whose Ray keeps its files in `ray_tmpdir` (None: Ray's default, /tmp/ray)."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("RAY_ADDRESS", "RAY_TMPDIR")}
    env.update(RAY_AUTH_MODE="disabled", **{MARKER: str(marker)})
    if ray_tmpdir is not None:
        env["RAY_TMPDIR"] = str(ray_tmpdir)
    return env


# Ray waits a fixed 30 s for a new raylet to register with its GCS (ray/_private/node.py);
# a loaded 2-core machine, with other Rays beside it, can miss that once.
RAY_START_TIMED_OUT = "timed out during startup"


def start_head(num_cpus: int = 4, block: bool = False) -> RayHead:
    """`block`: as the README starts one (`ray start --block &`), so that ending that one
    process stops this head and every process it started, and no other Ray. A start that
    misses Ray's own 30 s raylet wait is tried once more; any other failure is raised."""
    try:
        return _start_head(num_cpus, block)
    except (RuntimeError, subprocess.CalledProcessError) as error:
        if RAY_START_TIMED_OUT not in f"{error} {getattr(error, 'stderr', '')}":
            raise
        return _start_head(num_cpus, block)


def _start_head(num_cpus: int, block: bool) -> RayHead:
    temp = Path(tempfile.mkdtemp(prefix="rdp", dir="/tmp"))
    # RAY_TMPDIR: the head records its address under `temp`, where a client's plain
    # ray.init() would find it, just as it finds a head started in /tmp/ray.
    env = isolated_env(temp, ray_tmpdir=temp)
    ports = dict(zip(_PORT_OPTIONS, free_ports(len(_PORT_OPTIONS)), strict=True))
    command = [str(BIN / "ray"), "start", "--head", "--num-cpus", str(num_cpus),
               "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1",
               "--include-dashboard", "true",
               *[str(part) for option, port in ports.items() for part in (option, port)]]
    blocking = None
    try:
        if block:
            blocking = _start_blocking([*command, "--block"], env, temp / "ray-head.log")
        else:
            subprocess.run(command, env=env, check=True, timeout=180, capture_output=True)
    except BaseException:
        stop_marked(str(temp))
        raise
    return RayHead(temp, env, f"127.0.0.1:{ports['--port']}",
                   f"http://127.0.0.1:{ports['--dashboard-port']}", blocking)


def _start_blocking(command: list[str], env: dict, log: Path) -> subprocess.Popen:
    """`ray start --block` in the background, returned once it says the head is up."""
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while "block forever" not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ray start --block did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return process


def stop_head(head: RayHead) -> None:
    stop_marked(str(head.temp))
    shutil.rmtree(head.temp, ignore_errors=True)


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def marked_processes(marker: str) -> list[int]:
    """The processes whose environment carries MARKER=marker (started from isolated_env)."""
    wanted = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def stop_marked(marker: str, grace_s: float = 3.0) -> None:
    """SIGTERM every marked process, then SIGKILL what is left after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in marked_processes(marker):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while marked_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
