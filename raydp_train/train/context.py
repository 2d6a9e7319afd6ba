"""Where a worker runs: alone in this process, or as one rank of a Ray Train worker group.

The training loop talks to a context for everything that depends on the world around it:
collectives, checkpoints, progress and the write-ahead privacy charges. The loop itself
stays the same for one worker or many, with Ray or without.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from raydp_train.train.charges import Charged, ChargeRefused, MemoryCharges, RunAccount
from raydp_train.train.progress_lines import append_row
from raydp_train.train.stops import StopReason


class LocalContext:
    """World size 1 in this process: no collectives, charges kept by `account` (in memory
    unless it has a record of its own; spent from the global budget when it has one). No
    checkpoints of its own: a sweep's trial starts from `restored` and hands each epoch's
    state to `on_checkpoint` (its run folder, and Tune under PBT). `shards`: the Ray Data
    iterators of a sweep's Ray Datasets (data/shards.py one_worker_shards), or None."""

    rank, world_size = 0, 1
    node = "this process"

    def __init__(self, on_epoch=print, account: RunAccount | None = None, sharing: int = 1,
                 restored: dict | None = None, on_checkpoint=None, shards: dict | None = None):
        self.on_epoch, self.on_checkpoint, self.restored = on_epoch, on_checkpoint, restored
        self.shards = shards
        self.account = account or RunAccount(MemoryCharges())
        self.device = torch.device("cpu")
        self.sharing = sharing  # training processes on this machine (a sweep's trials)

    def dataset_shards(self) -> dict | None:
        """The Ray Data iterators it was given, else None: the loop reads its data itself."""
        return self.shards

    def show_progress(self, row: dict) -> None:
        """In this process (a sweep's one-worker trial): its epochs are what Tune shows."""

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        pass

    def broadcast_parameters(self, model: nn.Module) -> None:
        pass

    def gather(self, value) -> list:
        return [value]

    def charge(self, charge: Charged, epoch: int = 0, first_step: int = 0) -> Charged:
        """Record `charge` as spent BEFORE running it; the total so far, or ChargeRefused."""
        return self.account.charge(charge, epoch, first_step)

    def releasing_step(self, step: int) -> None:
        self.account.releasing_step(step)

    def releasing_metric(self, epoch: int) -> None:
        self.account.releasing_metric(epoch)

    def settle(self, used: Charged) -> None:
        self.account.settle(used)

    def charged(self) -> Charged:
        return self.account.total()

    def restore(self) -> dict | None:
        return self.restored

    def report(self, row: dict, state: dict) -> None:
        if self.on_checkpoint is not None:
            self.on_checkpoint(row, state)
        else:
            self.on_epoch(row)


