"""Which trained parameters a covered module owns (ARCHITECTURE.md §2.3): its own, or, for a
module on the per-example path that uses its children's parameters without calling them, its
whole subtree's. A leaf module: the engine's modules all ask it."""

from __future__ import annotations

import weakref

from torch import nn

# Modules whose forward uses their children's parameters without calling the children
# (nn.MultiheadAttention reads `out_proj.weight` in F.multi_head_attention_forward): on the
# per-example path, such a module owns its whole subtree's parameters.
USES_CHILDREN_FUNCTIONALLY = (nn.MultiheadAttention,)
WHOLE_SUBTREE: weakref.WeakSet = weakref.WeakSet()  # the modules that own their subtree


def owned_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """The trained parameters a covered module owns, by (dotted) name: its own, or its whole
    subtree's for a module on the per-example path that uses its children functionally."""
    recurse = module in WHOLE_SUBTREE
    return {n: p for n, p in module.named_parameters(recurse=recurse) if p.requires_grad}
