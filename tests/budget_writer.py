"""One writer of a shared budget, in its own process with its own embedded Ray (for tests).

    python tests/budget_writer.py LEDGER EPSILON REQUESTS SYNC_DIR [--kill]

Opens budget "shared" through its own accountant actor, creates SYNC_DIR/ready-<pid>, waits
until SYNC_DIR/start exists, then sends REQUESTS reservations at once. With --kill, SIGKILLs the
actor's process as soon as the first answer is back, while the others are in flight (Ray
restarts it from the ledger and re-sends them). Prints one JSON line: the granted
reservation ids.
"""

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import ray

from raydp_train.budget.accountant import BudgetAccountant
from raydp_train.budget.actor import actor_name, open_budget
from raydp_train.budget.book import NAMESPACE
from raydp_train.budget.terms import BudgetTerms, Spend
from raydp_train.config.budget import BudgetConfig
from raydp_train.runs.resources import RETRY_START_WAIT_S
from raydp_train.train.trainer import ensure_ray

SPEND = Spend(0.02, 1.0, 200)


def fits_alone(epsilon: float, directory: str, spend: Spend = SPEND) -> int:
    """How many `spend`s one accountant alone grants within `epsilon` (the tests' oracle)."""
    alone = BudgetAccountant(directory, BudgetTerms("alone", epsilon, 1e-5))
    granted = 0
    while alone.reserve(f"r{granted}", "alone", spend).granted:
        granted += 1
    return granted


def main(ledger: str, epsilon: float, requests: int, sync_dir: str, kill: bool) -> None:
    # Two clusters start at once beside the rest of the suite: give each GCS the wait that
    # `raydp-train`'s second try gives (runs/resources.py), not Ray's 30 s.
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", str(RETRY_START_WAIT_S))
    ensure_ray(None, num_cpus=1)
    open_budget(BudgetConfig(name="shared", epsilon=epsilon, delta=1e-5, ledger=ledger))
    actor = ray.get_actor(actor_name("shared"), namespace=NAMESPACE)
    actor_pid = ray.get(actor.__ray_call__.remote(lambda accountant: os.getpid()))
    Path(sync_dir, f"ready-{os.getpid()}").touch()
    while not Path(sync_dir, "start").exists():
        time.sleep(0.01)
    owner = f"writer-{os.getpid()}"
    pending = [actor.reserve.remote(uuid.uuid4().hex, owner, SPEND) for _ in range(requests)]
    if kill:
        ray.wait(pending, num_returns=1)
        os.kill(actor_pid, signal.SIGKILL)
    granted = [d.reservation for d in ray.get(pending) if d.granted]
    print(json.dumps({"granted": granted, "killed_pid": actor_pid if kill else None}),
          flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4], "--kill" in sys.argv)
