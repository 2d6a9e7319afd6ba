"""LSG: low-rank and sparse gradients (Ito et al. 2022, on RGP by Yu et al. 2021),
ARCHITECTURE.md §2.4.

For each adapted weight W (n x m; conv kernels flattened to n x (m k k)):
    carriers    L = orth(W R0) (n x r),  R = orth(W^T L)^T (r x m),  R0 ~ N(0, 1) fresh
    importance  rows I_i = ||W[i,:]||, columns O_j = ||W[:,j]||; with sparsity p the floor(p n)
                least important rows of dL and floor(p m) least important columns of dR freeze
    per example dL_i = G_i^T (a_i R^T) (rows masked),  dR_i = (G_i L)^T a_i (columns masked)
    map back    dW = dL R + L dR - L (L^T dL) R
Seen from the clipping engine an adapted layer is two virtual Linear layers on small tensors,
clipped jointly with every other trainable parameter. W is already DP-released, so carriers and
masks are post-processing and cost no privacy; accounting is that of DP-SGD.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from raydp_train.errors import UserError
from raydp_train.privacy.layer_rules import (
    LinearRule,
    add_linear_clipped_sum,
    add_rounding,
    linear_weight_norm,
)
from raydp_train.privacy.rule_registry import LayerCalls, Rule, UnsupportedLayerError, rule_for


class LsgConfigError(UserError, ValueError):
    """LSG settings that do not fit the model; the message names the field."""


def gradient_carriers(weight: Tensor, rank: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """One power-method step from a fresh Gaussian R0: L (n x r) and R (r x m), orthonormal."""
    start = torch.randn(weight.shape[1], rank, generator=generator, dtype=weight.dtype)
    left = torch.linalg.qr(weight @ start.to(weight.device)).Q
    right = torch.linalg.qr(weight.t() @ left).Q.t()
    return left, right


def kept_rows_and_columns(weight: Tensor, sparsity: float) -> tuple[Tensor, Tensor]:
    """Boolean masks of the rows / columns whose carrier gradients are trained (not frozen)."""
    return _keep_largest(weight.norm(dim=1), sparsity), _keep_largest(weight.norm(dim=0), sparsity)


def _keep_largest(importance: Tensor, sparsity: float) -> Tensor:
    frozen = math.floor(sparsity * importance.numel())
    keep = torch.ones_like(importance, dtype=torch.bool)
    keep[torch.argsort(importance, stable=True)[:frozen]] = False
    return keep


def project_to_weight(grad_left: Tensor, grad_right: Tensor, left: Tensor, right: Tensor) -> Tensor:
    """dW = dL R + L dR - L (L^T dL) R: the carrier gradients mapped into W's space."""
    return grad_left @ right + left @ grad_right - left @ (left.t() @ grad_left) @ right


@dataclass
class Carriers:
    left: Tensor  # L, n x r
    right: Tensor  # R, r x m
    kept_rows: Tensor  # bool [n]
    kept_columns: Tensor  # bool [m]


class LowRankRule(Rule):
    """Clipping rule of an adapted Linear/Conv: slots `carrier_L`, `carrier_R` (+ `bias`).
    Not registered for a layer type: LSG hands it to the engine for the modules it adapts,
    wrapping the Linear/Conv rule the registry gives them."""

    def __init__(self, base: LinearRule, carriers: dict[nn.Module, Carriers]):
        self.base, self.carriers = base, carriers

    def check(self, module: nn.Module, name: str) -> None:
        self.base.check(module, name)
        if self.base.groups(module) != 1:
            raise UnsupportedLayerError(f"LSG cannot adapt grouped convolution '{name}'")

    def slot_shapes(self, module: nn.Module) -> dict[str, torch.Size]:
        carriers = self.carriers[module]
        shapes = {"carrier_L": carriers.left.shape, "carrier_R": carriers.right.shape}
        if module.bias is not None and module.bias.requires_grad:
            shapes["bias"] = module.bias.shape
        return shapes

    def slots_from_gradients(self, module: nn.Module,
                             gradients: dict[str, Tensor]) -> dict[str, Tensor]:
        """dL = (dW R^T) on kept rows and dR = (L^T dW) on kept columns, from W's gradient."""
        carriers = self.carriers[module]
        weight = gradients["weight"].reshape(carriers.left.shape[0], -1)
        slots = {
            "carrier_L": (weight @ carriers.right.t()) * carriers.kept_rows.unsqueeze(1),
            "carrier_R": (carriers.left.t() @ weight) * carriers.kept_columns,
        }
        if "bias" in self.slot_shapes(module):
            slots["bias"] = gradients["bias"]
        return slots

    def squared_norms(self, module, calls: LayerCalls, slots: dict, gram_cache: dict) -> Tensor:
        carriers = self.carriers[module]
        a, g, rows = self.base.stacked_tokens(module, calls)
        # Mask before the norms, so the clipping budget is spent on kept entries only.
        left_in, left_out = a @ carriers.right.t(), g * carriers.kept_rows
        right_in, right_out = a * carriers.kept_columns, g @ carriers.left
        norms_left, left_examples, left_bound = linear_weight_norm(left_in, left_out,
                                                                   gram_cache, None)
        norms_right, right_examples, right_bound = linear_weight_norm(right_in, right_out,
                                                                      gram_cache, None)
        add_rounding(calls, left_bound)
        add_rounding(calls, right_bound)
        calls.state.update(
            left=(left_in, left_out, left_examples), right=(right_in, right_out, right_examples),
            rows=rows,
        )
        norms = norms_left + norms_right
        if "bias" in slots:
            calls.state["bias_grads"] = g.sum(1)
            norms = norms + calls.state["bias_grads"].square().sum(1)
        return norms

    def add_clipped_sum(self, module, calls: LayerCalls, clip_factors: Tensor, slots) -> None:
        rows = calls.state["rows"]
        for slot, side in (("carrier_L", "left"), ("carrier_R", "right")):
            layer_in, layer_out, per_example = calls.state[side]
            add_linear_clipped_sum(slots[slot], layer_in, layer_out, clip_factors, per_example,
                                   rows)
        if "bias" in slots:
            slots["bias"].add_(clip_factors @ calls.state["bias_grads"])


