"""Empirical privacy audit: the epsilon that canary runs prove, next to the accountant's claim.

    .venv/bin/python benchmarks/privacy_audit.py          # full run, about 2 minutes on 2 cores
    .venv/bin/python benchmarks/privacy_audit.py --quick  # smoke run, 8 runs a side; writes nothing

Each row is one `audit_pipeline` (raydp_train/commands/audit.py): N training runs of the real DP-SGD engine
with a Dirac canary and N without, a likelihood-ratio membership test whose threshold is chosen
on half of the runs, and a Clopper-Pearson lower bound on epsilon from its counts on the other
half. An honest engine must stay at or below its claim. The last row disables the noise on
purpose (a deliberately broken engine, as in tests/test_audit.py): its bound must land far above
the claim, or the audit could not see a leak. No bound can exceed a ceiling set by N alone:
perfect counts on the held-out N/2 a side give about log(N/2 / ln(1/alpha')), alpha' = 0.025.
Every audit is seeded (SEED), so the table repeats exactly. The full run rewrites its own
section of benchmarks/RESULTS.md and keeps every other section.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from pathlib import Path
from unittest import mock

from raydp_train.accounting.audit_bounds import epsilon_lower_bound
from raydp_train.checks.preflight import check_pipeline
from raydp_train.commands.audit import AuditResult, audit_pipeline
from raydp_train.config.pipeline import load_pipeline, pipeline_from_dict

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import write_section

SEED = 0
CONFIDENCE = 0.95
QUICKSTART = Path(__file__).parents[1] / "pipelines" / "quickstart.yaml"
# The small configuration of tests/test_audit.py: 200 training rows, q = 0.2, 20 steps.
SMALL = {
    "name": "audit-small",
    "data": {"source": "synthetic", "n_samples": 250, "random_state": 0},
    "model": {"kind": "logistic"},
    "privacy": {"clip_norm": 1.0, "noise_multiplier": 4.0, "delta": 1e-5},
    "training": {"epochs": 4, "batch_size": 40, "lr": 0.1, "workers": 1},
}


def noise_disabled() -> contextlib.AbstractContextManager:
    """A deliberately broken engine: every Gaussian noise draw writes zeros instead."""
    return mock.patch("raydp_train.train.step.fill_gaussian_noise_",
                      lambda tensor, std, generator: tensor.zero_())


def audits(runs: int) -> list[tuple[str, object, int, contextlib.AbstractContextManager]]:
    """(configuration, pipeline, runs a side, engine) for every row of the table."""
    small = "synthetic 200 rows, logistic, q=0.2, 20 steps, C=1"
    return [
        ("pipelines/quickstart.yaml as shipped (q=0.08, 375 steps, sigma=2, C=1)",
         load_pipeline(QUICKSTART), runs, contextlib.nullcontext()),
        (f"{small}, sigma=4", pipeline_from_dict(SMALL), runs, contextlib.nullcontext()),
        (f"{small}, sigma=1", pipeline_from_dict(SMALL, ["privacy.noise_multiplier=1.0"]), runs,
         contextlib.nullcontext()),
        (f"{small}, sigma=4, **noise disabled (deliberately broken engine)**",
         pipeline_from_dict(SMALL), runs, noise_disabled()),
    ]


def run_audit(label: str, pipeline, runs: int, engine) -> AuditResult:
    dataset, plan = check_pipeline(pipeline)

    def progress(pairs: int, elapsed_s: float) -> None:
        print(f"  {pairs}/{runs} pairs of runs ({elapsed_s:.1f}s)", flush=True)

    print(f"{label}: {runs} runs with and {runs} without the canary", flush=True)
    with engine:
        result = audit_pipeline(pipeline, dataset, plan, runs, CONFIDENCE, SEED, progress)
    print(f"  claimed {result.claimed_epsilon:.3f}, lower bound {result.epsilon_lower_bound:.3f}, "
          f"consistent: {result.consistent}", flush=True)
    return result


def ceiling(result: AuditResult) -> float:
    """The largest bound these runs could show: every held-out run classified right."""
    test = result.test
    return epsilon_lower_bound(test.positives, 0, test.positives, test.negatives, result.delta,
                               CONFIDENCE)


def table(rows: list[tuple[str, AuditResult]], total_s: float) -> list[str]:
    lines = [
        "## Empirical privacy audit (benchmarks/privacy_audit.py)",
        "",
        "Command: `.venv/bin/python benchmarks/privacy_audit.py` (from the repository root)",
        "",
        (f"`raydp_train.commands.audit.audit_pipeline`, seed {SEED} for every row: N runs of the real DP-SGD "
         "engine (in one process, 1 thread) with a Dirac canary and N without; the membership "
         "threshold is chosen on the first half of the runs, TPR/FPR are counted on the held-out "
         f"half, and the lower bound holds at {CONFIDENCE:.0%} confidence (Clopper-Pearson). "
         "Claims are the pipeline's accountant (RDP) for exactly the audited steps, delta 1e-5. "
         f"Total wall time {total_s:.0f} s on 2 vCPUs."),
        "",
        ("| configuration | claimed epsilon | empirical lower bound | TPR (held out) | "
         "FPR (held out) | runs per side | wall time | consistent |"),
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, r in rows:
        t = r.test
        lines.append(f"| {label} | {r.claimed_epsilon:.2f} | {r.epsilon_lower_bound:.2f} | "
                     f"{t.true_positives}/{t.positives} | {t.false_positives}/{t.negatives} | "
                     f"{r.trials} | {r.elapsed_s:.1f} s | {'yes' if r.consistent else 'NO'} |")
    first = rows[0][1]  # every row: the same N and delta, so the same ceiling
    half, cap = first.test.positives, ceiling(first)
    approx = math.log(half / math.log(1 / ((1 - CONFIDENCE) / 2)))
    above = ", ".join(f"{r.claimed_epsilon:.2f}" for _, r in rows if r.claimed_epsilon > cap)
    lines += ["", (
        f"Ceiling: with {first.trials} runs per side ({half} held out a side), even a perfect "
        f"attack ({half}/{half} true, 0/{half} false positives) proves at most epsilon {cap:.2f} "
        f"(`epsilon_lower_bound` on those counts; log(N/2 / ln(1/0.025)) = {approx:.2f}). "
        f"Claims above it ({above or 'none'}) cannot be refuted at this N: those rows check "
        "only that nothing leaks beyond what N can show. The broken engine "
        "must reach (about) the ceiling, far above its claim of ~1.0: that NO is the audit "
        "working; a NO on any other row would be a bug in clipping, noise, sampling or "
        "accounting. A lower bound, not a guarantee: below the claim it proves nothing.")]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 8 runs a side; prints, RESULTS.md is not written")
    args = parser.parse_args()
    started = time.monotonic()
    rows = [(label, run_audit(label, *audit)) for label, *audit in audits(8 if args.quick else 200)]
    lines = table(rows, time.monotonic() - started)
    print("\n".join(lines), flush=True)
    if args.quick:  # 4 held-out runs a side cannot show even the broken engine's leak
        return
    broken, honest = rows[-1][1], [r for _, r in rows[:-1]]
    if broken.consistent or not all(r.consistent for r in honest):
        print("WARNING: the audit did not separate the honest engine from the broken one",
              flush=True)
    write_section(Path(__file__).with_name("RESULTS.md"), "\n".join(lines))


if __name__ == "__main__":
    main()
