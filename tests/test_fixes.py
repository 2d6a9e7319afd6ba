"""`model.fix` / `raydp_train.fix(model)`: what batch statistics would make non-private is
replaced by what normalizes each example by itself, one line per module; the fixed model is
exact against the per-example loop, and the BatchNorm refusal names the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracles import assert_engine_is_the_per_example_loop
from torch import nn

import raydp_train as rt
from raydp_train.commands.cli import main
from raydp_train.privacy.clipping import PerExampleClipper, UnsupportedLayerError


def _convnet():
    return nn.Sequential(nn.Conv2d(1, 6, 3), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.Conv2d(6, 4, 3), nn.InstanceNorm2d(4, affine=True,
                                                               track_running_stats=True),
                         nn.Flatten(), nn.Linear(16, 3), nn.BatchNorm1d(3))


def losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


@pytest.mark.usefixtures("float64")
def test_fix_replaces_batch_statistics_and_the_model_is_then_exact():
    torch.manual_seed(0)
    model = _convnet()
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)
    scale = model[1].weight.detach().clone()
    with pytest.raises(UnsupportedLayerError, match=r"module '1' \(BatchNorm2d\).*model.fix"):
        PerExampleClipper(model, 1.0)
    changes = rt.fix(model)
    assert changes == [
        "model.fix: module '1' (BatchNorm2d) -> GroupNorm(3, 6)",
        "model.fix: module '4' (InstanceNorm2d) -> InstanceNorm2d without running statistics",
        "model.fix: module '7' (BatchNorm1d) -> GroupNorm(1, 3)",
    ]
    assert isinstance(model[1], nn.GroupNorm) and torch.equal(model[1].weight, scale)
    assert model[1].weight.dtype == torch.float64
    assert rt.fix(model) == []  # nothing left to fix
    x, y = torch.randn(6, 1, 6, 6), torch.arange(6) % 3
    assert_engine_is_the_per_example_loop(model, losses, x, y, 0.05)


FIXABLE = """\
from torch import nn

def with_batchnorm():
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(72, 10))
"""


def test_a_pipeline_with_model_fix_validates_and_says_what_it_changed(tmp_path, capsys):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "user_models.py").write_text(FIXABLE)
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(
        "name: fixed\ndata: {source: sklearn_digits}\n"
        "model: {kind: torch, factory: models/user_models.py:with_batchnorm, fix: true}\n"
        "privacy: {noise_multiplier: 1.0, clip_norm: 1.0, delta: 1e-5}\n"
        "training: {epochs: 1, batch_size: 64}\n")
    assert main(["validate", str(pipeline), "--check-model"]) == 0
    err = capsys.readouterr().err
    assert "model.fix: module '1' (BatchNorm2d) -> GroupNorm(1, 2)" in err
    pipeline.write_text(pipeline.read_text().replace(", fix: true", ""))
    assert main(["validate", str(pipeline), "--check-model"]) == 2
    assert "model.fix" in capsys.readouterr().err
