"""How many threads torch computes with in a training process. Ray sets a worker's
OMP_NUM_THREADS to the CPUs it reserved (1 by default), so one worker on a 2-core machine used
half of it; `training.threads_per_worker: auto` shares the machine's cores among the training
processes on it instead."""

from __future__ import annotations

import os

import torch


def use_threads(setting: int | str, sharing: int) -> int:
    """Set torch's intra-op threads to `setting`, or ("auto") to this machine's cores divided
    among the `sharing` training processes on it (at least 1); the number set."""
    threads = setting if isinstance(setting, int) else max(1, available_cores() // sharing)
    torch.set_num_threads(threads)
    return threads


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
