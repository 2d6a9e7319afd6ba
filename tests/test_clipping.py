"""The one-backward clipped sum against a naive loop of single-example backward passes."""

import oracles
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raydp_train.privacy.clipping import (
    BatchDimensionError,
    PerExampleClipper,
    UnsupportedLayerError,
)

pytestmark = pytest.mark.usefixtures("float64")


def naive_clipped_sum(model, inputs, targets, loss_fn, clip_norm):
    """The oracle (tests/oracles.py) for a loss of (outputs, targets): (sum, norms)."""
    expected, norms, _ = oracles.naive_clipped_sum(
        model, lambda m, x, y: loss_fn(m(x), y), inputs, targets, clip_norm)
    return expected, norms


def engine_clipped_sum(model, inputs, targets, loss_fn, clip_norm, micro_batch=None):
    clipper = PerExampleClipper(model, clip_norm)
    micro_batch = micro_batch or inputs.shape[0]
    norms = []
    for start in range(0, inputs.shape[0], micro_batch):
        x, y = inputs[start : start + micro_batch], targets[start : start + micro_batch]
        norms.append(clipper.accumulate(lambda a, b: loss_fn(model(a), b), x, y).norms)
    clipper.close()
    # Engine order is module order; map back to model.parameters() order for the oracle.
    by_param = {id(p): p.grad.flatten() for p in clipper.parameters}
    flat = torch.cat([by_param[id(p)] for p in model.parameters() if p.requires_grad])
    return flat, torch.cat(norms)


def cross_entropy(logits, y):
    return F.cross_entropy(logits, y, reduction="none")


def squared_error(out, y):
    return (out - y).square().reshape(out.shape[0], -1).sum(1)


def assert_matches_oracle(model, x, y, loss_fn, micro_batch=None):
    _, unclipped_norms = naive_clipped_sum(model, x, y, loss_fn, float("inf"))
    # A clip norm at the median binds for half the examples, so clipping is exercised.
    clip_norm = unclipped_norms.median().item()
    expected, expected_norms = naive_clipped_sum(model, x, y, loss_fn, clip_norm)
    got, norms = engine_clipped_sum(model, x, y, loss_fn, clip_norm, micro_batch)
    # Error relative to the whole gradient's scale, not element-wise (ARCHITECTURE.md §2.3).
    assert torch.linalg.norm(got - expected) / torch.linalg.norm(expected) < 1e-5
    torch.testing.assert_close(norms, expected_norms, rtol=1e-7, atol=1e-9)


class TokenModel(nn.Module):
    """Embedding -> sequence Linear (ghost) -> tiny Linear (materialized) -> LayerNorm."""

    def __init__(self, vocab=11, width=16, padding_idx=0):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=padding_idx)
        self.wide = nn.Linear(width, 8)  # T=6: 2*36 <= 16*8 -> ghost norm
        self.narrow = nn.Linear(8, 3)  # 2*36 > 8*3 -> materialized
        self.norm = nn.LayerNorm(3)
        self.head = nn.Linear(3, 2)

    def forward(self, ids):
        h = self.narrow(torch.tanh(self.wide(self.embed(ids))))
        return self.head(self.norm(h).mean(1))


class ConvModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv2d = nn.Conv2d(2, 4, 3, stride=2, padding=1)
        self.grouped = nn.Conv2d(4, 4, 3, padding="same", dilation=2, groups=2)
        self.group_norm = nn.GroupNorm(2, 4)
        self.head = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x):
        h = torch.relu(self.conv2d(x))
        h = self.group_norm(self.grouped(h))
        return self.head(h.flatten(1))


class SequenceConvModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 5, 3, stride=1, padding=2, dilation=2)
        self.rms = nn.RMSNorm(5)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        h = self.conv(x).transpose(1, 2)
        return self.head(self.rms(h).sum(1))


