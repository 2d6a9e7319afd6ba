"""Frozen weights kept in bf16 or fp16 (`model.frozen_dtype`, models/frozen_precision.py): half
their memory, what trains untouched, the clipping engine exact for the function the model then
computes, and DP-LoRA's merged release in the trained dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from oracles import assert_engine_is_the_per_example_loop
from torch import nn

from raydp_train.config.pipeline import PipelineError, load_pipeline
from raydp_train.models.frozen_precision import keep_frozen_in
from raydp_train.privacy.lora import LoraLinear, merged

PIPELINES = Path(__file__).resolve().parents[1] / "pipelines"


def losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


class Tagger(nn.Module):
    """A frozen embedding, projection and norm under a trained norm and head."""

    def __init__(self):
        super().__init__()
        self.embed, self.project = nn.Embedding(20, 8), nn.Linear(8, 8)
        self.frozen_norm, self.norm, self.head = nn.LayerNorm(8), nn.LayerNorm(8), nn.Linear(8, 3)
        for layer in (self.embed, self.project, self.frozen_norm):
            layer.requires_grad_(False)

    def forward(self, ids):
        h = self.frozen_norm(torch.tanh(self.project(self.embed(ids))))
        return self.head(self.norm(h).mean(1))


@pytest.mark.parametrize("frozen_dtype", ["bf16", "fp16"])
def test_frozen_weights_take_the_dtype_and_what_trains_keeps_its_own(frozen_dtype):
    torch.manual_seed(0)
    model = Tagger().double()
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert keep_frozen_in(model, frozen_dtype) == frozen * 6  # 8 bytes each, now 2
    for name, param in model.named_parameters():
        expected = torch.float64 if param.requires_grad else (
            torch.bfloat16 if frozen_dtype == "bf16" else torch.float16)
        assert param.dtype == expected, name
    ids = torch.randint(0, 20, (4, 5))
    assert model(ids).dtype == torch.float64  # every trained layer reads its own dtype


def test_the_engine_is_exact_for_the_model_with_a_bf16_base():
    """Against the per-example loop on the same model (float64 where it trains, relative
    1e-9): the frozen part computes in bf16 on both sides."""
    torch.manual_seed(1)
    model = Tagger().double()
    keep_frozen_in(model, "bf16")
    ids, y = torch.randint(0, 20, (6, 5)), torch.arange(6) % 3
    assert_engine_is_the_per_example_loop(model, losses, ids, y, 0.05)


def test_lora_on_a_bf16_base_is_exact_and_releases_a_full_precision_merge():
    torch.manual_seed(2)
    base = nn.Linear(8, 8)
    adapted = LoraLinear(base, rank=2, alpha=4.0, generator=torch.Generator().manual_seed(0))
    model = nn.Sequential(nn.Embedding(20, 8).requires_grad_(False), adapted, nn.Tanh(),
                          nn.Flatten(), nn.Linear(40, 3)).double()
    keep_frozen_in(model, "bf16")
    assert adapted.base_layer.weight.dtype == torch.bfloat16
    with torch.no_grad():
        adapted.lora_B.normal_(0, 1e-3)  # an update far below bf16's resolution of W
    ids, y = torch.randint(0, 20, (5, 5)), torch.arange(5) % 3
    assert_engine_is_the_per_example_loop(model, losses, ids, y, 0.05)
    released = merged(model)
    layer = released[1]
    assert isinstance(layer, nn.Linear) and layer.weight.dtype == torch.float64
    torch.testing.assert_close(layer.weight, adapted.merged_weight().detach())
    torch.testing.assert_close(released(ids), model(ids))


def test_a_rebuilt_release_computes_as_the_run_did():
    """predict's model (full precision, loaded from model.pt) takes back the saved bf16
    weights and their hooks: the same outputs, bit for bit."""
    from raydp_train.models.frozen_precision import keep_as_saved

    torch.manual_seed(3)
    model = Tagger()
    keep_frozen_in(model, "bf16")
    state = model.state_dict()
    rebuilt = Tagger()
    rebuilt.load_state_dict(state)
    keep_as_saved(rebuilt, state)
    assert rebuilt.embed.weight.dtype == torch.bfloat16 and rebuilt.head.weight.dtype == torch.float32
    ids = torch.randint(0, 20, (4, 5))
    assert torch.equal(rebuilt(ids), model(ids))


def test_the_frozen_dtype_is_read_and_an_unknown_one_refused_naming_the_field():
    pipeline = PIPELINES / "digits_custom_model.yaml"
    assert load_pipeline(pipeline, ["model.frozen_dtype=bf16"]).model.frozen_dtype == "bf16"
    with pytest.raises(PipelineError, match=r"model\.frozen_dtype: must be one of 'fp32', "
                                            r"'bf16', 'fp16', got 'int8'"):
        load_pipeline(pipeline, ["model.frozen_dtype=int8"])
