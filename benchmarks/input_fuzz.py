"""The input fuzz's long mode (issue 32): 3,000 mutated pipelines and data files (the cases of
tests/fuzz_cases.py, seed 1) through `raydp-train validate`, and a table in RESULTS.md.

    .venv/bin/python benchmarks/input_fuzz.py [--cases 3000] [--seed 1]   (about 5 minutes)
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).parent))
from fuzz_cases import _run_cli, as_json, make_case, run_validate, summary
from step_overhead import cpu_wait_seconds, write_section

# A case stopped at the 10 s guard runs once more with this long: one that then ends cleanly
# was slow on a loaded machine, not hung.
RECHECK_SECONDS = 120


def recheck_stopped(results: list) -> tuple[list, list]:
    """(seconds each stopped case took when run again, the cases still broken then)."""
    slow, still = [], []
    for case, outcome in results:
        if outcome.problem and "<stopped after" in outcome.output:
            again = _run_cli(["validate", str(case.pipeline)], RECHECK_SECONDS)
            (still if again.problem else slow).append(
                (case, again) if again.problem else round(again.seconds, 1))
    return slow, still


def _span(seconds: list[float]) -> str:
    return f"{min(seconds)}" if min(seconds) == max(seconds) else f"{min(seconds)}-{max(seconds)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    waited, started = cpu_wait_seconds(), time.monotonic()
    load = Path("/proc/loadavg").read_text().split()[:3]
    results, kinds = [], collections.Counter()
    with tempfile.TemporaryDirectory() as root:
        for number in range(args.cases):
            case = make_case(number, args.seed, Path(root) / f"case{number}")
            results.append((case, run_validate(case)))
            kinds[case.kind] += 1
            if (number + 1) % 500 == 0:
                print(f"{number + 1} cases, {len(summary(results)['broken'])} broken", flush=True)
        wall = time.monotonic() - started
        slow, still = recheck_stopped(results)
    report = summary(results)
    print(as_json(report["broken"][:10]))
    # Broken other than by the 10 s guard: a traceback, a wrong exit code or error lines.
    failed = sum(1 for _, o in results if o.problem and "<stopped after" not in o.output)
    codes = report["exit_codes"]
    lines = [
        "## Input fuzz, long mode",
        "",
        (f"`benchmarks/input_fuzz.py --cases {args.cases} --seed {args.seed}` "
         f"({time.strftime('%Y-%m-%d')}): mutated pipelines (a value replaced by one of "
         "{wrong types, edges, 2^70, 1e308, 1e-300, NaN, inf, unicode, deep lists, paths}, a key "
         "deleted or unknown, the text truncated or salted, nested thousands deep, an alias "
         "bomb, a key twice, empty) and data files (NaN, inf, 1e308, one class, negative, 2^62 "
         "and string labels, missing columns, empty, not Parquet, nulls, ragged and unicode "
         "columns), and names and paths over a file system's limits (pipeline, budget, data, "
         "output and ledger names of 201-300 bytes) or data paths that are a FIFO, a directory "
         "or /dev/zero, through `raydp-train validate`, each stopped after 10 s."),
        "",
        ("| cases | by kind | exit 0 | exit 2 | exit 3 | tracebacks or wrong output | hangs | "
         "over 10 s, then done |"),
        "|---:|---|---:|---:|---:|---:|---:|---:|",
        (f"| {report['cases']:,} | {', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))} | "
         f"{codes.get('0', 0):,} | {codes.get('2', 0):,} | {codes.get('3', 0):,} | "
         f"{failed} | {len(still)} | {len(slow)}"
         f"{f' (run again: {_span(slow)} s)' if slow else ''} |"),
        "",
        (f"{wall / 60:.1f} min; load average (`uptime`) at the start {' '.join(load)}; CPU "
         f"contention {(cpu_wait_seconds() - waited) / wall:.0%} (share of wall time some task "
         f"waited for a CPU). Slowest case {report['slowest_s']} s. A case stopped by the 10 s "
         f"guard runs once more with {RECHECK_SECONDS} s: a hang is one that does not end "
         "cleanly then. No case reserves anything: `validate` reads a budget's ledger, never "
         "writes it. The 300 cases of seed 0 run in `make test` (tests/test_input_fuzz.py)."),
    ]
    write_section(Path(__file__).with_name("RESULTS.md"), "\n".join(lines))
    sys.exit(1 if failed or still else 0)


if __name__ == "__main__":
    main()