class MixedModel(nn.Module):
    """Every supported layer in one model, one layer called twice."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(9, 6)
        self.proj = nn.Linear(6, 6)
        self.layer_norm = nn.LayerNorm(6)
        self.conv1d = nn.Conv1d(6, 4, 2)
        self.group_norm = nn.GroupNorm(2, 4)
        self.rms = nn.RMSNorm(4)
        self.head = nn.Linear(4, 2)

    def forward(self, ids):
        h = self.proj(self.embed(ids))
        h = self.proj(torch.relu(h))  # reused module: its calls are summed
        h = self.layer_norm(h).transpose(1, 2)
        h = self.group_norm(self.conv1d(h)).transpose(1, 2)
        return self.head(self.rms(h).mean(1))


def test_mlp_on_vectors_with_inplace_activation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(inplace=True), nn.Linear(7, 3))
    x, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    assert_matches_oracle(model, x, y, cross_entropy)


def test_linear_on_sequences_mixes_ghost_and_materialized_norms():
    torch.manual_seed(1)
    model = TokenModel()
    ids = torch.randint(0, 11, (10, 6))
    ids[0, :3] = 0  # padding tokens must get no gradient
    ids[1] = 4  # a repeated token: its rows add up before the norm
    assert_matches_oracle(model, ids, torch.randint(0, 2, (10,)), cross_entropy)


class MaskedSequenceModel(nn.Module):
    """Sequences [B, T, 5] whose last channel is a 0/1 token mask: masked tokens get an output
    gradient of exactly zero in both Linear layers, as padding does behind attention."""

    def __init__(self):
        super().__init__()
        self.wide = nn.Linear(4, 8)  # T' = 4 kept tokens: 2*16 <= 4*8 -> ghost norm
        self.narrow = nn.Linear(8, 3)  # 2*16 > 8*3 -> materialized
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        features, mask = x[..., :4], x[..., 4:]
        h = self.narrow(torch.tanh(self.wide(features) * mask)) * mask
        return self.head(h.sum(1))


def test_padding_rows_are_dropped_and_the_result_is_exact(monkeypatch):
    from raydp_train.privacy import layer_rules

    torch.manual_seed(9)
    lengths = [4, 1, 3, 2, 4, 3]  # of T = 7: the last 3 positions are padding everywhere
    x = torch.randn(len(lengths), 7, 5)
    x[..., 4] = (torch.arange(7) < torch.tensor(lengths).unsqueeze(1)).double()
    trimmed = []
    original = layer_rules.drop_padding

    def spy(a, g):
        kept = original(a, g)
        trimmed.append((kept[1].shape[1], None if kept[2] is None else len(kept[2])))
        return kept

    monkeypatch.setattr(layer_rules, "drop_padding", spy)
    assert_matches_oracle(MaskedSequenceModel(), x, torch.randint(0, 2, (6,)), cross_entropy)
    # Both sequence layers kept 4 of 7 positions and only the 17 real tokens' rows; the head
    # sees one vector per example.
    assert trimmed == [(4, sum(lengths)), (4, sum(lengths)), (1, None)]


def test_drop_padding_keeps_every_nonzero_row_and_leaves_dense_batches_alone():
    from raydp_train.privacy.layer_rules import drop_padding

    a, g = torch.randn(3, 5, 4), torch.randn(3, 5, 2)
    assert drop_padding(a, g)[2] is None and drop_padding(a, g)[1] is g
    g[:, 3:] = 0  # trailing padding in every example
    g[0, 2] = 0  # a zero row inside example 0
    g[2, 1:] = 0  # example 2 has one token
    kept_a, kept_g, rows = drop_padding(a, g)
    assert kept_a.shape == (3, 3, 4) and kept_g.shape == (3, 3, 2)
    assert rows.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [1, 2], [2, 0]]
    assert torch.equal(kept_a, a[:, :3])
    g.zero_()  # no gradient at all: one position is kept, no row
    kept_a, _, rows = drop_padding(a, g)
    assert kept_a.shape[1] == 1 and rows.numel() == 0
    g = torch.randn(3, 5, 2)
    g[:, -1] = 0  # a causal LM's: the last position has no next token, every other is in use
    kept_a, kept_g, rows = drop_padding(a, g)
    assert kept_a.shape == (3, 4, 4) and torch.equal(kept_g, g[:, :4]) and rows is None


def test_conv2d_with_stride_dilation_same_padding_and_groups():
    torch.manual_seed(2)
    x, y = torch.randn(8, 2, 6, 6), torch.randint(0, 3, (8,))
    assert_matches_oracle(ConvModel(), x, y, cross_entropy)


def test_conv1d_and_rmsnorm():
    torch.manual_seed(3)
    x, y = torch.randn(9, 3, 7), torch.randint(0, 2, (9,))
    assert_matches_oracle(SequenceConvModel(), x, y, cross_entropy)


def test_model_mixing_every_layer_with_micro_batches():
    torch.manual_seed(4)
    ids, y = torch.randint(0, 9, (11, 5)), torch.randint(0, 2, (11,))
    assert_matches_oracle(MixedModel(), ids, y, cross_entropy, micro_batch=4)


def test_frozen_parameters_are_skipped():
    torch.manual_seed(5)
    model = TokenModel()
    model.embed.weight.requires_grad_(False)
    model.wide.bias.requires_grad_(False)
    model.norm.weight.requires_grad_(False)
    ids, y = torch.randint(0, 11, (10, 6)), torch.randint(0, 2, (10,))
    assert_matches_oracle(model, ids, y, cross_entropy)
    assert model.embed.weight.grad is None and model.wide.bias.grad is None


def test_regression_loss_on_sequence_outputs():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.LayerNorm(6), nn.Linear(6, 2))
    x, y = torch.randn(7, 3, 4), torch.randn(7, 3, 2)
    assert_matches_oracle(model, x, y, squared_error)


def test_accumulate_adds_to_the_flat_buffer_and_zero_grad_clears_it():
    torch.manual_seed(7)
    model = nn.Linear(3, 2)
    clipper = PerExampleClipper(model, clip_norm=1.0)
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    clipper.accumulate(lambda: cross_entropy(model(x), y))
    once = clipper.flat_grad.clone()
    clipper.accumulate(lambda: cross_entropy(model(x), y))
    torch.testing.assert_close(clipper.flat_grad, 2 * once)
    assert model.weight.grad.data_ptr() == clipper.flat_grad.data_ptr()
    clipper.zero_grad()
    assert clipper.flat_grad.abs().sum() == 0
    assert all(p.requires_grad for p in model.parameters())


def test_every_clipped_example_norm_is_at_most_the_clip_norm():
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))
    clipper = PerExampleClipper(model, clip_norm=0.1)
    for i in range(6):
        x, y = torch.randn(1, 5) * 10, torch.randint(0, 3, (1,))
        clipper.zero_grad()
        norm = clipper.accumulate(lambda a, b: cross_entropy(model(a), b), x, y).norms
        assert norm.item() > 0.1
        assert torch.linalg.norm(clipper.flat_grad) == pytest.approx(0.1, rel=1e-9)


def test_unsupported_layer_is_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(UnsupportedLayerError, match=r"module '1' \(BatchNorm1d\)"):
        PerExampleClipper(model, 1.0)


def test_unsupported_layer_is_accepted_when_frozen():
    model = nn.Sequential(nn.Linear(4, 4), nn.PReLU())
    model[1].requires_grad_(False)
    assert PerExampleClipper(model, 1.0).num_parameters == 20


@pytest.mark.parametrize("module", [
    nn.BatchNorm1d(4).requires_grad_(False),  # frozen: still the batch's statistics
    nn.BatchNorm1d(4, affine=False),
    nn.BatchNorm1d(4, track_running_stats=False).requires_grad_(False),
    nn.InstanceNorm1d(4, track_running_stats=True),  # running means of the data, un-noised
], ids=["frozen", "no-affine", "no-running-stats", "instance-norm-running-stats"])
def test_a_module_whose_state_comes_from_the_batch_is_refused_trained_or_frozen(module):
    """Frozen, such a BatchNorm has no parameter to clip, but in training it normalizes each
    example by the batch (one example then moves every other's clipped gradient: 1.3-8.7 C
    measured) and writes the batch's means into its running statistics, saved un-noised."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Unflatten(1, (4, 1)), module, nn.Flatten())
    with pytest.raises(UnsupportedLayerError, match=rf"module '2' \({type(module).__name__}\)"
                                                    ".*trained or frozen.*GroupNorm"):
        PerExampleClipper(model, 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_trained_parameters_are_refused(dtype):
    """In bfloat16 the per-example norms came out 0.7% off (a clipped example could pass C):
    the parameters stay float32 and only the forward may be bf16 (training.precision)."""
    with pytest.raises(ValueError, match=f"trainable parameters in {dtype}: .*training.precision"):
        PerExampleClipper(nn.Sequential(nn.Linear(4, 2)).to(dtype), 1.0)


@pytest.mark.parametrize("trained", [True, False])
def test_an_embedding_with_max_norm_is_refused(trained):
    """Its forward renormalizes, in place, the rows of the tokens the batch holds: whether a
    rare token was in the data would show in the saved weights."""
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0).requires_grad_(trained),
                          nn.Flatten(), nn.Linear(8, 2))
    with pytest.raises(UnsupportedLayerError, match=r"module '0' \(Embedding\) has max_norm"):
        PerExampleClipper(model, 1.0)


