"""User-level clipping against a naive float64 loop over users: each user's rows summed by
plain backward passes, clipped once, summed (ARCHITECTURE.md §2.14)."""

import pytest
import torch
from torch import nn

from raydp_train.config.privacy import LsgConfig
from raydp_train.privacy.clipping import PerExampleClipper, UnsupportedLayerError
from raydp_train.privacy.lsg import LowRankSparseGradients
from raydp_train.privacy.user_clipping import user_layout
from tests.oracles import clip_and_sum, engine_sum_in_parameter_order, per_example_grads

VOCAB, TOKENS, WIDTH = 13, 5, 6


class TokenModel(nn.Module):
    """Embedding -> LayerNorm -> Linear (tokens, ghost or materialized) -> mean -> Linear."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.mix = nn.Linear(WIDTH, hidden)
        self.head = nn.Linear(hidden, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.norm(self.embed(ids)))).mean(1))


def losses_of(model, ids, labels):
    return nn.functional.cross_entropy(model(ids), labels, reduction="none")


def naive_user_sum(model, ids, labels, users, clip_norm):
    """sum over users of clip(sum of the user's per-row gradients), users in id order."""
    rows = per_example_grads(model, losses_of, ids, labels)
    per_user = torch.stack([rows[users == u].sum(0) for u in users.unique()])
    return clip_and_sum(per_user, clip_norm)


def batch(rows=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, TOKENS), generator=gen)
    labels = torch.randint(0, 3, (rows,), generator=gen)
    users = torch.tensor([7, 2, 7, 9, 2, 7, 4, 9, 9, 9, 30][:rows])
    return ids, labels, users


def engine_user_sum(model, ids, labels, users, clip_norm, rules=None):
    clipper = PerExampleClipper(model, clip_norm, rules=rules, unit="user")
    clipper.zero_grad()
    stats = clipper.accumulate(losses_of, model, ids, labels, users=users)
    got = engine_sum_in_parameter_order(model, clipper)
    clipper.close()
    return got, stats


@pytest.mark.parametrize("hidden", [8, 200])  # mix: materialized (2 (kT)^2 > m n), ghost
def test_engine_clipped_sum_is_the_naive_per_user_loop(hidden):
    torch.manual_seed(0)
    model = TokenModel(hidden).double()
    ids, labels, users = batch()
    expected, norms, clip_norm = naive_user_sum(model, ids, labels, users, None)
    got, stats = engine_user_sum(model, ids, labels, users, clip_norm)
    assert torch.max(torch.abs(got - expected)) / torch.max(torch.abs(expected)) < 1e-9
    torch.testing.assert_close(stats.norms, norms, rtol=1e-9, atol=0)
    # Not the per-row clipped sum: the test would fail if rows were clipped one by one.
    per_row, _, _ = clip_and_sum(per_example_grads(model, losses_of, ids, labels), clip_norm)
    assert torch.max(torch.abs(per_row - expected)) / torch.max(torch.abs(expected)) > 1e-3


def test_removing_one_user_changes_the_release_by_at_most_c():
    torch.manual_seed(1)
    model = TokenModel().double()
    ids, labels, users = batch()
    clip_norm = 1e-3  # every user clipped
    noise = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64)
    full, _ = engine_user_sum(model, ids, labels, users, clip_norm)
    for user in users.unique():
        keep = users != user
        without, _ = engine_user_sum(model, ids[keep], labels[keep], users[keep], clip_norm)
        assert ((full + noise) - (without + noise)).norm() <= clip_norm * (1 + 1e-9)
    # ... while user 9's four rows, clipped one by one, move it by more than C.
    rows = per_example_grads(model, losses_of, ids, labels)
    assert clip_and_sum(rows[users == 9], clip_norm)[0].norm() > 1.1 * clip_norm


