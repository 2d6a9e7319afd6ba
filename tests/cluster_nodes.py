"""Several Ray nodes on one machine, each in its own Linux network namespace, for tests and
benchmarks: the network between them is a real one, of limited bandwidth.

    switch namespace  <prefix>-sw   a bridge, no address
    node namespaces   <prefix>-n0 (head), <prefix>-n1, ...   eth0 10.213.<k>.<i + 1>/24, lo
                       up, a veth into the bridge, both directions shaped by `tbf`
    client namespace  <prefix>-c    eth0 10.213.<k>.200, the same, but no Ray: a user's
                       machine outside the cluster (`ray job submit` from there)

No namespace has a default route, and every address is inside the namespaces made here, so
no traffic leaves them. Each node runs `ray start` in its namespace with its own
`--temp-dir`, `--node-ip-address` and `--num-cpus`, and RAY_USAGE_STATS_ENABLED=0. Teardown
is by the namespace names made here: every PID in a namespace (`ip netns pids`) is killed,
then the namespace deleted; never by process name. Needs root and the `ip` and `tc` tools;
`unavailable()` says why not where they are missing.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path(sys.executable).parent
GCS_PORT, DASHBOARD_PORT = 6379, 8265
_CLUSTERS_MADE = itertools.count()
# In every node's environment, so the head's `ray start` gives them to its GCS: a node is dead
# after this many failed health checks this far apart (Ray's defaults: 5 x 3 s, 12-15 s from
# a kill -9 to the restart). A killed node refuses the check at once; a live one, however
# busy, answers within the unchanged 10 s timeout.
NODE_DEATH_DETECTION = {"RAY_health_check_period_ms": "1000",
                        "RAY_health_check_failure_threshold": "3"}


@dataclass
class Node:
    namespace: str
    ip: str
    temp: Path  # the node's --temp-dir


@dataclass
class Cluster:
    prefix: str
    switch: str
    nodes: list[Node] = field(default_factory=list)
    client: Node | None = None  # a machine on the network that runs no Ray: "outside"

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{GCS_PORT}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.head.ip}:{DASHBOARD_PORT}"

    def run(self, node: Node, command: list[str], timeout: float = 600, **options):
        """`command` inside the node's namespace, with the node's environment."""
        return subprocess.run(["ip", "netns", "exec", node.namespace, *command],
                              env=node_env(node), timeout=timeout, check=False,
                              capture_output=True, text=True, **options)

    def start(self, node: Node, command: list[str], **options) -> subprocess.Popen:
        """`command` inside the node's namespace, in the background."""
        return subprocess.Popen(["ip", "netns", "exec", node.namespace, *command],
                                env=node_env(node), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **options)

    def restart(self, cpus: int = 2) -> None:
        """Kill every node's processes, then start Ray afresh on the same namespaces (a new
        head, the other nodes joined to it): what an operator does after losing the head."""
        for node in self.nodes:
            self.kill(node)
        time.sleep(1)
        for node in self.nodes:
            _start_ray(self, node, cpus)
        _wait_for_nodes(self, len(self.nodes))

    def kill(self, node: Node) -> list[int]:
        """kill -9 every process of the node (by its namespace); the PIDs killed."""
        pids = namespace_pids(node.namespace)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def stop(self) -> None:
        machines = self.nodes + ([self.client] if self.client else [])
        for node in machines:
            self.kill(node)
        time.sleep(0.5)
        for namespace in [node.namespace for node in machines] + [self.switch]:
            subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True)
        for node in machines:
            shutil.rmtree(node.temp, ignore_errors=True)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "multi-node tests need root (ip netns, veth, tc)"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "multi-node tests need the ip and tc tools (iproute2)"
    probe = f"rdpprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                          check=False)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    return None