def test_linear_subclass_with_its_own_forward_is_refused():
    class ScaledLinear(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    with pytest.raises(UnsupportedLayerError, match="ScaledLinear"):
        PerExampleClipper(nn.Sequential(ScaledLinear(3, 3)), 1.0, other_layers="refuse")


def test_layer_input_changed_in_place_after_the_layer_is_refused():
    """The engine reads each layer's input after the backward: an in-place change in between
    would give wrong norms, so it must raise instead."""

    class InPlaceResidual(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            x = x * 1.0  # a fresh activation the model owns
            out = self.inner(x)
            x += out  # modifies inner's input after inner ran
            return self.head(x)

    model = InPlaceResidual()
    clipper = PerExampleClipper(model, 1.0)
    x, y = torch.randn(3, 4), torch.randint(0, 2, (3,))
    with pytest.raises(ValueError, match="'inner' .* modified in place"):
        clipper.accumulate(lambda: cross_entropy(model(x), y))


def test_broadcast_leading_dimension_is_refused():
    """HF position embeddings called with position_ids [1, T] broadcast over the batch."""

    class Broadcasting(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(7, 4), nn.Embedding(5, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, ids):
            positions = torch.arange(ids.shape[1]).unsqueeze(0)
            return self.head((self.tokens(ids) + self.positions(positions)).mean(1))

    model = Broadcasting()
    clipper = PerExampleClipper(model, 1.0)
    ids, y = torch.randint(0, 7, (3, 5)), torch.randint(0, 2, (3,))
    with pytest.raises(BatchDimensionError, match=r"'positions'.*leading dimension 1.*3 examples"):
        clipper.accumulate(lambda: cross_entropy(model(ids), y))
    assert all(p.requires_grad for p in model.parameters())


def test_scalar_loss_is_refused():
    model = nn.Linear(3, 2)
    clipper = PerExampleClipper(model, 1.0)
    x, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    with pytest.raises(ValueError, match="per-example loss vector"):
        clipper.accumulate(lambda: F.cross_entropy(model(x), y))


def opacus_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.ReLU(), nn.GroupNorm(1, 3), nn.Flatten(), nn.Linear(27, 4)
    ), torch.randn(6, 1, 5, 5)


def opacus_sequence_model():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.proj = nn.Embedding(12, 8), nn.Linear(8, 8)
            self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 4)

        def forward(self, ids):
            return self.head(self.norm(torch.tanh(self.proj(self.embed(ids)))).mean(1))

    return Model(), torch.randint(0, 12, (6, 9))


@pytest.mark.parametrize("build", [opacus_cnn, opacus_sequence_model])
def test_norms_match_opacus_grad_sample_module(build):
    """Second oracle: Opacus's per-sample gradients on the same model and batch."""
    opacus = pytest.importorskip("opacus", reason="opacus is a test-only oracle")
    torch.manual_seed(9)
    model, x = build()
    y = torch.randint(0, 4, (6,))
    reference = opacus.GradSampleModule(model, loss_reduction="sum")
    F.cross_entropy(reference(x), y, reduction="sum").backward()
    samples = [p.grad_sample.reshape(6, -1) for p in model.parameters()]
    opacus_norms = torch.cat(samples, 1).norm(dim=1)
    reference._close()
    for p in model.parameters():
        p.grad, p.grad_sample = None, None
    clipper = PerExampleClipper(model, clip_norm=1.0)
    norms = clipper.accumulate(lambda: cross_entropy(model(x), y)).norms
    torch.testing.assert_close(norms, opacus_norms, rtol=1e-6, atol=1e-9)
