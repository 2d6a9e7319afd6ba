"""The base of every error in the user's input.

A `UserError` is bad input from the user (a pipeline field, a data file, a model that does not
fit, a cluster short of resources, a budget that refuses): the CLI prints its message on one
line and exits 2, never a traceback. Each subclass keeps its builtin base too
(`class DataError(UserError, ValueError)`), so code that catches ValueError still catches it.
They cross Ray process boundaries, so they must pickle: a subclass whose `__init__` takes more
than a message rebuilds itself in `__reduce__` (as `PipelineError` does).

A leaf module: it imports nothing, so every layer may import it (`privacy/` included).
"""

from __future__ import annotations

from collections.abc import Iterator


class UserError(Exception):
    """Bad input from the user: the CLI prints its message on one line and exits 2."""


class DataError(UserError, ValueError):
    """The data named by a pipeline cannot be used; the message names the field and file."""


def user_error_in(error: BaseException) -> UserError | None:
    """The first UserError in the graph of `error`'s causes (a worker's, a data task's): what
    the user can act on, found under Ray's wrappers."""
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
    """A RayTaskError made to look like its cause (`as_instanceof_cause`, a subclass of both):
    its text is a remote traceback; the cause itself comes next in `causes`. Told by its
    class, so that this module imports nothing (not even Ray)."""
    return any(cls.__name__ == "RayTaskError" and cls.__module__ == "ray.exceptions"
               for cls in type(error).__mro__)
