"""`model.kind: torch`: a model from the user's own code. The shipped example's
clipped sum equals one backward pass per example (float64, < 1e-9); a factory that cannot be
imported, called or used is refused by name before anything is spent; the example trains on 2
Ray Train workers and spends what dp-accounting says."""

import json
from pathlib import Path

import dp_accounting
import pytest
import torch
import torch.nn.functional as F
from oracles import assert_engine_is_the_per_example_loop

import raydp_train as rt
from raydp_train.commands.cli import main
from raydp_train.data.targets import label_kind
from raydp_train.models.builders import build_model
from raydp_train.models.custom import training_loss

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "pipelines" / "digits_custom_model.yaml"


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize("clip_norm", [1e-3, 1e3])  # every example clipped; none
@pytest.mark.parametrize("loss", ["the file's", "cross-entropy"])
def test_the_example_models_clipped_sum_is_the_per_example_loops(clip_norm, loss):
    torch.manual_seed(0)
    overrides = [] if loss == "the file's" else ["model.loss=null"]
    pipeline = rt.Pipeline.from_yaml(EXAMPLE, overrides=overrides)
    model = build_model(pipeline.model, (1, 8, 8), 10)
    assert isinstance(model[1], torch.nn.GroupNorm)  # the file's model, kwargs applied
    losses = training_loss(pipeline.model, label_kind(pipeline.data))
    inputs, labels = torch.randn(7, 1, 8, 8), torch.arange(7) % 10
    smoothed = F.cross_entropy(model(inputs), labels, reduction="none", label_smoothing=0.1)
    assert torch.equal(losses(model, inputs, labels), smoothed) is (loss == "the file's")
    assert_engine_is_the_per_example_loop(model, losses, inputs, labels, clip_norm)


BAD_FACTORIES = {
    "no file": ("models/missing.py:small_cnn", "file not found"),
    "no function": ("models/digits_cnn.py:big_cnn", "has no function 'big_cnn'"),
    "no module": ("no_such_package.models:build", "cannot import 'no_such_package.models'"),
    "not a module": ("models/user_models.py:not_a_module", "returned dict, not a torch"),
    "wrong classes": ("models/user_models.py:three_classes", "to [B, 10] outputs"),
    "raises": ("models/user_models.py:broken", "raised RuntimeError: my bug"),
    "batchnorm": ("models/user_models.py:with_batchnorm", "BatchNorm2d"),
    # Frozen, a BatchNorm still normalizes each example by its batch in training.
    "frozen batchnorm": ("models/user_models.py:with_frozen_batchnorm",
                         "module '1' (BatchNorm2d) normalizes with statistics of the batch"),
    # Mixes the rows of a batch only in training mode: the preflight runs in training mode.
    "mixes in training": ("models/user_models.py:mixes_in_training",
                          "privacy.self_check: removing one example from the batch"),
}
USER_MODELS = """\
import torch
from torch import nn

def not_a_module():
    return {}

def three_classes():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 3))

def broken():
    raise RuntimeError("my bug")

def with_batchnorm():
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(72, 10))

def with_frozen_batchnorm():
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2).requires_grad_(False),
                         nn.Flatten(), nn.Linear(72, 10))

class Mixup(nn.Module):
    def forward(self, h):
        return 0.5 * h + 0.5 * h.roll(1, 0) if self.training else h

def mixes_in_training():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Tanh(), Mixup(), nn.Linear(16, 10))
"""


@pytest.mark.parametrize("case", list(BAD_FACTORIES))
def test_a_factory_that_cannot_be_used_is_refused_by_name(case, tmp_path, capsys):
    factory, message = BAD_FACTORIES[case]
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "user_models.py").write_text(USER_MODELS)
    (tmp_path / "models" / "digits_cnn.py").write_text(
        (ROOT / "pipelines/models/digits_cnn.py").read_text())
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(EXAMPLE.read_text().replace("models/digits_cnn.py:small_cnn", factory)
                        .replace("kwargs: {channels: 8, groups: 2}", "kwargs: {}"))
    assert main(["validate", str(pipeline), "--check-model"]) == 2
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error
    assert len(error.strip().splitlines()) == 1


BAD_LOSSES = {
    "a mean": ("models/user_models.py:mean_loss",
               "must return one loss per example, shape [B], got [] for B=2"),
    "no function": ("models/user_models.py:nope", "model.loss: {} has no function 'nope'"),
    "no file": ("models/missing.py:loss", "model.loss: file not found"),
}


