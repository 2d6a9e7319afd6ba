"""The largest Llama config each configuration trains under one per-worker memory limit, by
bisection over a ladder of sizes (benchmarks/sharded_memory.py's ranks, each with its data
segment limited to `--limit-mb` above what its imports hold: RLIMIT_DATA refuses an
allocation past it, and a run fits when every rank finished its steps).

    python benchmarks/largest_model.py --limit-mb 1200 --hidden 384 512 640 768 896
"""

from __future__ import annotations

import argparse
import json

from sharded_memory import MODES, OPACUS_MODES, measure, run_arguments, start


def largest(args, mode: str) -> dict:
    """The largest rung of `args.hidden` (all layers `args.layers`) that fits, by bisection
    (a rung that fits: every smaller one is taken to fit)."""
    lo, hi, tried = -1, len(args.hidden), []
    while hi - lo > 1:
        mid = (lo + hi) // 2
        args.hidden_size = args.hidden[mid]
        run = measure(_rung(args), mode)
        tried.append({"hidden": args.hidden[mid], **run})
        print(json.dumps(tried[-1]), flush=True)
        lo, hi = (mid, hi) if run["fits"] else (lo, mid)
    best = tried and max((t for t in tried if t["fits"]), key=lambda t: t["hidden"], default=None)
    return {"mode": mode, "limit_mb": args.limit_mb, "largest": best, "tried": tried}


def _rung(args) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), "hidden": args.hidden_size})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-mb", type=int, required=True)
    parser.add_argument("--hidden", type=int, nargs="+", default=[384, 512, 640, 768, 896])
    run_arguments(parser, layers=12, vocab=16000)
    parser.add_argument("--modes", nargs="*", default=["whole-private", "sharded-private",
                                                       "sharded-nonprivate", "opacus-sharded"],
                        choices=[*MODES, *OPACUS_MODES])
    args = parser.parse_args()
    start(args)
    for mode in args.modes:
        print(json.dumps(largest(args, mode)), flush=True)


if __name__ == "__main__":
    main()
