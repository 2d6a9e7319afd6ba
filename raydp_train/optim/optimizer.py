"""The optimizer of a run: parameter groups (`training.param_groups`) and the learning-rate
schedule (`training.schedule`, Hugging Face's `get_scheduler` schedules), stepped once per
logical step. The updates and schedules are this package's own, held to torch's and Hugging
Face's (updates.py and schedules.py say why).

Groups select parameters by the names `model.trainable` uses (a Hugging Face model's own
names, e.g. `classifier.weight`, without the wrapper's prefix). LSG's adapted weights are
ordinary parameters here: the step writes their `.grad` from the carriers, and their group's
learning rate and weight decay apply to that gradient.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from raydp_train.config.optimizers import OWN_OPTIMIZERS, keywords_of
from raydp_train.config.training import TrainingSetupError
from raydp_train.optim.schedules import Schedule
from raydp_train.optim.updates import SGD, Adam, AdamW, Optimizer

OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": AdamW}


def named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every trainable parameter, named as `model.trainable` names them."""
    from raydp_train.models.hf import SequenceClassifier
    from raydp_train.models.hf_causal import CausalLM

    inner = model.model if isinstance(model, SequenceClassifier | CausalLM) else model
    return [(name, p) for name, p in inner.named_parameters() if p.requires_grad]


def parameter_groups(model: nn.Module, training) -> list[dict]:
    """Parameter groups: one per `training.param_groups` entry, then the rest at training.lr.
    A pattern matching no trainable parameter is an error naming the entry."""
    named = named_trainable(model)
    claimed: set[str] = set()
    groups = []
    for index, group in enumerate(training.param_groups):
        field = f"training.param_groups[{index}].params"
        members: dict[str, nn.Parameter] = {}
        for pattern in group.params:
            matched = {n: p for n, p in named if fnmatch.fnmatchcase(n, pattern)}
            if not matched:
                raise TrainingSetupError(
                    f"{field}: pattern {pattern!r} matches no trainable parameter; trainable "
                    f"names look like {named[-1][0]!r}" if named else f"{field}: nothing trains")
            members.update({n: p for n, p in matched.items() if n not in claimed})
        if not members:
            raise TrainingSetupError(f"{field}: every parameter it matches is already in an "
                                     "earlier group (the first matching group wins)")
        claimed.update(members)
        groups.append(_group(list(members.values()), group.lr, group.weight_decay, training))
    rest = [p for n, p in named if n not in claimed]
    if rest:
        groups.append(_group(rest, None, None, training))
    return groups


def _group(params: list, lr: float | None, weight_decay: float | None, training) -> dict:
    return {"params": params, "lr": training.lr if lr is None else lr,
            "weight_decay": training.weight_decay if weight_decay is None else weight_decay}


def make_optimizer(model: nn.Module, training) -> Optimizer | torch.optim.Optimizer:
    """The package's own loop (sgd, adam, adamw) or the named torch.optim class, with
    training.optimizer_options; options torch refuses are one line naming the field."""
    name, options = training.optimizer, dict(training.optimizer_options)
    if "momentum" in keywords_of(name) and training.momentum:
        options["momentum"] = training.momentum
    groups = parameter_groups(model, training)
    if name in OWN_OPTIMIZERS:
        return OPTIMIZERS[name](groups, **options)
    try:
        return getattr(torch.optim, name)(groups, **options)
    except (ValueError, TypeError, RuntimeError) as error:
        message = " ".join(str(error).split())
        raise TrainingSetupError(f"training.optimizer_options: torch.optim.{name} refused "
                                 f"{options}: {message}") from None


def make_schedule(optimizer: Optimizer, training, total_steps: int) -> Schedule:
    """The learning-rate schedule over `total_steps` logical steps."""
    return Schedule(optimizer, training.schedule, training.warmup_for(total_steps), total_steps)


def schedule_scale(optimizer: Optimizer) -> float:
    """The schedule's current multiplier of every group's learning rate."""
    group = optimizer.param_groups[0]
    return group["lr"] / group["initial_lr"]


def with_settings(state: dict, training) -> dict:
    """A checkpoint's `state` with `training`'s learning rate and weight decay in each group,
    where its schedule stands kept (each group's lr / initial_lr): a sweep's trial that PBT
    continues from another's checkpoint trains on with its own, mutated, settings."""
    settings = [(g.lr, g.weight_decay) for g in training.param_groups] + [(None, None)]
    groups = state["optimizer"]["param_groups"]
    for group, (lr, weight_decay) in zip(groups, settings):
        initial = training.lr if lr is None else lr
        scale = group["lr"] / group["initial_lr"] if group["initial_lr"] else 1.0
        group.update(initial_lr=initial, lr=initial * scale, weight_decay=(
            training.weight_decay if weight_decay is None else weight_decay))
    state["schedule"]["base_lrs"] = [group["initial_lr"] for group in groups]
    state["schedule"]["_last_lr"] = [group["lr"] for group in groups]
    return state
