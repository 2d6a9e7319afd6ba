"""A failure on the training workers, told to the user in one line.

Ray wraps an exception raised on a worker in its own: a `WorkerGroupError` holding each
rank's failure, a `RayTaskError` around a remote task's exception (whose `cause` is the
original), a Ray Data `UserCodeException` around a data task's. What the user can act on (a
`UserError`: which file, which column, what to change) lies at the bottom of that graph and was
cut off the terminal. `explain` finds it; anything else is a bug, reported in one line with
the full trace written to the run directory.
"""

from __future__ import annotations

import traceback
from pathlib import Path

from raydp_train.errors import causes, user_error_in

ERROR_LOG = "error.log"


class WorkerBug(RuntimeError):
    """The workers failed for a reason that is not the user's input: the CLI prints this one
    line and exits 1; the trace is in the run directory's `error.log`."""


def explain(error: BaseException, run_dir: Path) -> Exception:
    """The error to raise for `error` from fit(): the user's own error found under Ray's
    wrappers (exit 2), or a WorkerBug naming the trace file (exit 1). The full trace is
    written to `run_dir/error.log` either way."""
    # Each wrapped failure with its own trace: Ray's (a worker's, a remote task's) included.
    trace = "\n".join("".join(traceback.format_exception(cause, chain=False))
                      for cause in causes(error))
    log = run_dir / ERROR_LOG
    try:
        log.write_text(trace)
        where = f"the full trace: {log}"
    except OSError:
        where = "rerun with --verbose for the trace"
    found = user_error_in(error)
    if found is not None:
        return found
    innermost = list(causes(error))[-1]
    summary = (str(innermost).strip().splitlines() or [""])[-1][:300]
    return WorkerBug(f"the run failed: {type(innermost).__name__}: {summary} ({where})")
