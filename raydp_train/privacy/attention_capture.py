"""nn.MultiheadAttention's forward, computed as the attention rule sees it (ARCHITECTURE.md
§2.3): inside the module's forward a TorchFunctionMode takes its call of
F.multi_head_attention_forward and computes the same function from its parts -- the
projections q, k, v (F.linear), `attention_rule.attention` and the out projection -- so the
model's own backward brings G_q, G_k, G_v and dL/dy to hooks on those tensors, and the rule
needs no recomputation. A call the mode does not take (torch's fast path, dropout in training,
static keys) is recomputed by the rule from its recorded arguments instead.
"""

from __future__ import annotations

import inspect

import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from raydp_train.privacy.rule_registry import LayerCalls

_FORWARD = inspect.signature(F.multi_head_attention_forward)


class AttentionCapture(TorchFunctionMode):
    """For one call of the module: appends to calls.state["captured"] its record (inputs
    x_q, x_k, x_v and O batch first; the gradients 'q', 'k', 'v', 'bias_k', 'bias_v', 'y' as
    the backward brings them), or None when the call was not taken."""

    def __init__(self, module: nn.Module, calls: LayerCalls, ghost_leaf: Tensor, attention):
        super().__init__()
        self.module, self.calls, self.ghost_leaf = module, calls, ghost_leaf
        self.attention = attention  # attention_rule.attention (imported there: no cycle)
        self.record: dict | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward and self.record is None:
            call = _FORWARD.bind(*args, **kwargs)
            call.apply_defaults()
            if _taken(call.arguments):
                self.record = {}
                return self._forward(call.arguments)
        return func(*args, **kwargs)

    def __exit__(self, exc_type, exc_value, traceback):
        self.calls.state.setdefault("captured", []).append(self.record)
        return super().__exit__(exc_type, exc_value, traceback)

    def _forward(self, given: dict) -> tuple[Tensor, Tensor | None]:
        """(output [L, B, E], attention weights), as F.multi_head_attention_forward."""
        inputs = [given[name].transpose(0, 1) for name in ("query", "key", "value")]
        if given["use_separate_proj_weight"]:
            weights = [given[f"{name}_proj_weight"] for name in "qkv"]
        else:
            weights = given["in_proj_weight"].chunk(3)
        bias = given["in_proj_bias"]
        biases = (None,) * 3 if bias is None else bias.chunk(3)
        leaves = {name: self._watched(F.linear(x, w, b), name)
                  for name, x, w, b in zip("qkv", inputs, weights, biases)}
        if given["bias_k"] is not None:
            batch = inputs[0].shape[0]
            for name in ("bias_k", "bias_v"):
                expanded = given[name].reshape(1, -1).expand(batch, -1)
                leaves[name] = self._watched(expanded + self.ghost_leaf, name)
        attended, attention_weights = self.attention(self.module, leaves, given)
        self.record.update(inputs=[x.detach() for x in inputs], attended=attended.detach())
        out = F.linear(attended, given["out_proj_weight"], given["out_proj_bias"])
        # Not a view: a change in place of what the module returns must not re-route the
        # backward around this hook.
        out = self._watched(out.clone() if out._base is not None else out, "y")
        return out.transpose(0, 1), attention_weights

    def _watched(self, tensor: Tensor, name: str) -> Tensor:
        if not tensor.requires_grad:
            tensor = tensor + self.ghost_leaf  # joins the graph: the backward reaches it
        record = self.record

        def keep(grad: Tensor) -> None:
            record[name] = grad.detach()

        tensor.register_hook(keep)
        return tensor


def _taken(given: dict) -> bool:
    """Calls the capture computes: batched, no static keys, no dropout drawn."""
    return (given["query"].dim() == 3 and given["static_k"] is None
            and given["static_v"] is None
            and not (given["training"] and given["dropout_p"] > 0))
