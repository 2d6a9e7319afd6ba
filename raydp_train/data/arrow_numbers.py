"""An Arrow column of numbers as a numpy array, read from its data buffers: pyarrow's own
to_numpy imports pandas, half a second of validate's time (tests/test_validate.py keeps
validate free of it)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

# Arrow's floating types by name; its integer types are named as numpy's.
_ARROW_FLOATS = {"halffloat": np.float16, "float": np.float32, "double": np.float64}


def numbers_as_numpy(column: pa.ChunkedArray) -> np.ndarray:
    """A column of numbers without nulls, read from its data buffers: pyarrow's own to_numpy
    imports pandas, half a second of validate's time."""
    dtype = np.dtype(_ARROW_FLOATS.get(str(column.type), str(column.type)))
    parts = [np.frombuffer(chunk.buffers()[1], dtype, len(chunk), chunk.offset * dtype.itemsize)
             for chunk in column.chunks]
    return np.concatenate(parts) if parts else np.empty(0, dtype)