class RayTrainContext:
    """One rank of a Ray Train worker group (torch.distributed is set up by TorchTrainer)."""

    def __init__(self, account: RunAccount, run_dir: str, splits: tuple[str, ...] = (),
                 concurrent_runs: int = 1):
        import ray.train
        import ray.train.torch

        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        # The training processes on this machine: this run's workers here, times the runs
        # (a sweep's trials) that may run beside it.
        self.sharing = context.get_local_world_size() * concurrent_runs
        self.node = ray.util.get_node_ip_address()  # the address of this worker's node
        self.device = ray.train.torch.get_device()
        self.account, self.run_dir = account, run_dir
        self.splits = splits

    def dataset_shards(self) -> dict | None:
        """This rank's Ray Data iterator of each split the trainer was given (data/shards.py),
        or None when it was given none."""
        import ray.train

        if not self.splits:
            return None
        return {name: ray.train.get_dataset_shard(name) for name in self.splits}

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        # One collective per logical step, issued by every rank even on an empty sample.
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Start every rank from rank 0's initialization (unseeded runs initialize each rank differently)."""
        for tensor in [*model.parameters(), *model.buffers()]:
            torch.distributed.broadcast(tensor.data, src=0)

    def gather(self, value) -> list:
        values = [None] * self.world_size
        torch.distributed.all_gather_object(values, value)
        return values

    def charge(self, charge: Charged, epoch: int = 0, first_step: int = 0) -> Charged:
        """Rank 0 records and reserves; every rank waits for its answer and obeys it.
        A stop asked for on the driver (Ctrl-C) is obeyed here, before the epoch is charged."""
        answer = None
        if self.rank == 0:
            try:
                if stop_requested(self.run_dir):
                    raise ChargeRefused(StopReason.INTERRUPTED,
                                        "stopped before the next epoch was charged")
                answer = self.account.charge(charge, epoch, first_step)
            except ChargeRefused as refusal:
                answer = refusal
        answer = self.gather(answer)[0]
        if isinstance(answer, ChargeRefused):
            raise answer
        return Charged(*answer)

    def releasing_step(self, step: int) -> None:
        """Rank 0 draws the noise: it marks the step before the all-reduce releases it."""
        if self.rank == 0:
            self.account.releasing_step(step)

    def releasing_metric(self, epoch: int) -> None:
        if self.rank == 0:
            self.account.releasing_metric(epoch)

    def settle(self, used: Charged) -> None:
        if self.rank == 0:
            self.account.settle(used)

    def charged(self) -> Charged:
        return Charged(*self.gather(self.account.total() if self.rank == 0 else None)[0])

    def restore(self) -> dict | None:
        """The newest complete checkpoint: the newest on disk in the run directory (Ray's own
        record of its checkpoints can lag behind an interrupted run by epochs; resuming from
        it would re-run, and charge again, epochs that were saved), else Ray's."""
        import ray.train

        newest = newest_checkpoint(self.run_dir) if self.rank == 0 else None
        newest = self.gather(None if newest is None else str(newest))[0]
        if newest is not None:
            return torch.load(Path(newest) / STATE_FILE, map_location=self.device)
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as directory:
            return torch.load(Path(directory) / STATE_FILE, map_location=self.device)

    def show_progress(self, row: dict) -> None:
        """Rank 0's place within a long epoch, for the driver's console."""
        if self.rank == 0:
            append_row(self.run_dir, {**row, "within_epoch": True})

    def report(self, row: dict, state: dict) -> None:
        import ray.train

        if self.rank != 0:
            ray.train.report(row)
            return
        append_row(self.run_dir, row)
        with tempfile.TemporaryDirectory() as directory:
            write_checkpoint(Path(directory), state)
            ray.train.report(row, checkpoint=ray.train.Checkpoint.from_directory(directory))


STATE_FILE, PROGRESS_FILE, STOP_FILE = "state.pt", "progress.json", ".stop_requested"


def write_checkpoint(folder: Path, state: dict) -> None:
    """A checkpoint's files: the state, and what `newest_checkpoint` needs to tell a whole
    copy of the folder from a cut one."""
    state_file = folder / STATE_FILE
    torch.save(state, state_file)
    progress = {"epoch": state["epoch"], "step": state["step"],
                "state_bytes": state_file.stat().st_size}
    (folder / PROGRESS_FILE).write_text(json.dumps(progress))


def newest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint folder of the latest epoch whose state was copied whole, or None."""
    complete = []
    for folder in Path(run_dir).glob("checkpoint_*"):
        try:
            progress = json.loads((folder / PROGRESS_FILE).read_text())
            if (folder / STATE_FILE).stat().st_size == progress["state_bytes"]:
                complete.append((progress["epoch"], folder))
        except (OSError, ValueError, KeyError):
            continue  # cut off while it was written, or from before progress files
    return max(complete)[1] if complete else None


def request_stop(run_dir: str | Path) -> None:
    """Ask the run's workers to stop before they charge their next epoch."""
    (Path(run_dir) / STOP_FILE).touch()


def clear_stop(run_dir: str | Path) -> None:
    (Path(run_dir) / STOP_FILE).unlink(missing_ok=True)


def stop_requested(run_dir: str | Path) -> bool:
    return (Path(run_dir) / STOP_FILE).exists()


def resident_mb() -> float:
    """This process's resident memory now, in MB (Linux's /proc; elsewhere its peak so far)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return peak_rss_mb()
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (Linux reports KB; macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def parameter_checksum(model: nn.Module) -> str:
    """sha256 over every parameter's and buffer's bytes: equal across ranks iff bit-identical."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        digest.update(raw.numpy().tobytes())
    return digest.hexdigest()
