"""A first model of a user's own with the layers a first model brings -- a learned scale and a
ViT-style cls token (raw nn.Parameters the root uses, on the per-example path),
nn.MultiheadAttention and nn.LSTM (by their rules) -- given as `model.kind: torch`: its clipped sums equal the per-example loop (float64),
and it trains through a pipeline on 2 Ray Train workers with the engine's self-check on every
step. The shipped ViT and LSTM examples (pipelines/models/) are exact too."""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from oracles import assert_engine_is_the_per_example_loop, naive_clipped_sum

import raydp_train as rt
from raydp_train.commands.cli import main
from raydp_train.models.builders import build_model
from raydp_train.privacy.clipping import PerExampleClipper

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "pipelines" / "models"
SST2_LSTM = ROOT / "pipelines" / "sst2_lstm.yaml"
DIGITS_VIT = ROOT / "pipelines" / "digits_vit.yaml"
SST2 = ROOT.parent / "shared" / "data" / "sst2"

USER_MODEL = '''\
import torch
from torch import nn


class Rows(nn.Module):
    """[B, 1, 8, 8] digits as 8 tokens (rows of 8 pixels) after a cls token, scaled by a
    learned scale, through attention and an LSTM; the last state into the head."""

    def __init__(self, num_classes: int, width: int):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.cls_token = nn.Parameter(0.1 * torch.randn(1, 1, width))
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.lstm = nn.LSTM(width, width, batch_first=True)
        self.head = nn.Linear(width, num_classes)

    def forward(self, images):
        rows = self.embed(images.flatten(1, 2))
        tokens = torch.cat([self.cls_token.expand(rows.shape[0], -1, -1), rows], 1)
        tokens = tokens * self.scale
        tokens = tokens + self.attention(tokens, tokens, tokens, need_weights=False)[0]
        states, _ = self.lstm(tokens)
        return self.head(states[:, -1])


def rows(num_classes, width=8):
    return Rows(num_classes, width)
'''

PIPELINE = """\
name: own-layers
data: {source: sklearn_digits}
model:
  kind: torch
  factory: layers.py:rows
  kwargs: {width: 8}
privacy:
  clip_norm: 1.0
  noise_multiplier: 1.0
  self_check: {step_fraction: 1.0}   # every step, not a random 1%
training: {epochs: 1, batch_size: 256, optimizer: adam, lr: 0.01, workers: 2}
"""


def losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


def _user_model(tmp_path: Path, **kwargs) -> torch.nn.Module:
    (tmp_path / "layers.py").write_text(USER_MODEL)
    (tmp_path / "p.yaml").write_text(PIPELINE)
    pipeline = rt.Pipeline.from_yaml(tmp_path / "p.yaml")
    pipeline.model.kwargs.update(kwargs)
    return build_model(pipeline.model, (1, 8, 8), 10)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("clip_norm", [1e-3, 1e3])  # every example clipped; none
def test_the_user_models_clipped_sum_is_the_per_example_loops(tmp_path, clip_norm):
    torch.manual_seed(0)
    model = _user_model(tmp_path)
    names = {type(m).__name__ for m in model.modules()}
    assert {"MultiheadAttention", "Linear", "LSTM"} <= names
    inputs, labels = torch.rand(6, 1, 8, 8), torch.arange(6)
    assert_engine_is_the_per_example_loop(model, losses, inputs, labels, clip_norm)