class LowRankSparseGradients:
    """The LSG state of one model: adapted layers, their carriers and masks, refreshed per step."""

    def __init__(self, model: nn.Module, config, generator: torch.Generator):
        self.config, self.generator = config, generator
        self.adapted = adapted_layers(model, config.layers, config.rank)
        if config.train_other == "freeze":
            adapted_weights = {id(m.weight) for m in self.adapted.values()}
            for p in model.parameters():
                if id(p) not in adapted_weights:
                    p.requires_grad_(False)
        self.carriers: dict[nn.Module, Carriers] = {}
        self.slots: dict[nn.Module, dict[str, Tensor]] = {}
        self.kept: Tensor | None = None  # bool over the flat gradient buffer
        self.refresh(step=0, epoch=1, force=True)
        self.rules = {m: LowRankRule(rule_for(m), self.carriers) for m in self.adapted.values()}

    def bind(self, slots: dict[nn.Module, dict[str, Tensor]], flat_grad: Tensor) -> None:
        """Attach to the clipping engine's gradient buffer (to mask its frozen entries)."""
        self.slots, self._flat_grad = slots, flat_grad
        self.kept = self._kept_mask()

    def refresh(self, step: int, epoch: int, force: bool = False) -> None:
        """New carriers every `refresh_every` steps; sparsity only after sparsity_start_epoch."""
        if step % self.config.refresh_every and not force:
            return
        sparsity = self.config.sparsity if epoch > self.config.sparsity_start_epoch else 0.0
        with torch.no_grad():
            for module in self.adapted.values():
                weight = module.weight.reshape(module.weight.shape[0], -1)
                left, right = gradient_carriers(weight, self.config.rank, self.generator)
                rows, columns = kept_rows_and_columns(weight, sparsity)
                self.carriers[module] = Carriers(left, right, rows, columns)
        if self.slots:
            self.kept = self._kept_mask()

    def _kept_mask(self) -> Tensor:
        """False exactly on the frozen carrier entries of the flat gradient buffer."""
        mask = torch.ones_like(self._flat_grad, dtype=torch.bool)
        for module, carriers in self.carriers.items():
            for name, kept in (("carrier_L", carriers.kept_rows.unsqueeze(1)),
                               ("carrier_R", carriers.kept_columns.unsqueeze(0))):
                view = self.slots[module][name]
                region = mask.as_strided(view.shape, view.stride(), view.storage_offset())
                region.copy_(kept.expand(view.shape))
        return mask

    def write_weight_grads(self, slots: dict[nn.Module, dict[str, Tensor]]) -> None:
        """W.grad <- dL R + L dR - L (L^T dL) R for every adapted layer."""
        for module, carriers in self.carriers.items():
            grad = project_to_weight(
                slots[module]["carrier_L"], slots[module]["carrier_R"],
                carriers.left, carriers.right,
            )
            module.weight.grad = grad.view_as(module.weight)


def adapted_layers(model: nn.Module, patterns: list[str] | None, rank: int) -> dict[str, nn.Module]:
    """Modules LSG adapts: Linear/Conv matching `patterns` (default: all with min(n, m) > rank)."""
    candidates = {
        name: module for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)) and module.weight.requires_grad
    }
    if patterns is None:
        chosen = {name: m for name, m in candidates.items() if min(_matrix_shape(m)) > rank}
        if not chosen:
            raise LsgConfigError(
                f"privacy.lsg.rank: no trainable Linear/Conv layer has min(n, m) > {rank}; "
                "lower the rank"
            )
        return chosen
    chosen = {}
    for pattern in patterns:
        matched = {n: m for n, m in candidates.items() if fnmatch.fnmatchcase(n, pattern)}
        if not matched:
            raise LsgConfigError(
                f"privacy.lsg.layers: pattern {pattern!r} matches no Linear/Conv layer; "
                f"layers: {', '.join(candidates) or 'none'}"
            )
        chosen.update(matched)
    for name, module in chosen.items():
        if min(_matrix_shape(module)) <= rank:
            raise LsgConfigError(
                f"privacy.lsg.rank: must be < min(n, m) = {min(_matrix_shape(module))} of layer "
                f"'{name}' (weight {tuple(module.weight.shape)}), got {rank}"
            )
    return chosen


def _matrix_shape(module: nn.Module) -> tuple[int, int]:
    return module.weight.shape[0], module.weight[0].numel()
