"""The rules of Conv3d, ConvTranspose1d/2d (privacy/conv_rules.py), PReLU (prelu_rule.py) and
EmbeddingBag (embedding_rule.py): exact against the naive per-example loop (float64) over their
settings, called twice per micro-batch, shared with another layer; leave-one-out within C;
what a rule cannot do takes the per-example path or is refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracles import assert_engine_is_the_per_example_loop, leave_one_out
from torch import nn

from raydp_train.privacy.clipping import PerExampleClipper, UnsupportedLayerError

pytestmark = pytest.mark.usefixtures("float64")


def losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


class Twice(nn.Module):
    """The layer applied twice (one module, two calls per micro-batch)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(torch.tanh(self.layer(x)))


def classifier(*layers: nn.Module) -> nn.Module:
    return nn.Sequential(*layers, nn.Flatten(), nn.LazyLinear(3))


CONVOLUTIONS = {
    "Conv3d": (lambda: nn.Conv3d(2, 4, 2), (2, 3, 4, 3)),
    "Conv3d groups, stride, dilation, padding": (
        lambda: nn.Conv3d(2, 4, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 2),
                          dilation=(2, 1, 1), groups=2), (2, 4, 5, 3)),
    "Conv3d padding same, no bias": (lambda: nn.Conv3d(2, 3, 3, padding="same", bias=False),
                                     (2, 3, 3, 3)),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(2, 3, 3), (2, 5)),
    "ConvTranspose1d stride, dilation, output padding": (
        lambda: nn.ConvTranspose1d(2, 4, 3, stride=2, padding=1, dilation=3,
                                   output_padding=2, groups=2), (2, 5)),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(2, 3, 3), (2, 3, 3)),
    "ConvTranspose2d stride, padding, groups, no bias": (
        lambda: nn.ConvTranspose2d(4, 2, (3, 2), stride=(2, 1), padding=(1, 0),
                                   output_padding=(1, 0), groups=2, bias=False), (4, 3, 4)),
    "ConvTranspose2d called twice": (lambda: Twice(nn.ConvTranspose2d(2, 2, 3, padding=1)),
                                     (2, 4, 4)),
    "Conv3d called twice": (lambda: Twice(nn.Conv3d(2, 2, 3, padding=1)), (2, 3, 3, 3)),
    "PReLU one slope": (lambda: nn.Sequential(nn.Conv2d(2, 3, 2), nn.PReLU()), (2, 4, 4)),
    "PReLU per channel": (lambda: nn.Sequential(nn.Conv2d(2, 3, 2), nn.PReLU(3)), (2, 4, 4)),
    "PReLU called twice": (lambda: nn.Sequential(nn.Linear(4, 5), Twice(nn.PReLU(5))), (4,)),
}


@pytest.mark.parametrize("name", list(CONVOLUTIONS))
@pytest.mark.parametrize("clip_norm", [1e-3, 1e3])  # every example clipped; none
def test_the_layer_is_exact_against_the_per_example_loop(name, clip_norm):
    build, shape = CONVOLUTIONS[name]
    torch.manual_seed(0)
    model = classifier(build())
    x, y = torch.randn(5, *shape), torch.arange(5) % 3
    model(x)  # the lazy head
    assert_engine_is_the_per_example_loop(model, losses, x, y, clip_norm)
    clipper = PerExampleClipper(model, clip_norm)
    assert clipper.per_example_path == []  # native rules only
    clipper.close()