def test_a_float32_lstm_on_onednns_kernel_is_clipped_as_the_loop(tmp_path):
    """float32 nn.LSTM on a CPU runs oneDNN's kernel (once refused: its forward under no_grad
    keeps no workspace for the backward)."""
    torch.manual_seed(0)
    model = _user_model(tmp_path)
    inputs, labels = torch.rand(6, 1, 8, 8), torch.arange(6)
    expected, _, _ = naive_clipped_sum(model, losses, inputs, labels, 1.0)
    clipper = PerExampleClipper(model, 1.0)
    clipper.accumulate(losses, model, inputs, labels)
    torch.testing.assert_close(clipper.flat_grad.norm(), expected.norm(), rtol=1e-4, atol=0)


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("factory", ["vit", "hf_vit"])
def test_the_shipped_vits_clipped_sums_are_the_per_example_loops(factory):
    sys.path.insert(0, str(EXAMPLES))
    import vit

    torch.manual_seed(0)
    model = getattr(vit, factory)((1, 8, 8), 10, width=8, depth=1, heads=2, mlp_width=16)
    inputs, labels = torch.rand(5, 1, 8, 8), torch.arange(5)
    for clip_norm in (1e-3, 1e3):
        assert_engine_is_the_per_example_loop(model, losses, inputs, labels, clip_norm)


@pytest.mark.usefixtures("float64")
def test_the_shipped_lstm_classifiers_clipped_sum_is_the_per_example_loops():
    sys.path.insert(0, str(EXAMPLES))
    import lstm

    torch.manual_seed(0)
    model = lstm.LstmClassifier(torch.randn(50, 12), hidden=6, num_classes=2, freeze=True)
    ids = torch.randint(1, 50, (5, 9))
    mask = (torch.arange(9) < torch.tensor([[9], [6], [3], [7], [1]])).long()
    inputs, labels = torch.stack([ids * mask, mask], 1).int(), torch.arange(5) % 2
    for clip_norm in (1e-3, 1e3):
        assert_engine_is_the_per_example_loop(model, losses, inputs, labels, clip_norm)


# make test: test_the_user_models_clipped_sum_is_the_per_example_loops, test_custom_model.py's
# run on 2 workers, test_per_example_path.py's self-check on every step
@pytest.mark.long
def test_the_user_model_trains_on_two_workers_with_the_self_check_on(ray_session, tmp_path):
    (tmp_path / "layers.py").write_text(USER_MODEL)
    (tmp_path / "p.yaml").write_text(PIPELINE + f"run: {{output_dir: {tmp_path / 'runs'}}}\n")
    result = rt.run(rt.Pipeline.from_yaml(tmp_path / "p.yaml"), on_line=None, on_epoch=None,
                    on_progress=None)
    assert result.status == "completed"
    training = json.loads(result.record.read_text())["training"]
    assert len(training["training_rows_per_worker"]) == 2
    steps = result.privacy["steps"]
    # every step of every worker checked the engine against one backward pass per example
    assert [c["checks"] for c in training["engine_self_checks_per_worker"]] == [steps, steps]
    # the raw parameters on the per-example path; attention and the LSTM by their rules
    assert training["per_example_path_modules"] == ["<root>"]
    assert rt.load_model(result.run_dir)(torch.zeros(1, 1, 8, 8)).shape == (1, 10)


@pytest.mark.thorough
@pytest.mark.skipif(not SST2.is_dir(), reason=f"SST-2 is not at {SST2} (shared data absent)")
def test_text_reaches_a_torch_model_through_its_tokenizer(tmp_path, capsys):
    """validate --check-model builds the LSTM example on token ids of its tokenizer and runs
    the self-check on them; without model.tokenizer, text is refused in one line."""
    assert main(["validate", str(SST2_LSTM), "--check-model"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["validate", str(SST2_LSTM), "--set", "model.tokenizer=null"]) == 2
    error = capsys.readouterr().err
    assert "data.text_column: text needs a tokenizer" in error and "model.tokenizer" in error
    assert main(["validate", str(SST2_LSTM), "--set", "model.tokenizer=package:no_such/x"]) == 2
    assert "model.tokenizer: package 'no_such' is not installed" in capsys.readouterr().err


@pytest.mark.thorough
@pytest.mark.parametrize("factory", ["vit", "hf_vit"])
def test_the_vit_example_validates_with_either_factory(factory, capsys):
    """Its model built and self-checked in training mode, before anything is spent."""
    assert main(["validate", str(DIGITS_VIT), "--check-model",
                 "--set", f"model.factory={EXAMPLES / 'vit.py'}:{factory}"]) == 0, \
        capsys.readouterr().err
