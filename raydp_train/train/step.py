"""One DP-SGD step (ARCHITECTURE.md §2.1-2.2): one noise draw + clipped sums -> all-reduce
-> / q*N -> update."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from raydp_train.errors import UserError
from raydp_train.optim.updates import Optimizer
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.mechanism import DpSgd, Mechanism
from raydp_train.privacy.noise import fill_gaussian_noise_
from raydp_train.train.engine_checks import EngineChecks

LossFn = Callable[[nn.Module, Tensor, Tensor], Tensor]
Precision = Literal["fp32", "bf16"]
DP_SGD = DpSgd()  # stateless: the default of a step whose clipper DP-SGD attached
# `training.precision` -> the autocast dtype of the forward (None: no autocast).
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}


class NonFiniteStepError(UserError, RuntimeError):
    """A step whose loss or clipped sum is not finite; raised before anything is released."""


class PaddingPass(tuple):
    """A micro-batch whose examples weigh nothing (their losses times 0: gradients exactly 0,
    so they add exactly 0 to the clipped sum): under sharding every rank runs as many passes as
    the rank with the most, since each pass gathers the weights (a collective)."""


@dataclass
class StepStats:
    loss_sum: float  # sum of the sampled examples' losses (a diagnostic, not DP-released)
    num_examples: int  # realized logical batch size |S| (never used to normalize)


def private_step(
    model: nn.Module,
    clipper: PerExampleClipper,
    optimizer: Optimizer | torch.optim.Optimizer,  # ours (updates.py) or a user's own
    micro_batches: Iterable[tuple],  # each the loss's arguments after the model
    per_example_loss: LossFn,
    noise_std: float,
    expected_batch_size: float,
    noise_generator: torch.Generator,
    all_reduce_sum: Callable[[Tensor], None] = lambda tensor: None,
    mechanism: Mechanism = DP_SGD,
    precision: Precision = "fp32",
    engine_checks: EngineChecks | None = None,
) -> StepStats:
    """g^ = (N(0, noise_std^2 I) + sum_w sum_{i in S_w} clip(g_i)) / (q N).

    Each micro-batch is the tuple of `per_example_loss`'s arguments after the model (a
    pipeline's (features, labels); a user's own loop may pass more, e.g. two inputs and labels).
    With W workers only rank 0 passes noise_std > 0; the one all-reduce sums the local
    clipped sums and that single draw. An empty local sample still joins the collective.
    The mechanism (the one that attached `clipper`) says what of the buffer is reduced and
    how it reaches the parameters (LSG: kept carrier entries, mapped back to the weights).
    `precision` "bf16" runs the forward (and so the backward) in bfloat16 under autocast;
    the norms, clip factors, clipped sum, noise and update stay in the parameters' float32.
    When `engine_checks` says the step is due, the engine is checked on the first micro-batch
    (leave-one-out against one backward per example), on every rank, before anything is
    reduced.
    """
    compute_losses = in_precision(per_example_loss, precision, clipper.flat_grad.device.type)
    quantile = getattr(clipper, "quantile", None)  # adaptive clipping, or None
    all_reduce_sum = _start_from_noise(clipper, quantile, noise_std, expected_batch_size,
                                       noise_generator, all_reduce_sum)
    loss_sum, count = _add_micro_batches(model, clipper, micro_batches, compute_losses,
                                         engine_checks, quantile)
    # One sum tells: a NaN or inf anywhere makes it non-finite (clipped sums cannot overflow).
    if not math.isfinite(loss_sum + clipper.flat_grad.sum().item()):
        raise NonFiniteStepError(
            "training: a loss or the clipped gradient sum is NaN or inf, so the run stopped "
            "before this step's noisy gradient was released; lower training.lr, or scale the "
            "features (data.normalize)")
    mechanism.reduce(clipper, all_reduce_sum)  # adaptive clipping: the count with the sums
    # The expected batch size q*N, never |S|: |S| depends on the data.
    clipper.flat_grad.div_(expected_batch_size)
    mechanism.write_back(clipper)
    optimizer.step()
    if quantile is not None:  # C for the next step, from the released count alone
        clipper.clip_norm = quantile.next_clip_norm(clipper.clip_norm, expected_batch_size)
    return StepStats(loss_sum, count)


def _start_from_noise(clipper, quantile, noise_std: float, expected_batch_size: float,
                      noise_generator, all_reduce_sum: Callable[[Tensor], None]):
    """The step's noise draw (zeros on ranks > 0) as the starting value of the local sum.
    Adaptive clipping (privacy/adaptive_clipping.py) splits it between the gradient and the
    count of examples under C, drawn next from the same generator, whose sum then joins the
    step's one all-reduce. Returns the all-reduce the step uses."""
    if quantile is not None:
        noise_std = quantile.start_step(noise_std, expected_batch_size, clipper.flat_grad,
                                        clipper.clip_norm)
        all_reduce_sum = quantile.reduce_with(all_reduce_sum)
    fill_gaussian_noise_(clipper.bind_grads(), noise_std, noise_generator)
    if quantile is not None:
        fill_gaussian_noise_(quantile.count, quantile.count_std, noise_generator)
    return all_reduce_sum


def _add_micro_batches(model, clipper, micro_batches, compute_losses, engine_checks,
                       quantile) -> tuple[float, int]:
    """Add each micro-batch's clipped sum (and count under C) to the buffer; the engine
    checked on the first when due. (Sum of the losses, examples)."""
    check_due = engine_checks is not None and engine_checks.due(clipper)
    loss_sum, count = 0.0, 0
    by_user = getattr(clipper, "unit", "example") == "user"
    for batch in micro_batches:
        padding = isinstance(batch, PaddingPass)  # sharded: a pass that adds exactly 0
        losses_of = _weighing_nothing(compute_losses) if padding else compute_losses
        users = {}
        if by_user:  # the micro-batch's last tensor: its rows' user ids (ARCHITECTURE §2.14)
            *batch, users["users"] = batch
        if check_due:  # the check's full pass is this micro-batch's clipped sum
            stats = engine_checks.run(clipper, losses_of, (model, *batch), **users)
            check_due = False
        else:
            stats = clipper.accumulate(losses_of, model, *batch, **users)
        if padding:
            continue
        loss_sum += stats.losses.sum().item()
        count += stats.losses.shape[0]
        if quantile is not None:
            quantile.add_count(stats.norms, clipper.clip_norm)
    if check_due:  # this rank sampled nothing, but joins the other ranks' verdict
        engine_checks.run(clipper, compute_losses, None)
    return loss_sum, count


def _weighing_nothing(compute_losses: LossFn) -> LossFn:
    return lambda model, *batch: compute_losses(model, *batch) * 0.0


def in_precision(per_example_loss: LossFn, precision: Precision, device_type: str) -> LossFn:
    """`per_example_loss` with its forward under `torch.autocast` to the precision's dtype.

    Only the forward is wrapped: autograd runs each backward op in the dtype its forward op
    used, and the clipper's norm and sum math, after the backward, must not be autocast (the
    clipper also casts what its hooks recorded to the parameters' dtype, autocast off).
    """
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return per_example_loss

    def autocast_loss(model: nn.Module, *batch) -> Tensor:
        with torch.autocast(device_type=device_type, dtype=dtype):
            return per_example_loss(model, *batch).float()

    return autocast_loss


def cross_entropy_loss(model: nn.Module, features: Tensor, labels: Tensor) -> Tensor:
    return nn.functional.cross_entropy(model(features), labels, reduction="none")
