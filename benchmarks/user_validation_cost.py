"""What releasing a private validation split per user costs against scoring it per row: the
held-out scores of an MLP head over MiniLM-sized features (384 -> 256 -> 2), float32.

    .venv/bin/python benchmarks/user_validation_cost.py [--reps 5]

Per user (privacy.unit user, ARCHITECTURE.md §2.14) the rows still run through the model in
batches of 1024; each user's share of rows right is then scored from the outputs. Timed
alternately, one thread, median of `reps`; RESULTS.md's section is rewritten.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from step_overhead import write_section

from raydp_train.data.targets import LABEL_KINDS
from raydp_train.train.evaluation import held_out_scores

TITLE = "## Private validation per user: its cost (benchmarks/user_validation_cost.py)"
ROWS = 10_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    kind = LABEL_KINDS["class"]
    model = torch.nn.Sequential(torch.nn.Linear(384, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 2))
    load = os.getloadavg()[0]
    lines = []
    for users in (200, 1_000, 5_000):
        x, y = torch.randn(ROWS, 384), torch.randint(0, 2, (ROWS,))
        ids = torch.randint(0, users, (ROWS,))
        times = {"per row": [], "per user": []}
        for _ in range(args.reps):
            for name, given in (("per row", None), ("per user", ids)):
                start = time.perf_counter()
                held_out_scores(model, x, y, kind, given)
                times[name].append(time.perf_counter() - start)
        row, user = (statistics.median(times[name]) * 1000 for name in times)
        lines.append(f"| {users} | {row:.1f} ms | {user:.1f} ms | {user / row:.2f} |")
    setup = (f"{ROWS} validation rows, one thread, median of {args.reps}; 1-minute load "
             f"{load:.1f} before it (other processes shared the cores: compare the columns, "
             "not the seconds).")
    note = ("One forward pass over the rows either way; per user adds a loop over the users "
            "that scores each one's rows from the outputs (about 15-20 us a user here).")
    text = "\n".join([TITLE, "", setup, "", "| users | per row | per user | ratio |",
                      "|---|---|---|---|", *lines, "", note])
    print(text)
    write_section(Path(__file__).parent / "RESULTS.md", text)


if __name__ == "__main__":
    main()
