"""Oracles shared by tests: what the engine must equal, computed the slow obvious way."""

import torch
import torch.nn.functional as F

from raydp_train.privacy.clipping import PerExampleClipper


def per_example_grads(model, example_losses, inputs, labels, params=None,
                      use_backward=False) -> torch.Tensor:
    """[B, P]: one backward pass per example, over `params` (default: the model's trainable
    parameters, in model.parameters() order; an unused one gives zeros). `inputs` is a tensor
    or a tuple of tensors, cut per example alike. `use_backward`: .backward() instead of
    autograd.grad (reentrant activation checkpoints refuse autograd.grad)."""
    params = params or [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(labels.shape[0]):
        one = (tuple(t[i:i + 1] for t in inputs) if isinstance(inputs, tuple)
               else inputs[i:i + 1])
        loss = example_losses(model, one, labels[i:i + 1]).sum()
        if use_backward:
            for p in params:
                p.grad = None
            loss.backward()
            grads = [p.grad for p in params]
        else:
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g).flatten()
                               for p, g in zip(params, grads, strict=True)]))
    return torch.stack(rows)


def clip_and_sum(per_example: torch.Tensor, clip_norm=None):
    """(sum of the rows each clipped to norm `clip_norm`, the rows' norms, the clip norm).
    clip_norm None: the median norm, so some clip, some not; inf: none clipped."""
    norms = per_example.norm(dim=1)
    clip_norm = norms.median().item() if clip_norm is None else clip_norm
    factors = torch.where(norms > clip_norm, clip_norm / norms, torch.ones_like(norms))
    return (per_example * factors.unsqueeze(1)).sum(0), norms, clip_norm


def naive_clipped_sum(model, example_losses, inputs, labels, clip_norm=None, params=None,
                      use_backward=False):
    """(clipped sum in the order of the trainable parameters, per-example norms, clip norm):
    one backward pass per example (per_example_grads, clip_and_sum)."""
    return clip_and_sum(per_example_grads(model, example_losses, inputs, labels, params,
                                          use_backward), clip_norm)


def assert_engine_is_the_per_example_loop(model, example_losses, inputs, labels, clip_norm):
    """PerExampleClipper's clipped sum and norms equal naive_clipped_sum's (relative 1e-9:
    run it in float64)."""
    expected, norms, _ = naive_clipped_sum(model, example_losses, inputs, labels, clip_norm)
    clipper = PerExampleClipper(model, clip_norm)
    stats = clipper.accumulate(example_losses, model, inputs, labels)
    got = engine_sum_in_parameter_order(model, clipper)
    clipper.close()
    assert torch.max(torch.abs(got - expected)) / torch.max(torch.abs(expected)) < 1e-9
    torch.testing.assert_close(stats.norms, norms, rtol=1e-9, atol=0)


def engine_sum_in_parameter_order(model, clipper) -> torch.Tensor:
    """The engine's clipped sum, read from each parameter's .grad in model.parameters() order."""
    by_param = {id(p): p.grad.flatten() for p in clipper.parameters}
    return torch.cat([by_param[id(p)] for p in model.parameters() if p.requires_grad])


# Causal language models: example lengths and T, without padding or with padding at the end of
# every example.
LAYOUTS = {"unpadded": ((7, 7, 7, 7, 7), 7), "padded": ((6, 5, 3, 2, 4), 9)}


def padded_tokens(lengths: tuple, tokens: int, vocab: int) -> torch.Tensor:
    """[B, 2, T]: ids (0 where padded) and attention mask, right padding."""
    ids = torch.randint(1, vocab, (len(lengths), tokens))
    mask = (torch.arange(tokens) < torch.tensor(lengths).unsqueeze(1)).long()
    return torch.stack([ids * mask, mask], dim=1)


def next_token_losses(logits, tokens):
    """Per-example summed next-token cross-entropy over the real tokens."""
    targets = tokens[:, 0, 1:].masked_fill(tokens[:, 1, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none").sum(1)


def causal_lm_losses(model, tokens, labels=None):
    """A Hugging Face causal LM's per-example summed next-token loss; positions per example."""
    batch, length = tokens.shape[0], tokens.shape[2]
    logits = model(input_ids=tokens[:, 0], attention_mask=tokens[:, 1],
                   position_ids=torch.arange(length).expand(batch, length)).logits
    return next_token_losses(logits, tokens)


def assert_exact(model, example_losses, inputs, clip_norm, norm_rtol=1e-9) -> torch.Tensor:
    """The engine's clipped sum and norms equal the naive loop's; returns the norms."""
    labels = torch.arange(inputs.shape[0])
    expected, norms, _ = naive_clipped_sum(model, example_losses, inputs, labels, clip_norm)
    clipper = PerExampleClipper(model, clip_norm)
    stats = clipper.accumulate(example_losses, model, inputs, labels)
    got = engine_sum_in_parameter_order(model, clipper)
    clipper.close()
    # A tied parameter has one slot.
    assert clipper.num_parameters == sum(p.numel() for p in model.parameters() if p.requires_grad)
    torch.testing.assert_close(stats.norms, norms, rtol=norm_rtol, atol=1e-12)
    assert torch.linalg.norm(got - expected) / torch.linalg.norm(expected) < 1e-6
    return norms


def assert_exact_clipping_all_and_none(model, example_losses, inputs, norm_rtol=1e-9) -> None:
    labels = torch.arange(inputs.shape[0])
    _, norms, _ = naive_clipped_sum(model, example_losses, inputs, labels)
    every, none = 0.5 * norms.min().item(), 2 * norms.max().item()
    assert_exact(model, example_losses, inputs, every, norm_rtol)  # every one clipped
    assert_exact(model, example_losses, inputs, none, norm_rtol)  # none clipped


def engine_is_the_loop(model, example_losses, inputs, labels) -> bool:
    """The engine's norms and clipped sum equal the per-example loop's (relative 1e-9), with
    every example clipped and with none: for randomized suites, which count what differs."""
    per_example = per_example_grads(model, example_losses, inputs, labels)
    true_norms = per_example.norm(dim=1)
    for clip_norm in (0.5 * true_norms.min().item() + 1e-12, 2 * true_norms.max().item() + 1):
        clipper = PerExampleClipper(model, clip_norm)
        stats = clipper.accumulate(example_losses, model, inputs, labels)
        got = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
        clipper.close()
        expected = (per_example * (clip_norm / true_norms.clamp(min=clip_norm))[:, None]).sum(0)
        if not torch.allclose(stats.norms, true_norms, rtol=1e-9) or \
                (got - expected).norm() > 1e-9 * expected.norm() + 1e-12:
            return False
    return True


def leave_one_out(model, losses_of_rows, batch: int, clip_norm: float,
                  **engine_settings) -> list[float]:
    """||S(D) - S(D without k)|| / C for every example k, S the engine's own clipped sum
    (float64 differences of its buffer); `losses_of_rows(rows)` the losses of those rows."""
    def engine_sum(rows):
        clipper = PerExampleClipper(model, clip_norm, **engine_settings)
        try:
            clipper.accumulate(lambda: losses_of_rows(rows))
            return clipper.flat_grad.double().clone()
        finally:
            clipper.close()
            for p in model.parameters():
                p.grad = None
    everything = engine_sum(list(range(batch)))
    return [float((everything - engine_sum([i for i in range(batch) if i != k])).norm())
            / clip_norm for k in range(batch)]