def node_env(node: Node) -> dict:
    """The node's own RAY_TMPDIR, so that nothing it runs reads or overwrites the address
    file of another Ray on this machine (a test session's). The nodes share this machine's
    hostname, which resolves to 127.0.0.1: torch's Gloo must be told which interface carries
    the node's address (every node's is eth0), as on any cluster whose hostnames resolve to
    loopback."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", GLOO_SOCKET_IFNAME="eth0",
               RAY_TMPDIR=str(node.temp), **NODE_DEATH_DETECTION)
    return env


def namespace_pids(namespace: str) -> list[int]:
    done = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                          check=False)
    return [int(pid) for pid in done.stdout.split()]


def start_cluster(nodes: int = 2, cpus: int = 2, rate: str | None = "1gbit") -> Cluster:
    """`nodes` Ray nodes (the first is the head), each with `cpus` logical CPUs, on links of
    `rate` each way (tbf; None: unshaped, as fast as the kernel moves packets)."""
    made = next(_CLUSTERS_MADE)  # several clusters of one process may live at once
    prefix = f"rdp{os.getpid() % 100000}{made}"
    subnet = 10 + (os.getpid() + made) % 200  # 10.213.<subnet>.0/24: one per cluster
    cluster = Cluster(prefix, f"{prefix}-sw")
    try:
        _ip("netns", "add", cluster.switch)
        _in(cluster.switch, "ip", "link", "add", "br0", "type", "bridge")
        _in(cluster.switch, "ip", "link", "set", "br0", "up")
        for index in range(nodes):
            node = Node(f"{prefix}-n{index}", f"10.213.{subnet}.{index + 1}",
                        Path(tempfile.mkdtemp(prefix=f"{prefix}n{index}", dir="/tmp")))
            cluster.nodes.append(node)
            _connect(cluster, node, index, rate)
        cluster.client = Node(f"{prefix}-c", f"10.213.{subnet}.200",
                              Path(tempfile.mkdtemp(prefix=f"{prefix}c", dir="/tmp")))
        _connect(cluster, cluster.client, 99, rate)
        for node in cluster.nodes:
            _start_ray(cluster, node, cpus)
        _wait_for_nodes(cluster, nodes)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _connect(cluster: Cluster, node: Node, index: int, rate: str | None) -> None:
    inside, outside = f"{cluster.prefix}v{index}a", f"{cluster.prefix}v{index}b"
    _ip("netns", "add", node.namespace)
    _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
    _ip("link", "set", inside, "netns", node.namespace)
    _ip("link", "set", outside, "netns", cluster.switch)
    _in(cluster.switch, "ip", "link", "set", outside, "master", "br0")
    _in(cluster.switch, "ip", "link", "set", outside, "up")
    _in(node.namespace, "ip", "link", "set", "lo", "up")
    _in(node.namespace, "ip", "link", "set", inside, "name", "eth0")
    _in(node.namespace, "ip", "addr", "add", f"{node.ip}/24", "dev", "eth0")
    _in(node.namespace, "ip", "link", "set", "eth0", "up")
    if rate is not None:
        _in(node.namespace, "tc", "qdisc", "add", "dev", "eth0", *tbf(rate))  # the node sends
        _in(cluster.switch, "tc", "qdisc", "add", "dev", outside, *tbf(rate))  # it receives


def tbf(rate: str) -> list[str]:
    """A root token-bucket qdisc of `rate` (tc's units: 100mbit, 1gbit), as `tc qdisc` words."""
    return ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]


def netem_available(cluster: Cluster) -> bool:
    """Whether this kernel has sch_netem (delay): some minimal kernels ship without it."""
    node = cluster.head
    added = cluster.run(node, ["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"])
    cluster.run(node, ["tc", "qdisc", "del", "dev", "lo", "root"])
    return added.returncode == 0


def _start_ray(cluster: Cluster, node: Node, cpus: int) -> None:
    common = ["--node-ip-address", node.ip, "--num-cpus", str(cpus),
              "--temp-dir", str(node.temp), "--disable-usage-stats"]
    if node is cluster.head:
        command = [str(BIN / "ray"), "start", "--head", "--port", str(GCS_PORT),
                   "--dashboard-host", node.ip, "--dashboard-port", str(DASHBOARD_PORT),
                   "--include-dashboard", "true", *common]
    else:
        command = [str(BIN / "ray"), "start", "--address", cluster.address, *common]
    done = cluster.run(node, command, timeout=180)
    if done.returncode != 0:
        raise RuntimeError(f"ray start on {node.namespace} failed: {done.stderr[-2000:]}")


def _wait_for_nodes(cluster: Cluster, count: int, timeout: float = 180) -> None:
    script = (f"import ray; ray.init(address={cluster.address!r}, logging_level='ERROR'); "
              "print(sum(n['Alive'] for n in ray.nodes()))")
    deadline, seen = time.monotonic() + timeout, "nothing"
    while time.monotonic() < deadline:
        try:
            done = cluster.run(cluster.head, [sys.executable, "-c", script], timeout=60,
                               cwd="/tmp")
        except subprocess.TimeoutExpired:
            continue
        if done.returncode == 0 and done.stdout.strip().endswith(str(count)):
            return
        seen = f"{done.stdout} {done.stderr[-1000:]}"
        time.sleep(2)
    raise RuntimeError(f"the cluster did not reach {count} nodes: {seen}")


def _ip(*arguments: str) -> None:
    subprocess.run(["ip", *arguments], check=True, capture_output=True, text=True)


def _in(namespace: str, *command: str) -> None:
    subprocess.run(["ip", "netns", "exec", namespace, *command], check=True,
                   capture_output=True, text=True)
