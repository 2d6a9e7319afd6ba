"""Where `make test`'s time goes (issue 30): what one Ray Train run costs before it trains,
measured the way the suite pays it. An embedded Ray's start (`ray.init`, what every
fresh-process `raydp-train run` pays); a Ray Train fit of 2 workers whose loop does nothing,
three in a row on one Ray, with the phases Ray Train's controller logs for the last; what a
fresh process pays for its first torch optimizer; and the quickstart for 1 epoch through
`raydp_train.run` in this process and through `raydp-train run` in a fresh one. With each:
the CPU time the machine spent meanwhile and the share of the wall time some task waited
for a CPU.

    .venv/bin/python benchmarks/suite_floor.py          (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import cpu_wait_seconds, write_section

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).with_name("RESULTS.md")
QUICKSTART = ROOT / "pipelines" / "quickstart.yaml"
ONE_EPOCH = ["training.epochs=1", "training.workers=2"]
FITS = 3
TITLE = "## Where `make test`'s time goes (benchmarks/suite_floor.py)"


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent outside idle and I/O wait since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def timed():
    """Wall time, machine CPU seconds and CPU contention of a `with` block."""
    took = SimpleNamespace()
    started, busy, waited = time.perf_counter(), busy_seconds(), cpu_wait_seconds()
    yield took
    took.wall = time.perf_counter() - started
    took.cpu = busy_seconds() - busy
    took.contention = (cpu_wait_seconds() - waited) / took.wall


# Ray Train's controller logs how long the phases of a worker group's start took.
PHASE = re.compile(r"\[Worker Group Initialization\] (.+?) in ([0-9.]+)s")
CONTROLLER_LOGS = Path("/tmp/ray/session_latest/logs/train")  # Ray's default temp dir
FIRST_OPTIMIZER = ("import time, torch; started = time.perf_counter(); "
                   "torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1); "
                   "print(time.perf_counter() - started)")


def last_fit_phases() -> list[tuple[str, float]]:
    """(phase, seconds) of the newest fit's worker-group start, from its controller's log."""
    newest = max(CONTROLLER_LOGS.glob("ray-train-sys-controller-*.log"),
                 key=lambda path: path.stat().st_mtime)
    messages = (json.loads(line).get("message", "") for line in newest.read_text().splitlines()
                if line.startswith("{"))
    return [(found[1], float(found[2])) for message in messages
            if (found := PHASE.search(message)) and "callbacks" not in found[1]]


def first_optimizer_seconds() -> float:
    """A fresh process's first torch optimizer: torch imports its compiler (torch._dynamo)."""
    return float(subprocess.run([sys.executable, "-c", FIRST_OPTIMIZER], check=True,
                                capture_output=True, text=True).stdout)


def empty_loop(config: dict) -> None:
    """A training loop that trains nothing: the fit's cost is Ray Train's own."""


def measure() -> list[tuple[str, SimpleNamespace, str]]:
    import ray
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    import raydp_train as rt
    from raydp_train.train.trainer import TRAIN_SETTINGS, ensure_ray

    rows = []
    with timed() as started:
        ensure_ray(None, num_cpus=4)
    rows.append(("embedded Ray start (`ray.init`, 4 logical CPUs)", started, ""))
    os.environ.update(TRAIN_SETTINGS)
    for number in range(1, FITS + 1):
        with timed() as fitted:
            TorchTrainer(empty_loop, scaling_config=ScalingConfig(num_workers=2)).fit()
        rows.append((f"Ray Train fit {number}, 2 workers, an empty loop", fitted, ""))
    phases = "; ".join(f"{name}: {seconds:.1f} s" for name, seconds in last_fit_phases())
    rows[-1] = (*rows[-1][:2], f"Ray Train's log: {phases}")
    with timed() as first:
        optimizer_s = first_optimizer_seconds()
    rows.append(("a fresh process's first `torch.optim.SGD`", first,
                 f"{optimizer_s:.2f} s of it the constructor (it imports torch._dynamo)"))
    with tempfile.TemporaryDirectory() as scratch:
        pipeline = rt.Pipeline.from_yaml(QUICKSTART, [*ONE_EPOCH, f"run.output_dir={scratch}"])
        with timed() as here:
            result = rt.run(pipeline, on_line=None, on_epoch=None, on_progress=None)
        rows.append(("quickstart, 1 epoch, `raydp_train.run` on that Ray", here,
                     f"{result.metrics[-1]['elapsed_s']:.1f} s training"))
    ray.shutdown()
    with tempfile.TemporaryDirectory() as scratch:
        settings = [word for setting in [*ONE_EPOCH, f"run.output_dir={scratch}"]
                    for word in ("--set", setting)]
        with timed() as fresh:
            subprocess.run([str(Path(sys.executable).parent / "raydp-train"), "run",
                            str(QUICKSTART), *settings], check=True, capture_output=True,
                           env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        rows.append(("quickstart, 1 epoch, `raydp-train run` in a fresh process", fresh,
                     "its own Ray start included"))
    return rows


def main() -> None:
    load = os.getloadavg()[0]
    rows = measure()
    lines = [TITLE, "", (f"{os.cpu_count()} cores, 1-minute load average {load:.1f} before "
                         "the runs; CPU s: what the whole machine spent meanwhile (Ray's "
                         "processes included); contention: the share of the wall time some "
                         "task waited for a CPU."), "",
             "| what | wall | CPU s | contention | note |", "|---|---:|---:|---:|---|"]
    for name, timed, note in rows:
        lines.append(f"| {name} | {timed.wall:.1f} s | {timed.cpu:.1f} | "
                     f"{timed.contention:.0%} | {note} |")
    write_section(RESULTS, "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
