"""The base of every error in the user's input.

A `UserError` is bad input from the user (a pipeline field, a data file, a model that does not
fit, a cluster short of resources, a budget that refuses): the CLI prints its message on one
line and exits 2, never a traceback. Each subclass keeps its builtin base too
(`class DataError(UserError, ValueError)`), so code that catches ValueError still catches it.
They cross Ray process boundaries, so they must pickle: a subclass whose `__init__` takes more
than a message rebuilds itself in `__reduce__` (as `PipelineError` does).

A leaf module: it imports nothing, so every layer may import it (`privacy/` included).
"""


class UserError(Exception):
    """Bad input from the user: the CLI prints its message on one line and exits 2."""


class DataError(UserError, ValueError):
    """The data named by a pipeline cannot be used; the message names the field and file."""
