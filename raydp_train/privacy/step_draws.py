"""Poisson sampling drawn row by row, for data that no worker holds whole (ARCHITECTURE.md
§2.13).

For an epoch of ``steps`` steps, each row joins each step independently with probability q.
Drawn per row instead of per step: the number of steps a row joins is Binomial(steps, q),
and given that count k its steps are k distinct step ids, uniformly at random. This is the
same joint law as ``steps`` independent Bernoulli(q) draws per row (the count of a row's
Bernoulli successes is Binomial(steps, q), and given the count every set of that size is
equally likely), so each step's batch is a Poisson sample of rate q, independent of every
other step's: the accounting of §2.5 is unchanged.

The draws are a function of (seed, epoch, row index) alone: rows are drawn in fixed chunks of
``CHUNK_ROWS``, each chunk from its own generator keyed by (seed, epoch, chunk). Any part of
the rows, read in any order or cut into any blocks, gets the same steps, and a resumed run
draws the same steps again for the same seed. numpy only: no torch, no Ray.
"""

from __future__ import annotations

import numpy as np

# Rows per generator: a range of rows costs at most two chunks more than it holds.
CHUNK_ROWS = 1024


def row_steps(seed: int, epoch: int, first_row: int, num_rows: int, steps: int,
              sampling_rate: float) -> tuple[np.ndarray, np.ndarray]:
    """(rows, step ids) of the rows ``first_row .. first_row + num_rows - 1`` in ``epoch``:
    row offset ``rows[j]`` (0-based, from ``first_row``) joins step ``step_ids[j]`` (in
    ``[0, steps)``). A row appears once per step it joins, its steps distinct; sorted by
    (row, step). int64 both."""
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"the sampling rate q must be in (0, 1], got {sampling_rate}")
    if min(seed, epoch, first_row, num_rows, steps) < 0:
        raise ValueError("seed, epoch, first_row, num_rows and steps must be >= 0, got "
                         f"{seed}, {epoch}, {first_row}, {num_rows}, {steps}")
    last_row = first_row + num_rows
    rows, step_ids = [], []
    for chunk in range(first_row // CHUNK_ROWS, -(-last_row // CHUNK_ROWS)):
        chunk_rows, chunk_steps = _chunk_draws(seed, epoch, chunk, steps, sampling_rate)
        chunk_rows = chunk_rows + (chunk * CHUNK_ROWS - first_row)
        kept = (chunk_rows >= 0) & (chunk_rows < num_rows)
        rows.append(chunk_rows[kept])
        step_ids.append(chunk_steps[kept])
    if not rows:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    return np.concatenate(rows), np.concatenate(step_ids)


def _chunk_draws(seed: int, epoch: int, chunk: int, steps: int,
                 sampling_rate: float) -> tuple[np.ndarray, np.ndarray]:
    """Every row of one chunk: a count k ~ Binomial(steps, q), then k distinct steps by
    Floyd's algorithm (exact: every k-set of the steps equally likely, no rejection), all rows
    at once, one position of the k at a time:

        for i = 0 .. k-1:   j = steps - k + i;   t ~ Uniform{0..j};   add (t if t is new else j)

    An epoch has q * steps <= 1 steps per row on average, so k is small."""
    generator = np.random.default_rng([seed, epoch, chunk])
    counts = generator.binomial(steps, sampling_rate, size=CHUNK_ROWS)
    most = int(counts.max()) if steps else 0
    chosen = np.full((CHUNK_ROWS, most), steps, dtype=np.int64)  # steps: no step (sorts last)
    for i in range(most):
        active = np.nonzero(counts > i)[0]
        last = steps - counts[active] + i
        drawn = generator.integers(0, last + 1)
        taken = (chosen[active, :i] == drawn[:, None]).any(axis=1)
        chosen[active, i] = np.where(taken, last, drawn)
    chosen.sort(axis=1)
    joined = np.arange(most) < counts[:, None]
    rows = np.repeat(np.arange(CHUNK_ROWS, dtype=np.int64), counts)
    return rows, chosen[joined]
