"""`training.cache_frozen_prefix`: run the frozen bottom of a transformer once per example.

When only the top layers of an encoder train, the embeddings and the layers below the first
trained one are a fixed function of each example (run in eval mode: no dropout). Their output,
the input of the first trained layer, is computed once per training example and reused every
step; a cached forward swaps in a stand-in for the embeddings that returns those hidden states
and runs only the layers from the first trained one up, inside the model's own forward (its
attention masks, pooler and head unchanged). Exact: no privacy cost, since it is a per-example
deterministic transform of the input, and the clipping engine sees the same trained layers.

Memory: N x max_length x hidden numbers of the model's dtype per worker (its shard), e.g.
6,920 SST-2 sentences x 48 tokens x 384 x 4 bytes = 510 MB for all-MiniLM-L6-v2.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from raydp_train.models.builders import ModelError

FIELD = "training.cache_frozen_prefix"


class PrefixCacheError(ModelError):
    """The model has no frozen prefix that can be split off; the message names the field."""


class _StopForward(Exception):
    """Raised by the capture hook: nothing above the prefix needs to run."""


class _GivenHiddenStates(nn.Module):
    """Stands in for the embeddings: returns the cached input of the first trained layer."""

    def __init__(self, hidden: Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs) -> Tensor:
        return self.hidden


class FrozenPrefix:
    """The embeddings and layers[:first_trained] of a `SequenceClassifier`, all frozen."""

    def __init__(self, classifier: nn.Module):
        from raydp_train.models.hf import SequenceClassifier, encoder_layer_list

        if not isinstance(classifier, SequenceClassifier):
            raise PrefixCacheError(f"{FIELD}: needs model.kind hf (a transformer whose lower "
                                   "layers are frozen); set it false")
        self.base = classifier.model.base_model
        self.embeddings = getattr(self.base, "embeddings", None)
        if not isinstance(self.embeddings, nn.Module):
            raise PrefixCacheError(f"{FIELD}: cannot split {type(self.base).__name__}: it has no "
                                   "`embeddings` module to stand in for; set it false")
        try:
            self.owner, self.attribute, self.layer_list = encoder_layer_list(self.base)
        except ValueError:
            raise PrefixCacheError(f"{FIELD}: cannot split {type(self.base).__name__}: no "
                                   "layer list found; set it false") from None
        self.layers = list(self.layer_list)
        trains = [any(p.requires_grad for p in layer.parameters()) for layer in self.layers]
        self.first_trained = trains.index(True) if True in trains else len(self.layers)
        trained_below = [name for name, p in self.embeddings.named_parameters() if p.requires_grad]
        if trained_below:
            raise PrefixCacheError(
                f"{FIELD}: the prefix is not frozen: the embeddings train ({trained_below[0]}, "
                "...); freeze them (model.trainable) or set it false")

    @torch.no_grad()
    def outputs(self, classifier: nn.Module, tokens: Tensor, chunk: int = 256) -> Tensor:
        """The prefix's output (input of the first trained layer) for every row of `tokens`,
        in eval mode, on the CPU: [N, T, hidden]."""
        if self.first_trained < len(self.layers):
            handle = self.layers[self.first_trained].register_forward_pre_hook(
                self._capture_input, with_kwargs=True)
        else:  # nothing in the encoder trains: cache the output of its last layer
            handle = self.layers[-1].register_forward_hook(self._capture_output)
        was_training = classifier.training
        classifier.eval()
        device = next(classifier.parameters()).device
        parts = []
        try:
            for start in range(0, tokens.shape[0], chunk):
                self._captured = None
                try:
                    classifier(tokens[start:start + chunk].to(device))
                except _StopForward:
                    pass
                parts.append(self._captured.cpu())
        finally:
            handle.remove()
            classifier.train(was_training)
        return torch.cat(parts)

    def _capture_input(self, module, args, kwargs):
        self._captured = args[0] if args else next(iter(kwargs.values()))
        raise _StopForward

    def _capture_output(self, module, args, output):
        self._captured = output[0] if isinstance(output, tuple) else output
        raise _StopForward

    @contextmanager
    def skipped(self, hidden: Tensor) -> Iterator[None]:
        """Within: a forward of the classifier starts from `hidden` at the first trained layer."""
        self.base.embeddings = _GivenHiddenStates(hidden)
        setattr(self.owner, self.attribute, nn.ModuleList(self.layers[self.first_trained:]))
        try:
            yield
        finally:
            self.base.embeddings = self.embeddings
            setattr(self.owner, self.attribute, self.layer_list)


def cached_prefix_loss(prefix: FrozenPrefix):
    """Per-example cross-entropy of a micro-batch given as ((tokens, prefix outputs), labels)."""

    def per_example_loss(model: nn.Module, inputs: tuple[Tensor, Tensor], labels: Tensor):
        tokens, hidden = inputs
        with prefix.skipped(hidden):
            logits = model(tokens)
        return nn.functional.cross_entropy(logits, labels, reduction="none")

    return per_example_loss
