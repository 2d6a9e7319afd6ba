"""No silent wait: while Ray Train waits for the resources of a run's workers (a placement
group that cannot be placed yet), the driver says so every WAIT_SHOWN_EVERY_S seconds: what
is asked for, what the cluster has free, and how to stop."""

from __future__ import annotations

import threading
from collections.abc import Callable

WAIT_SHOWN_EVERY_S = 30.0


def watch_waits(stop: threading.Event, say: Callable[[str], None],
                every: float = WAIT_SHOWN_EVERY_S) -> threading.Thread:
    """A daemon thread that says what is waited for, until `stop` is set."""
    thread = threading.Thread(target=_watch, args=(stop, say, every), daemon=True)
    thread.start()
    return thread


def _watch(stop: threading.Event, say: Callable[[str], None], every: float) -> None:
    waited = 0.0
    while not stop.wait(every):
        waited += every
        try:
            pending, free = pending_groups(), _free()
        except Exception:  # noqa: BLE001 - Ray going away as the run ends: nothing to say
            return
        if pending:
            say(f"waiting {waited:.0f} s for resources: {pending}; free now: {free}. It waits "
                "until they come: add nodes, or Ctrl-C (twice) to stop")


def pending_groups() -> str:
    """The placement groups Ray cannot place yet, as "2 x {CPU: 1} (STRICT_SPREAD)"."""
    import ray

    shown = []
    for group in ray.util.placement_group_table().values():
        if group.get("state") != "PENDING":
            continue
        bundles = list(group.get("bundles", {}).values())
        first = ", ".join(f"{name}: {amount:g}" for name, amount in sorted(bundles[0].items())
                          if not name.startswith("node:")) if bundles else ""
        shown.append(f"{len(bundles)} x {{{first}}} ({group.get('strategy', '?')})")
    return "; ".join(shown)


def _free() -> str:
    import ray

    free = ray.available_resources()
    return ", ".join(f"{name} {free.get(name, 0):g}" for name in ("CPU", "GPU")) + (
        f", {sum(1 for node in ray.nodes() if node.get('Alive'))} live node(s)")