@pytest.mark.parametrize("case", list(BAD_LOSSES))
def test_a_loss_that_cannot_be_used_is_refused_by_name_before_anything_is_spent(case, tmp_path,
                                                                                capsys):
    loss, message = BAD_LOSSES[case]
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "user_models.py").write_text(
        "import torch.nn.functional as F\n\ndef mean_loss(logits, labels):\n"
        "    return F.cross_entropy(logits, labels)\n")
    (tmp_path / "models" / "digits_cnn.py").write_text(
        (ROOT / "pipelines/models/digits_cnn.py").read_text())
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(EXAMPLE.read_text().replace(
        "models/digits_cnn.py:smoothed_cross_entropy", loss))
    assert main(["validate", str(pipeline), "--check-model"]) == 2
    error = capsys.readouterr().err
    message = message.format(tmp_path / "models" / "user_models.py")
    assert message in error and "Traceback" not in error, error
    assert len(error.strip().splitlines()) == 1


def test_a_run_of_a_model_that_mixes_in_training_is_stopped_before_any_budget(ray_session,
                                                                             tmp_path):
    """The run's preflight (after Ray starts, before the budget is opened) runs the self-check
    in training mode: the run stops with one line and nothing is reserved or written."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "user_models.py").write_text(USER_MODELS)
    pipeline = tmp_path / "p.yaml"
    ledger = tmp_path / "ledger"
    pipeline.write_text(
        EXAMPLE.read_text().replace("models/digits_cnn.py:small_cnn",
                                    "models/user_models.py:mixes_in_training")
        .replace("kwargs: {channels: 8, groups: 2}", "kwargs: {}")
        .replace("  loss: models/digits_cnn.py:smoothed_cross_entropy", "")
        + f"budget: {{name: mixing, epsilon: 10, delta: 1e-5, ledger: {ledger}}}\n"
        + f"run: {{output_dir: {tmp_path / 'runs'}}}\n")
    with pytest.raises(rt.UserError, match="privacy.self_check: removing one example"):
        rt.run(rt.Pipeline.from_yaml(pipeline), on_line=None, on_epoch=None, on_progress=None)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    assert not ledger.exists() or not any(ledger.rglob("*.parquet"))


def test_the_example_trains_on_two_workers_and_spends_what_dp_accounting_says(ray_session,
                                                                               tmp_path):
    pipeline = rt.Pipeline.from_yaml(EXAMPLE, overrides=[
        "training.epochs=2", f"run.output_dir={tmp_path}"])
    result = rt.run(pipeline, on_line=None, on_epoch=None, on_progress=None)
    assert result.status == "completed"
    record = json.loads(result.record.read_text())
    assert len(record["training"]["training_rows_per_worker"]) == 2  # both workers trained
    privacy = result.privacy
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        128 / 1438, dp_accounting.GaussianDpEvent(privacy["noise_multiplier"])),
        int(2 * 1438 / 128))
    expected = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
    assert privacy["steps"] == int(2 * 1438 / 128) and privacy["workers"] == 2
    assert result.epsilon == pytest.approx(expected, rel=1e-9) and result.epsilon <= 3.0
    assert rt.load_model(result.run_dir)(torch.zeros(1, 1, 8, 8)).shape == (1, 10)


BESIDE = {
    "blocks.py": "from torch import nn\n\ndef head(width, classes):\n"
                 "    return nn.Linear(width, classes)\n",
    "shapes.py": "FLAT = 64\n",
    "model.py": "from blocks import head\nfrom torch import nn\n\n"
                "def build(num_classes):\n    from shapes import FLAT  # imported when called\n"
                "    return nn.Sequential(nn.Flatten(), head(FLAT, num_classes))\n",
}


def test_a_factory_file_imports_the_files_beside_it(tmp_path, capsys):
    folder = tmp_path / "my_models"
    folder.mkdir()
    for name, source in BESIDE.items():
        (folder / name).write_text(source)
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(EXAMPLE.read_text().replace("models/digits_cnn.py:small_cnn",
                                                    "my_models/model.py:build")
                        .replace("kwargs: {channels: 8, groups: 2}", "kwargs: {}")
                        .replace("  loss: models/digits_cnn.py:smoothed_cross_entropy", ""))
    assert main(["validate", str(pipeline), "--check-model"]) == 0, capsys.readouterr().err
    model = build_model(rt.Pipeline.from_yaml(pipeline).model, (1, 8, 8), 10)
    assert isinstance(model[1], torch.nn.Linear) and model[1].in_features == 64
