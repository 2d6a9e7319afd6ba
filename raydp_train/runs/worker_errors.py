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
from collections.abc import Iterator
from pathlib import Path

from raydp_train.errors import UserError

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


def user_error_in(error: BaseException) -> UserError | None:
    """The first UserError in the graph of `error`'s causes (a worker's, a data task's)."""
    for cause in causes(error):
        if isinstance(cause, UserError) and not _is_ray_wrapper(cause):
            return cause
    return None


def causes(error: BaseException) -> Iterator[BaseException]:
    """`error`, then what it wraps, breadth first: each worker's failure (by rank), a remote
    task's cause, a controller's failure, Python's own chaining."""
    queue, seen = [error], set()
    while queue:
        current = queue.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "worker_failures", None) or {}
        queue.extend(failures[rank] for rank in sorted(failures))
        for attribute in ("cause", "controller_failure", "__cause__", "__context__"):
            wrapped = getattr(current, attribute, None)
            if isinstance(wrapped, BaseException):
                queue.append(wrapped)


def _is_ray_wrapper(error: BaseException) -> bool:
    """A RayTaskError made to look like its cause (`as_instanceof_cause`): its text is a
    remote traceback; the cause itself comes next in `causes`."""
    from ray.exceptions import RayTaskError

    return isinstance(error, RayTaskError)
