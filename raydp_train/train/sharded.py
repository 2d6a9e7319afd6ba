"""A worker's model sharded over the workers (`training.sharding: fsdp`, ARCHITECTURE.md
§2.15): the engine rebuilt on the sharded model, its sums reduced layer by layer onto the
shards, each rank adding its own shard noise (or, for a mechanism whose trained parameters
stay whole, the usual all-reduce and rank-0 draw); checkpoints and the returned model whole.

Checkpoints hold the gathered state (every DTensor's `full_tensor()`, a collective every rank
joins; rank 0 writes it), so a sharded run resumes on any number of workers and its state file
is the unsharded run's format; resuming loads the whole state and keeps each rank's rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from raydp_train.errors import UserError
from raydp_train.privacy.mechanism import Mechanism
from raydp_train.privacy.noise import make_noise_generator
from raydp_train.privacy.sharding import (
    ShardedMechanism,
    ShardedSums,
    is_sharded,
    shard_model,
    shard_of,
    shard_seed,
    shardable_rule,
)
from raydp_train.train.step import PaddingPass


class ShardingRefused(UserError, ValueError):
    """A covered layer whose rule cannot run on sharded weights."""


def shard_worker(mechanism: Mechanism, engine, model: nn.Module, plan, run, context) -> tuple:
    """(mechanism, engine, this rank's share of the step's noise std) on the sharded model."""
    engine.close()
    replicated = set(engine.parameters) if mechanism.sharding == "replicated" else set()
    shard_model(model, replicated)
    # The clipper alone: a mechanism's own attach would change the model again (adapters).
    engine = Mechanism.attach(mechanism, model, plan.clip_norm)
    refuse_whole_weight_rules(engine)
    std = mechanism.noise_std(plan.noise_multiplier, plan.clip_norm)
    if mechanism.sharding == "replicated":
        return mechanism, engine, std if context.rank == 0 else 0.0
    seed = None if run.seed is None else shard_seed(run.seed, context.rank)
    generator, _ = make_noise_generator(run.noise, seed, context.device)
    sums = ShardedSums(engine, std, generator)
    return ShardedMechanism(mechanism, sums), engine, 0.0  # no rank-0 draw: each its shard's


def refuse_whole_weight_rules(engine) -> None:
    """A layer with sharded trained weights must have a rule that works from what the hooks
    recorded (its weights are resharded by the time the norms are computed)."""
    for name, module, rule in engine.layers:
        sharded = any(is_sharded(p) for p in module.parameters(recurse=False))
        if sharded and not shardable_rule(rule):
            raise ShardingRefused(
                f"training.sharding: fsdp: module '{name}' ({type(module).__name__}) has a rule "
                f"({type(rule).__name__}) that reads its weights after the backward, when FSDP "
                "has resharded them; freeze it, or use training.sharding: none")


def equal_passes(batches: list[tuple], spare: Callable[[], tuple], context) -> list[tuple]:
    """This rank's micro-batches, and as many zero-weight passes of the row `spare()` as make
    its passes the most any rank runs this step (one small collective a step)."""
    most = torch.tensor([len(batches)], device=context.device)
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
    missing = int(most) - len(batches)
    return batches + [PaddingPass(spare())] * missing if missing else batches


def gathered(state: dict) -> dict:
    """`state` (a state dict, nested) with every sharded tensor gathered whole (collective)."""
    if isinstance(state, dict):
        return {key: gathered(value) for key, value in state.items()}
    if isinstance(state, list):
        return [gathered(value) for value in state]
    return state.full_tensor() if is_sharded(state) else state


def checkpoint_state(model, optimizer, schedule, epoch: int, step: int,
                     metrics: list[dict]) -> dict:
    """What a checkpoint holds; a sharded model's and optimizer's tensors gathered whole."""
    return {
        "model": gathered(model.state_dict()),
        "optimizer": gathered(optimizer.state_dict()),
        "schedule": schedule.state_dict(),
        "epoch": epoch,
        "step": step,
        "metrics": list(metrics),
    }


def load_weights(model: nn.Module, optimizer, state: dict) -> None:
    """The checkpoint's model and optimizer state; onto a sharded model, each rank's rows."""
    current = model.state_dict()
    with torch.no_grad():
        model.load_state_dict({key: shard_like(value, current.get(key))
                               for key, value in state["model"].items()})
    optimizer.load_state_dict(state["optimizer"])
    for param, values in optimizer.state.items():
        for key, value in values.items():
            values[key] = shard_like(value, param) if key != "step" else value


def shard_like(value: Tensor, like: Tensor | None) -> Tensor:
    """`value` (whole) as `like` holds it: its shard when `like` is sharded (a key the model
    lacks, or a wrong shape, is left for `load_state_dict` to name)."""
    if like is None or not is_sharded(like) or is_sharded(value) or value.shape != like.shape:
        return value
    return shard_of(value, like)


def whole_model(model: nn.Module, build: Callable[[], nn.Module]) -> nn.Module:
    """The trained model as one plain module on every rank (`build` makes an unsharded one
    with the same parameters); `model` itself when it is not sharded."""
    if not any(is_sharded(p) for p in model.parameters()):
        return model
    whole = build()
    whole.load_state_dict(gathered(model.state_dict()))
    return whole
