"""`raydp-train budget status | history`: a budget's ledger as people read it (read by
budget/ledger_reading.py, without Ray)."""

from __future__ import annotations

import json
import time

HISTORY_COLUMNS = ("seq", "time", "kind", "owner", "mechanism", "sampling_rate",
                   "noise_multiplier", "steps", "releases", "running_epsilon")


def status_text(status: dict) -> str:
    lines = [
        (f"budget {status['name']}: epsilon {status['epsilon_counted']:.4f} of "
         f"{status['epsilon']:g} counted, {status['epsilon_remaining']:.4f} remaining "
         f"(delta {status['delta']:g}, {status['accountant'].upper()}), per "
         f"{status.get('unit', 'example')}"),
        f"steps spent {status['steps_spent']}, reserved (open) {status['steps_reserved']}",
    ]
    if status["resets"]:
        lines.append(_across_resets(status))
    width = max([len("owner"), *map(len, status["owners"])])
    lines.append(f"{'owner':<{width}} {'spent':>8} {'reserved':>9} {'releases':>9} {'open':>5}")
    for owner, entry in sorted(status["owners"].items()):
        lines.append(f"{owner:<{width}} {entry['steps_spent']:>8} {entry['steps_reserved']:>9} "
                     f"{entry['releases']:>9} {entry['open_reservations']:>5}")
    return "\n".join(lines)


def _across_resets(status: dict) -> str:
    """Each reset period's own epsilon and their total: what the data's users were exposed to
    since the budget opened, which no reset takes back."""
    periods = [*status["epsilon_before_resets"], status["epsilon_counted"]]
    each = ", ".join(f"{epsilon:.4f}" for epsilon in periods[:-1])
    return (f"reset {status['resets']} time(s): epsilon {each} before each reset (oldest "
            f"first) and {periods[-1]:.4f} since the last; spent across resets: epsilon "
            f"{status['epsilon_across_resets']:.4f} with delta {status['delta'] * len(periods):g}"
            f" by basic composition (the {len(periods)} periods' epsilons and deltas summed; "
            "rows: `budget history`)")


def history_text(rows: list[dict]) -> str:
    owner_width = max([len("epsilon=1e+06 delta=1e-05"), *(len(r["owner"]) for r in rows)])
    widths = (4, 19, 7, owner_width, 15, 13, 16, 6, 8, 15)
    lines = ["  ".join(f"{c:<{w}}" for c, w in zip(HISTORY_COLUMNS, widths, strict=True))]
    for row in rows:
        cells = {**row, "time": time.strftime("%Y-%m-%d %H:%M:%S",
                                               time.localtime(row["timestamp"]))}
        if row["kind"] == "open":
            cells.update(owner=f"epsilon={row['budget_epsilon']:g} delta={row['budget_delta']:g}",
                         mechanism=row["accountant"], sampling_rate="", noise_multiplier="",
                         steps="", releases="")
        elif row["kind"] == "reset":
            cells.update(mechanism="", sampling_rate="", noise_multiplier="", steps="",
                         releases="")
        lines.append("  ".join(_cell(cells[c], w) for c, w in zip(HISTORY_COLUMNS, widths,
                                                                   strict=True)))
    return "\n".join(lines)


def as_json(value) -> str:
    return json.dumps(value, indent=2, default=str)


def _cell(value, width: int) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    return f"{text:<{width}}"