def test_lsg_carriers_are_clipped_per_user():
    torch.manual_seed(2)
    model = TokenModel(hidden=16).double()
    ids, labels, users = batch()
    config = LsgConfig(rank=2, layers=["mix"])
    lsg = LowRankSparseGradients(model, config, torch.Generator().manual_seed(0))
    clipper = PerExampleClipper(model, 0.05, rules=lsg.rules, unit="user")
    clipper.zero_grad()
    stats = clipper.accumulate(losses_of, model, ids, labels, users=users)
    flat_user = clipper.flat_grad.clone()
    # The oracle: each user's gradient in the engine's own slots (carriers), clipped, summed.
    rows = per_example_grads(model, losses_of, ids, labels)
    params = [p for p in model.parameters() if p.requires_grad]
    per_user = []
    for u in users.unique():
        flat, start = rows[users == u].sum(0), 0
        grads = {}
        for p in params:
            grads[id(p)] = flat[start:start + p.numel()].view_as(p)
            start += p.numel()
        per_user.append(clipper.slot_vector(grads))
    expected, norms, _ = clip_and_sum(torch.stack(per_user), 0.05)
    clipper.close()
    assert torch.max(torch.abs(flat_user - expected)) / torch.max(torch.abs(expected)) < 1e-9
    torch.testing.assert_close(stats.norms, norms, rtol=1e-9, atol=0)


def test_a_rule_that_cannot_read_rows_as_tokens_is_refused_by_name():
    model = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(3 * 4, 2))
    with pytest.raises(UnsupportedLayerError, match=r"privacy.unit: user.*module '0' \(Conv1d\)"):
        PerExampleClipper(model, 1.0, unit="user")


def test_the_engine_needs_user_ids_exactly_when_the_unit_is_user():
    model = TokenModel().double()
    ids, labels, _ = batch()
    clipper = PerExampleClipper(model, 1.0, unit="user")
    with pytest.raises(ValueError, match="user ids exactly when the unit is user"):
        clipper.accumulate(losses_of, model, ids, labels)
    clipper.close()


def test_user_layout_pads_each_user_to_the_most_rows():
    layout = user_layout(torch.tensor([5, 3, 5, 5]))
    assert layout.tolist() == [[1, 4, 4], [0, 2, 3]]


def naive_user_mean(model, ids, labels, users, clip_norm):
    """sum over users of clip(mean of the user's per-row gradients), users in id order."""
    rows = per_example_grads(model, losses_of, ids, labels)
    per_user = torch.stack([rows[users == u].mean(0) for u in users.unique()])
    return clip_and_sum(per_user, clip_norm)


@pytest.mark.parametrize("hidden", [8, 200])  # mix: materialized, ghost
def test_the_mean_per_user_is_the_naive_loop_of_clipped_means(hidden):
    torch.manual_seed(3)
    model = TokenModel(hidden).double()
    ids, labels, users = batch()
    _, norms, _ = naive_user_mean(model, ids, labels, users, None)
    ordered = norms.sort().values  # C between two users' norms: some clipped, some not
    clip_norm = ((ordered[1] + ordered[2]) / 2).item()
    expected, norms, _ = naive_user_mean(model, ids, labels, users, clip_norm)
    clipper = PerExampleClipper(model, clip_norm, unit="user", user_contribution="mean")
    clipper.zero_grad()
    stats = clipper.accumulate(losses_of, model, ids, labels, users=users)
    got = engine_sum_in_parameter_order(model, clipper)
    clipper.close()
    assert torch.max(torch.abs(got - expected)) / torch.max(torch.abs(expected)) < 1e-9
    torch.testing.assert_close(stats.norms, norms, rtol=1e-9, atol=0)
    # Not the clipped sum: this test fails if the rows were summed.
    summed, _, _ = naive_user_sum(model, ids, labels, users, clip_norm)
    assert torch.max(torch.abs(summed - expected)) / torch.max(torch.abs(expected)) > 1e-3


def test_removing_one_user_moves_the_mean_by_at_most_c():
    torch.manual_seed(4)
    model = TokenModel().double()
    ids, labels, users = batch()
    clip_norm = 1e-3

    def release(keep):
        clipper = PerExampleClipper(model, clip_norm, unit="user", user_contribution="mean")
        clipper.zero_grad()
        clipper.accumulate(losses_of, model, ids[keep], labels[keep], users=users[keep])
        got = engine_sum_in_parameter_order(model, clipper)
        clipper.close()
        return got

    full = release(torch.ones_like(users, dtype=torch.bool))
    for user in users.unique():
        assert (full - release(users != user)).norm() <= clip_norm * (1 + 1e-9)
