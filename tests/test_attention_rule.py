"""nn.MultiheadAttention's rule (privacy/attention_rule.py): its projections as Linear calls,
their gradients taken in the model's backward or recomputed, exact against the naive
per-example loop (float64) in both layouts, packed or separate
weights, with and without biases, bias_k/bias_v and a zero key, the masks, the attention
weights in the loss, several calls per micro-batch, eval mode (torch's fast path), a
TransformerEncoder classifier; leave-one-out within C; dropout and a tie refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracles import assert_engine_is_the_per_example_loop, leave_one_out
from torch import nn

from raydp_train.privacy.attention_rule import AttentionRule
from raydp_train.privacy.clipping import PerExampleClipper, UnsupportedLayerError

pytestmark = pytest.mark.usefixtures("float64")

BATCH, TOKENS, WIDTH, HEADS = 5, 4, 6, 2


class Attend(nn.Module):
    """Attention over [B, T, E] inputs and a [B, T] padding pattern, read by a head; `how`
    picks the call (layout, masks, key and value, weights in the loss, calls)."""

    def __init__(self, how: str, **settings):
        super().__init__()
        self.how = how
        settings.setdefault("batch_first", how != "batch second")
        self.attention = nn.MultiheadAttention(WIDTH, HEADS, **settings)
        self.keys = nn.Linear(WIDTH, settings.get("kdim") or WIDTH)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, x, padding):
        q = k = v = x
        arguments = {}
        if self.how in ("cross", "separate"):
            k = self.keys(x)
            v = torch.tanh(k) if self.how == "separate" else k
        if self.how == "padding mask":
            arguments["key_padding_mask"] = padding.bool()
        if self.how == "float mask":
            arguments["attn_mask"] = torch.randn(TOKENS, TOKENS,
                                                 generator=torch.Generator().manual_seed(0))
        if self.how == "causal":
            arguments.update(attn_mask=nn.Transformer.generate_square_subsequent_mask(TOKENS),
                             is_causal=True, need_weights=False)
        if self.how == "per-example mask":  # [B * heads, L, S], from each example's pattern
            mask = padding.bool().unsqueeze(1).expand(-1, TOKENS, -1).clone()
            mask[:, :, 0] = False
            arguments["attn_mask"] = mask.repeat_interleave(HEADS, 0)
        if self.how == "batch second":
            q = k = v = x.transpose(0, 1)
        out, weights = self.attention(q, k, v, **arguments)
        if self.how == "batch second":
            out = out.transpose(0, 1)
        if self.how == "twice":
            out, weights = self.attention(out, x, x, need_weights=False)
        readout = self.head(out[:, -1])
        if self.how == "weights in the loss":
            readout = readout + weights.sum((1, 2)).unsqueeze(1) * weights[:, 0, :3]
        return readout


def losses(model, inputs, y):
    x, padding = inputs
    return F.cross_entropy(model(x, padding), y, reduction="none")


def data(seed: int = 0):
    torch.manual_seed(seed)
    x = torch.randn(BATCH, TOKENS, WIDTH)
    padding = (torch.rand(BATCH, TOKENS) < 0.3).long()
    padding[:, 0] = 0  # every example keeps a key
    return (x, padding), torch.arange(BATCH) % 3


CASES = {
    "self": {}, "batch second": {}, "no bias": {"bias": False},
    "bias_k, bias_v, zero key": {"add_bias_kv": True, "add_zero_attn": True},
    "cross": {}, "separate": {"kdim": 5, "vdim": 5}, "padding mask": {}, "float mask": {},
    "per-example mask": {}, "causal": {}, "weights in the loss": {}, "twice": {},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("clip_norm", [1e-3, 1e3])  # every example clipped; none
@pytest.mark.parametrize("taken", [True, False], ids=["in the forward", "recomputed"])
def test_attention_is_exact_against_the_per_example_loop(case, clip_norm, taken, monkeypatch):
    """The projections' gradients taken in the model's own backward (attention_capture.py),
    or, for a call the capture does not take, recomputed from the recorded arguments."""
    if not taken:
        monkeypatch.setattr(AttentionRule, "during_forward", lambda *args: None)
    torch.manual_seed(1)
    how = case if case not in ("no bias", "bias_k, bias_v, zero key") else "self"
    model = Attend(how, **CASES[case])
    inputs, y = data()
    assert_engine_is_the_per_example_loop(model, losses, inputs, y, clip_norm)
    clipper = PerExampleClipper(model, clip_norm)
    assert clipper.per_example_path == []
    assert isinstance({m: r for _, m, r in clipper.layers}[model.attention], AttentionRule)
    clipper.close()


def test_eval_mode_where_torch_takes_its_fast_path_is_exact():
    torch.manual_seed(2)
    model = Attend("self").eval()
    inputs, y = data(2)
    assert_engine_is_the_per_example_loop(model, losses, inputs, y, 0.05)


def test_attention_owns_out_proj_and_trains_it_alone():
    torch.manual_seed(3)
    model = Attend("self")
    model.attention.in_proj_weight.requires_grad_(False)
    model.attention.in_proj_bias.requires_grad_(False)
    inputs, y = data(3)
    assert_engine_is_the_per_example_loop(model, losses, inputs, y, 0.05)
    clipper = PerExampleClipper(model, 1.0, other_layers="refuse")
    assert sorted(clipper.slots[model.attention]) == ["out_proj.bias", "out_proj.weight"]
    assert "attention.out_proj" not in [name for name, _, _ in clipper.layers]


def transformer_classifier(norm_first: bool) -> nn.Module:
    layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 12, dropout=0.0, batch_first=True,
                                       norm_first=norm_first)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    return nn.Sequential(nn.Linear(4, WIDTH), encoder, nn.Flatten(),
                         nn.Linear(WIDTH * TOKENS, 3))


@pytest.mark.parametrize("norm_first", [False, True])
def test_a_transformer_encoder_takes_only_native_rules_and_is_exact(norm_first):
    torch.manual_seed(4)
    model = transformer_classifier(norm_first)
    x, y = torch.randn(BATCH, TOKENS, 4), torch.arange(BATCH) % 3
    assert_engine_is_the_per_example_loop(
        model, lambda m, x, y: F.cross_entropy(m(x), y, reduction="none"), x, y, 0.05)
    assert PerExampleClipper(model, 1.0).per_example_path == []


def test_leave_one_out_stays_within_the_clip_norm():
    torch.manual_seed(5)
    model = Attend("padding mask")
    (x, padding), y = data(5)
    contributions = leave_one_out(
        model, lambda rows: losses(model, (x[rows], padding[rows]), y[rows]), BATCH, 0.01)
    assert max(contributions) <= 1 + 1e-9
    assert min(contributions) > 0.99  # each example's norm is far above C: clipped to C


def test_dropout_in_training_is_refused_by_name():
    model = Attend("self", dropout=0.2).train()
    inputs, y = data()
    clipper = PerExampleClipper(model, 1.0)
    with pytest.raises(UnsupportedLayerError, match=r"module 'attention' \(MultiheadAttention\)"
                                                    r" has dropout=0.2.*draws random numbers"):
        clipper.accumulate(losses, model, inputs, y)


def test_a_parameter_shared_with_a_linear_is_refused_by_name():
    model = Attend("cross")
    model.keys.weight = model.attention.out_proj.weight
    inputs, y = data()
    with pytest.raises(UnsupportedLayerError, match=r"'attention'.*'keys'|'keys'.*'attention'"):
        clipper = PerExampleClipper(model, 1.0)
        clipper.accumulate(losses, model, inputs, y)
