"""Tied weights (ARCHITECTURE.md §2.3): a parameter used by several layers gets ONE per-example
gradient, the sum of its uses, clipped once with the rest. Against a naive per-example loop in
float64, with and without padding, with every example clipped and with none."""

import pytest
import torch
import torch.nn.functional as F
from oracles import engine_sum_in_parameter_order, naive_clipped_sum
from torch import nn

from raydp_train.privacy.clipping import PerExampleClipper, UnsupportedLayerError

pytestmark = pytest.mark.usefixtures("float64")

VOCAB, WIDTH, BATCH = 13, 6, 5
# Example lengths and T: no padding, or padding at the end of every example.
LAYOUTS = {"unpadded": ((7, 7, 7, 7, 7), 7), "padded": ((6, 5, 3, 2, 4), 9)}


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


def padded_tokens(lengths: tuple, tokens: int, vocab: int) -> torch.Tensor:
    """[B, 2, T]: ids (0 where padded) and attention mask, right padding."""
    ids = torch.randint(1, vocab, (len(lengths), tokens))
    mask = (torch.arange(tokens) < torch.tensor(lengths).unsqueeze(1)).long()
    return torch.stack([ids * mask, mask], dim=1)


def next_token_losses(logits, tokens):
    """Per-example summed next-token cross-entropy over the real tokens."""
    targets = tokens[:, 0, 1:].masked_fill(tokens[:, 1, 1:] == 0, -100)
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none").sum(1)


def assert_exact(model, example_losses, inputs, clip_norm) -> torch.Tensor:
    """The engine's clipped sum and norms equal the naive loop's; returns the norms."""
    labels = torch.arange(inputs.shape[0])
    expected, norms, _ = naive_clipped_sum(model, example_losses, inputs, labels, clip_norm)
    clipper = PerExampleClipper(model, clip_norm)
    stats = clipper.accumulate(example_losses, model, inputs, labels)
    got = engine_sum_in_parameter_order(model, clipper)
    clipper.close()
    assert clipper.num_parameters == sum(p.numel() for p in model.parameters())  # one slot
    torch.testing.assert_close(stats.norms, norms, rtol=1e-9, atol=1e-12)
    assert torch.linalg.norm(got - expected) / torch.linalg.norm(expected) < 1e-6
    return norms


def assert_exact_clipping_all_and_none(model, example_losses, inputs) -> None:
    labels = torch.arange(inputs.shape[0])
    _, norms, _ = naive_clipped_sum(model, example_losses, inputs, labels)
    assert_exact(model, example_losses, inputs, 0.5 * norms.min().item())  # every one clipped
    assert_exact(model, example_losses, inputs, 2 * norms.max().item())  # none clipped


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


def test_tied_layers_of_an_unsupported_kind_are_refused_by_name():
    model = nn.ModuleDict({"norm_a": nn.LayerNorm(4), "norm_b": nn.LayerNorm(4)})
    model["norm_b"].weight = model["norm_a"].weight
    with pytest.raises(UnsupportedLayerError,
                       match=r"'norm_a' \(LayerNorm\) and 'norm_b' \(LayerNorm\) share the "
                             r"trainable parameter 'norm_a.weight' \(tied weights\)"):
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

    def example_losses(model, tokens, labels):
        batch, length = tokens.shape[0], tokens.shape[2]
        logits = model(input_ids=tokens[:, 0], attention_mask=tokens[:, 1],
                       position_ids=torch.arange(length).expand(batch, length)).logits
        return next_token_losses(logits, tokens)

    assert_exact_clipping_all_and_none(model, example_losses, inputs)
