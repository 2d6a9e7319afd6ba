"""The Linear rule's other convolutions (ARCHITECTURE.md §2.3): Conv3d and ConvTranspose1d/2d.

Conv3d is Conv2d one axis up: the input's patches (one token per output position, channels x
kernel as features) and the output gradient make a Linear. A transposed convolution is the
adjoint of the convolution with the same weight, stride, padding and dilation:

    y = conv_transpose(x, W)  =>  grad W_i[c_in, c_out, k] = sum_p x_i[c_in, p] U_i[(c_out, k), p]

with U_i = unfold(dL/dy_i) (the output gradient's patches, one per input position p). So the
Linear rule applies with the input x as the "output gradient" (tokens p, features c_in) and U
as the "input" (features c_out x kernel), group by group; the bias's gradient is dL/dy summed
over the output positions.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from raydp_train.privacy.layer_rules import ConvRule, LinearRule, _pad_same
from raydp_train.privacy.rule_registry import LayerCalls, register_rule


@register_rule(nn.Conv3d)
class Conv3dRule(ConvRule):
    """nn.Conv3d: [B, C, D, H, W] cut into patches by Tensor.unfold along each axis."""

    def tokens(self, module: nn.Module, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        kernel, stride, dilation = module.kernel_size, module.stride, module.dilation
        padding = module.padding
        if isinstance(padding, str):
            x = _pad_same(x, kernel, dilation) if padding == "same" else x
        else:
            x = F.pad(x, [p for p in reversed(padding) for _ in range(2)])
        for axis, (size, step, rate) in enumerate(zip(kernel, stride, dilation)):
            x = x.unfold(2 + axis, rate * (size - 1) + 1, step)
        x = x[..., :: dilation[0], :: dilation[1], :: dilation[2]]  # [B, C, oD, oH, oW, k...]
        patches = x.permute(0, 2, 3, 4, 1, 5, 6, 7).flatten(1, 3).flatten(2)
        return patches, g.reshape(g.shape[0], g.shape[1], -1).transpose(1, 2)


@register_rule(nn.ConvTranspose1d, nn.ConvTranspose2d)
class ConvTransposeRule(LinearRule):
    """nn.ConvTranspose1d/2d: the Linear rule on (patches of dL/dy, x), bias from dL/dy."""

    shares_input_gram = False  # its "input" is the output gradient's patches
    folds_examples = False  # its input's axes after the examples are channels and space

    def check(self, module: nn.Module, name: str) -> None:
        ConvRule.check(self, module, name)

    def groups(self, module: nn.Module) -> int:
        return module.groups

    def tokens(self, module: nn.Module, x: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """(U [B, positions of x, c_out x kernel], x [B, positions, c_in])."""
        kernel, stride = module.kernel_size, module.stride
        dilation, padding = module.dilation, module.padding
        if isinstance(module, nn.ConvTranspose1d):
            x, g = x.unsqueeze(2), g.unsqueeze(2)
            kernel, stride = (1, *kernel), (1, *stride)
            dilation, padding = (1, *dilation), (0, *padding)
        patches = F.unfold(g, kernel, dilation=dilation, padding=padding, stride=stride)
        # With output_padding >= stride (allowed when dilation > stride) the output gradient
        # has patches past the input's last position: nothing of x reaches them.
        rows = [(size + 2 * pad - rate * (k - 1) - 1) // step + 1 for size, pad, rate, k, step
                in zip(g.shape[2:], padding, dilation, kernel, stride)]
        batch, features = g.shape[0], patches.shape[1]
        patches = patches.view(batch, features, *rows)[:, :, : x.shape[2], : x.shape[3]]
        return (patches.reshape(batch, features, -1).transpose(1, 2),
                x.reshape(batch, x.shape[1], -1).transpose(1, 2))

    def squared_norms(self, module, calls: LayerCalls, slots: dict, gram_cache: dict) -> Tensor:
        weight = {name: view for name, view in slots.items() if name == "weight"}
        norms = super().squared_norms(module, calls, weight, gram_cache)
        if "bias" in slots:
            bias_grads = sum(g.reshape(g.shape[0], g.shape[1], -1).sum(2)
                             for g in calls.output_grads)
            calls.state["bias_grads"] = bias_grads
            norms = norms + bias_grads.square().sum(1)
        return norms
