"""nn.LSTM's rule (privacy/lstm_rule.py): each layer's weights as Linear calls over the steps,
exact against the naive per-example loop (float64): one or three layers, with and without
biases, a given initial state, h_n and c_n in the loss, two calls per micro-batch, float32;
leave-one-out within C; LSTMs it does not serve take the per-example path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracles import assert_engine_is_the_per_example_loop, leave_one_out
from torch import nn

from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.lstm_rule import LstmRule

pytestmark = pytest.mark.usefixtures("float64")


def losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


class Sequence(nn.Module):
    """An LSTM read by a head; `how`: a per-example initial state, every output in the loss,
    or the LSTM called twice."""

    def __init__(self, lstm: nn.LSTM, how: str = "plain"):
        super().__init__()
        self.lstm, self.how = lstm, how
        self.head = nn.Linear(lstm.hidden_size, 3)

    def forward(self, x):
        state = None
        if self.how == "initial state":
            h0 = torch.tanh(x[:, :1, :1]).transpose(0, 1).expand(
                self.lstm.num_layers, -1, self.lstm.hidden_size).contiguous()
            state = (h0, 0.5 * h0)
        out, (h, c) = self.lstm(x, state)
        if self.how == "twice":
            out, (h, c) = self.lstm(torch.tanh(out[..., : x.shape[2]]))
        logits = self.head(out[:, -1])
        if self.how == "every output":
            logits = logits + self.head(h[-1] * c[0]) + out.mean(1)[:, :3]
        return logits


CASES = {
    "one layer": (lambda: nn.LSTM(4, 5, batch_first=True), "plain"),
    "three layers, no bias": (lambda: nn.LSTM(4, 5, 3, bias=False, batch_first=True), "plain"),
    "initial state": (lambda: nn.LSTM(4, 5, 2, batch_first=True), "initial state"),
    "every output": (lambda: nn.LSTM(4, 5, 2, batch_first=True), "every output"),
    "twice": (lambda: nn.LSTM(4, 5, batch_first=True), "twice"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("clip_norm", [1e-3, 1e3])  # every example clipped; none
def test_an_lstm_is_exact_against_the_per_example_loop(case, clip_norm):
    build, how = CASES[case]
    torch.manual_seed(0)
    model = Sequence(build(), how)
    x, y = torch.randn(5, 6, 4), torch.arange(5) % 3
    assert_engine_is_the_per_example_loop(model, losses, x, y, clip_norm)
    clipper = PerExampleClipper(model, clip_norm)
    assert clipper.per_example_path == []
    assert isinstance({m: r for _, m, r in clipper.layers}[model.lstm], LstmRule)


def test_in_float32_the_sum_is_the_batch_gradient():
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(1)
    model = Sequence(nn.LSTM(4, 8, 2, batch_first=True))
    x, y = torch.randn(6, 7, 4), torch.arange(6) % 3
    clipper = PerExampleClipper(model, 1e9)
    clipper.accumulate(losses, model, x, y)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    expected = torch.cat([g.flatten() for g in torch.autograd.grad(
        losses(model, x, y).sum(), list(model.parameters()))])
    assert (got - expected).norm() / expected.norm() < 1e-5


def test_leave_one_out_stays_within_the_clip_norm():
    torch.manual_seed(2)
    model = Sequence(nn.LSTM(4, 5, 2, batch_first=True))
    x, y = torch.randn(5, 6, 4), torch.arange(5) % 3
    contributions = leave_one_out(model, lambda rows: losses(model, x[rows], y[rows]), 5, 0.01)
    assert max(contributions) <= 1 + 1e-9


@pytest.mark.parametrize("lstm", [
    lambda: nn.LSTM(4, 5, batch_first=True, bidirectional=True),
    lambda: nn.LSTM(4, 6, batch_first=True, proj_size=5),
    lambda: nn.LSTM(4, 5, 2, batch_first=True, dropout=0.5),
])
def test_an_lstm_the_rule_does_not_serve_takes_the_per_example_path(lstm):
    module = lstm()
    model = nn.ModuleDict({"lstm": module})
    clipper = PerExampleClipper(model.eval(), 1.0)
    assert clipper.per_example_path == ["lstm"]
