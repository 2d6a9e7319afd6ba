"""Oracles shared by tests: what the engine must equal, computed the slow obvious way."""

import torch


def naive_clipped_sum(model, example_losses, inputs, labels, clip_norm=None):
    """(clipped sum in the order of the trainable parameters, per-example norms, clip norm):
    one backward pass per example. clip_norm None: the median norm, so some clip, some not."""
    params = [p for p in model.parameters() if p.requires_grad]
    per_example = []
    for i in range(labels.shape[0]):
        loss = example_losses(model, inputs[i:i + 1], labels[i:i + 1]).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        per_example.append(torch.cat([(torch.zeros_like(p) if g is None else g).flatten()
                                      for p, g in zip(params, grads, strict=True)]))
    per_example = torch.stack(per_example)
    norms = per_example.norm(dim=1)
    clip_norm = norms.median().item() if clip_norm is None else clip_norm
    factors = clip_norm / norms.clamp(min=clip_norm)
    return (per_example * factors.unsqueeze(1)).sum(0), norms, clip_norm


def engine_sum_in_parameter_order(model, clipper) -> torch.Tensor:
    """The engine's clipped sum, read from each parameter's .grad in model.parameters() order."""
    by_param = {id(p): p.grad.flatten() for p in clipper.parameters}
    return torch.cat([by_param[id(p)] for p in model.parameters() if p.requires_grad])
