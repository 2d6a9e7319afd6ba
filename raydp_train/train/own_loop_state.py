"""What a `PrivateStep` keeps across a restart of the user's Ray Train loop (ARCHITECTURE.md
§2.11): where rank 0 marks each release before it happens (the pipeline's charges and release
log, train/charges.py), a saved state checked against the loop that loads it, and the
optimizer's new parameters (DP-LoRA's adapters)."""

from __future__ import annotations

from pyarrow import fs
from torch import nn

from raydp_train.train.charges import Charged, MemoryCharges, RunAccount, RunCharges
from raydp_train.train.own_loop_arguments import PrivateStepError

RECORD_FOLDER = "private-step"  # under the Ray Train run's storage


def release_record(rank: int, record_dir: str | None) -> RunCharges | MemoryCharges:
    """Rank 0's record of charges and releases: under `record_dir`, else under the Ray Train
    run's storage when it is a local file system (a restarted worker group reads its dead
    attempts' release logs there), else in memory (a process of its own has no restart)."""
    if rank != 0:
        return MemoryCharges()
    if record_dir is not None:
        return RunCharges(record_dir)
    storage = _ray_train_storage()
    if storage is None:
        return MemoryCharges()
    if not isinstance(storage.storage_filesystem, fs.LocalFileSystem):
        raise PrivateStepError(
            "record_dir: Ray Train's storage is not a local file system, where rank 0 keeps "
            "the log of each step it releases; pass record_dir=, a folder every attempt of "
            "this run can read (a URI works too: a dead attempt's steps then count in full)")
    return RunCharges(f"{storage.experiment_fs_path}/{RECORD_FOLDER}")


def _ray_train_storage():
    """The Ray Train run's storage context, or None outside a Ray Train worker."""
    try:
        import ray.train

        return ray.train.get_context().get_storage()
    except Exception:  # noqa: BLE001 -- not in a Ray Train worker (Ray says so in many ways)
        return None


def count_restored(account: RunAccount, released: Charged) -> None:
    """A state restored in memory: the steps it says were released are charged already."""
    if isinstance(account.record, MemoryCharges):
        account.record = MemoryCharges(max(account.record.total(), released))


# A state saved before a term was kept holds the loop that had it at its default.
UNSAVED_TERMS = {"unit": "example", "rows_per_user": None, "user_contribution": "sum"}


def plan_terms(plan) -> dict:
    """What a saved state must agree on with the loop that loads it."""
    return {"mechanism": plan.mechanism.name, "num_examples": plan.num_examples,
            "expected_batch_size": plan.expected_batch_size,
            "noise_multiplier": plan.noise_multiplier, "clip_norm": plan.clip_norm,
            "delta": plan.delta, "unit": plan.unit, "rows_per_user": plan.rows_per_user,
            "user_contribution": plan.user_contribution}


def check_saved(state: dict, terms: dict) -> None:
    """Refuse a saved state of another loop by the first argument that differs."""
    if not isinstance(state, dict) or not {"plan", "steps_done", "steps_released"} <= set(state):
        raise PrivateStepError("load_state_dict: not a PrivateStep.state_dict() (it needs "
                               "plan, steps_done and steps_released)")
    for name, value in terms.items():
        saved = state["plan"].get(name, UNSAVED_TERMS.get(name))
        if saved != value:
            raise PrivateStepError(
                f"load_state_dict: {name} is {value!r} here and {saved!r} in the saved state; "
                "build the PrivateStep with the arguments of the run it continues")


def new_parameters_to_optimizer(model: nn.Module, optimizer) -> None:
    """Parameters the mechanism added (DP-LoRA's adapters) join `optimizer` as one new group
    with its defaults; the layers they adapt are frozen and take no step."""
    known = {id(p) for group in optimizer.param_groups for p in group["params"]}
    new = [p for p in model.parameters() if p.requires_grad and id(p) not in known]
    if not new:
        return
    if not hasattr(optimizer, "add_param_group"):
        raise PrivateStepError(f"optimizer: {type(optimizer).__name__} cannot take the "
                               "adapters DP-LoRA adds (it has no add_param_group); pass a "
                               "torch.optim optimizer")
    optimizer.add_param_group({"params": new})