class SharedSlope(nn.Module):
    """Two PReLUs with one slope parameter, which is also a Linear's bias."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.first, self.second = nn.PReLU(4), nn.PReLU(4)
        self.second.weight = self.first.weight = self.linear.bias

    def forward(self, x):
        return self.second(self.linear(self.first(x)))


def test_a_slope_shared_by_two_prelus_and_a_bias_is_exact():
    torch.manual_seed(1)
    model = classifier(SharedSlope())
    x, y = torch.randn(6, 4), torch.arange(6) % 3
    model(x)
    assert_engine_is_the_per_example_loop(model, losses, x, y, 0.05)


class Bags(nn.Module):
    """Bags from a [B, L] id matrix (-1: no entry): a 2-D input, or 1-D ids with offsets."""

    def __init__(self, offsets: bool, last_offset: bool = False, weighted: bool = False,
                 **settings):
        super().__init__()
        self.offsets, self.last_offset, self.weighted = offsets, last_offset, weighted
        self.bag = nn.EmbeddingBag(12, 4, include_last_offset=last_offset, **settings)
        self.head = nn.Linear(4, 3)

    def forward(self, ids):
        weights = (ids.double() + 1) / 7 if self.weighted else None
        if not self.offsets:
            return self.head(self.bag(ids.clamp(min=0), per_sample_weights=weights))
        present = ids >= 0
        counts = present.sum(1)
        starts = torch.cat([counts.new_zeros(1), counts.cumsum(0)[:-1]])
        offsets = torch.cat([starts, counts.sum(0, keepdim=True)]) if self.last_offset \
            else starts
        flat_weights = None if weights is None else weights[present]
        return self.head(self.bag(ids[present], offsets, per_sample_weights=flat_weights))


BAGS = {
    "2-D mean": {"offsets": False, "mode": "mean"},
    "2-D sum, per-sample weights": {"offsets": False, "mode": "sum", "weighted": True},
    "offsets, mean, padding_idx": {"offsets": True, "mode": "mean", "padding_idx": 2},
    "offsets, sum, last offset, weights": {"offsets": True, "mode": "sum", "last_offset": True,
                                           "weighted": True},
}


@pytest.mark.parametrize("name", list(BAGS))
@pytest.mark.parametrize("clip_norm", [1e-3, 1e3])
def test_an_embedding_bag_is_exact(name, clip_norm):
    torch.manual_seed(2)
    model = Bags(**BAGS[name])
    ids = torch.randint(0, 12, (6, 5))
    ids[1, 3:] = -1  # shorter bags, an empty one
    ids[4] = -1
    ids[2, :3] = 2  # padding_idx, where set
    y = torch.arange(6) % 3
    if not BAGS[name]["offsets"]:
        ids = ids.clamp(min=0)
    assert_engine_is_the_per_example_loop(model, losses, ids, y, clip_norm)
    assert PerExampleClipper(model, clip_norm).per_example_path == []


def test_an_embedding_bag_in_mode_max_takes_the_per_example_path():
    torch.manual_seed(3)
    model = Bags(offsets=False, mode="max")
    ids, y = torch.randint(0, 12, (6, 5)), torch.arange(6) % 3
    assert_engine_is_the_per_example_loop(model, losses, ids, y, 0.05)
    assert PerExampleClipper(model, 1.0).per_example_path == ["bag"]


def test_an_embedding_bag_with_max_norm_is_refused_by_name():
    with pytest.raises(UnsupportedLayerError, match=r"module 'bag' \(EmbeddingBag\).*max_norm"):
        PerExampleClipper(Bags(offsets=False, mode="sum", max_norm=1.0), 1.0)


@pytest.mark.parametrize("layer", [
    lambda: nn.ConvTranspose2d(2, 3, 3, stride=2), lambda: nn.Conv3d(2, 3, 2),
])
def test_leave_one_out_stays_within_the_clip_norm(layer):
    torch.manual_seed(4)
    model = classifier(layer(), nn.PReLU())
    x = torch.randn(5, 2, 3, 3) if isinstance(model[0], nn.ConvTranspose2d) \
        else torch.randn(5, 2, 3, 3, 3)
    y = torch.arange(5) % 3
    model(x)
    contributions = leave_one_out(model, lambda rows: losses(model, x[rows], y[rows]), 5, 0.01)
    assert max(contributions) <= 1 + 1e-9
