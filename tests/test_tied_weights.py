"""Tied weights (ARCHITECTURE.md §2.3): a parameter used by several layers gets ONE per-example
gradient, the sum of its uses, clipped once with the rest. Against a naive per-example loop in
float64, with and without padding, with every example clipped and with none."""

import pytest
import torch
import torch.nn.functional as F
from oracles import (
    LAYOUTS,
    assert_exact_clipping_all_and_none,
    causal_lm_losses,
    next_token_losses,
    padded_tokens,
)
from torch import nn

from raydp_train.privacy.clipping import PerExampleClipper, UnsupportedLayerError

pytestmark = pytest.mark.usefixtures("float64")

VOCAB, WIDTH, BATCH = 13, 6, 5


class TiedLM(nn.Module):
    """Embedding -> Linear -> causal running mean -> LM head(s) sharing the embedding's weight."""

    def __init__(self, heads: int, padding_idx: int | None):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, WIDTH, padding_idx=padding_idx)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.heads = nn.ModuleList(nn.Linear(WIDTH, VOCAB, bias=False) for _ in range(heads))
        for head in self.heads:
            head.weight = self.embedding.weight

    def forward(self, tokens):
        ids, mask = tokens[:, 0], tokens[:, 1].unsqueeze(-1).to(torch.float64)
        h = torch.tanh(self.mix(self.embedding(ids))) * mask
        positions = torch.arange(1, ids.shape[1] + 1, dtype=h.dtype).view(1, -1, 1)
        h = h + h.cumsum(1) / positions
        return sum(head(h) for head in self.heads)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("heads", "padding_idx"), [(1, None), (1, 0), (2, None)])
def test_embedding_tied_to_lm_head_matches_naive_loop(layout, heads, padding_idx):
    torch.manual_seed(0)
    model = TiedLM(heads, padding_idx)
    inputs = padded_tokens(*LAYOUTS[layout], VOCAB)

    def example_losses(model, tokens, labels):
        return next_token_losses(model(tokens), tokens)

    assert_exact_clipping_all_and_none(model, example_losses, inputs)


def test_linear_layers_sharing_a_weight_match_naive_loop():
    torch.manual_seed(1)
    model = nn.ModuleDict({"first": nn.Linear(4, 4), "second": nn.Linear(4, 4, bias=False),
                           "out": nn.Linear(4, 3)})
    model["second"].weight = model["first"].weight

    def example_losses(model, x, labels):
        h = model["second"](torch.tanh(model["first"](x)))
        return model["out"](h).square().sum((1, 2))

    assert_exact_clipping_all_and_none(model, example_losses, torch.randn(BATCH, 3, 4))


def test_embeddings_sharing_a_table_match_naive_loop():
    torch.manual_seed(2)
    model = nn.ModuleDict({"words": nn.Embedding(VOCAB, 4), "others": nn.Embedding(VOCAB, 4),
                           "out": nn.Linear(4, 2)})
    model["others"].weight = model["words"].weight

    def example_losses(model, ids, labels):
        h = model["words"](ids) * model["others"](ids.flip(1)[:, :3]).sum(1, keepdim=True)
        return model["out"](h).square().sum((1, 2))

    ids = torch.randint(0, 5, (BATCH, 4))  # few ids: repeats within and across the two uses
    assert_exact_clipping_all_and_none(model, example_losses, ids)


def test_tied_layers_without_a_cross_term_are_refused_by_name():
    """An embedding's per-example gradient would be dense [B, V, d]: shared with anything but
    a Linear weight or another embedding, it is refused, naming both modules."""
    model = nn.ModuleDict({"embed": nn.Embedding(4, 3), "norm": nn.LayerNorm((4, 3))})
    model["norm"].weight = model["embed"].weight
    with pytest.raises(UnsupportedLayerError,
                       match=r"'embed' \(Embedding\) and 'norm' \(LayerNorm\) share the "
                             r"trainable parameter 'embed.weight'"):
        PerExampleClipper(model, 1.0)


def test_tied_weight_used_outside_its_layers_is_still_refused():
    model = TiedLM(1, None)

    def example_losses(model, tokens, labels):
        h = model.embedding(tokens[:, 0])
        return F.linear(h, model.embedding.weight).square().sum((1, 2))

    with pytest.raises(UnsupportedLayerError, match="'embedding.weight' is used by"):
        PerExampleClipper(model, 1.0).accumulate(
            example_losses, model, padded_tokens(*LAYOUTS["padded"], VOCAB), None)


def test_gpt2_lm_head_tied_to_its_input_embedding_matches_naive_loop():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    config = transformers.GPT2Config(
        vocab_size=50, n_layer=1, n_embd=16, n_head=2, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config).double()
    assert model.lm_head.weight is model.transformer.wte.weight
    inputs = padded_tokens(*LAYOUTS["padded"], 50)
    assert_exact_clipping_all_and_none(model, causal_lm_losses, inputs)
