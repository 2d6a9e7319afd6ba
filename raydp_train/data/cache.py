"""Where raydp_train keeps what it can always make again: `$RAYDP_TRAIN_CACHE`, default
`$XDG_CACHE_HOME/raydp_train`, else ~/.cache/raydp_train."""

from __future__ import annotations

import os
from pathlib import Path


def cache_folder(name: str) -> Path:
    root = os.environ.get("RAYDP_TRAIN_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raydp_train"
    return Path(root) / name
