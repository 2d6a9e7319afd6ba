"""What a worker's checkpoint holds, and how a restarted worker continues from it: the model
and optimizer (a sharded model's tensors gathered whole, train/sharded.py), the schedule, the
step and epoch reached, the epoch rows so far, every node the run's workers ran on, C as
adaptive clipping left it, and the weight average (training.ema_decay)."""

from __future__ import annotations

from raydp_train.optim.averaging import make_average
from raydp_train.train import sharded


def checkpoint_state(run, epoch: int) -> dict:
    """The state of `run` (a train/worker.py WorkerRun) at the end of `epoch`."""
    return {"model": sharded.gathered(run.model.state_dict()),
            "optimizer": sharded.gathered(run.optimizer.state_dict()),
            "schedule": run.schedule.state_dict(), "epoch": epoch, "step": run.step,
            "metrics": list(run.result.metrics), "nodes_ever": run.result.nodes_ever,
            "clip_norm": getattr(run.clipper, "clip_norm", None),  # adaptive: it moves
            "average": None if run.average is None else run.average.state_dict()}


def restore_state(run, state: dict) -> None:
    """`run` continues from `state`: its weights, schedule and place; its mechanism refreshed
    for the restored weights."""
    sharded.load_weights(run.model, run.optimizer, state)
    run.schedule.load_state_dict(state["schedule"])
    run.step, run.first_epoch = state["step"], state["epoch"] + 1
    if state.get("clip_norm"):  # as adaptive clipping left it (the same C otherwise)
        run.clipper.clip_norm = state["clip_norm"]
    if run.average is not None and state.get("average") is not None:
        run.average.load_state_dict(state["average"])
    elif run.average is not None:  # a checkpoint of a run without one: it starts here
        run.average = make_average(run.optimizer, run.average.decay)
    run.result.metrics = state["metrics"]
    # The nodes of the attempts before this one (a failover moves ranks to other nodes).
    run.result.nodes_ever = sorted({*run.result.nodes_ever, *state.get("nodes_ever", ())})
    run.mechanism.refresh(run.step, run.first_epoch, force=True)  # restored weights
