"""model.dropout: one probability for every dropout of a Hugging Face model, whatever its
architecture calls it, or the checkpoint's own where it is null."""

from pathlib import Path

import pytest
import torch
from test_clipping_hf import ARCHITECTURES  # tiny BERT, RoBERTa, DistilBERT, GPT-2

from raydp_train.config.pipeline import HFModel, PipelineError, load_pipeline
from raydp_train.models.hf import build_hf_model

pytest.importorskip("transformers", reason="transformers is a runtime dependency")
ROOT = Path(__file__).resolve().parents[1]
# Each architecture's own names for its dropout probabilities, all set to 0.3 here.
DROPOUT_KEYS = {
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "roberta": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "distilbert": ("dropout", "attention_dropout", "seq_classif_dropout"),
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
}


def classifier(kind: str, dropout: float | None):
    config = {**ARCHITECTURES[kind], **dict.fromkeys(DROPOUT_KEYS[kind], 0.3)}
    return build_hf_model(HFModel(kind="hf", config=config, num_labels=2, dropout=dropout), 2)


def tokens(pad_id: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 40, (4, 10), generator=generator)
    return torch.stack([ids, torch.ones_like(ids)], dim=1)


def dropout_probabilities(model) -> set[float]:
    return {m.p for m in model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)}


@pytest.mark.parametrize("kind", sorted(DROPOUT_KEYS))
def test_dropout_zero_turns_off_every_dropout_and_training_mode_is_deterministic(kind):
    model = classifier(kind, 0.0).train()
    config = model.model.config
    assert {getattr(config, key) for key in DROPOUT_KEYS[kind]} == {0.0}
    assert dropout_probabilities(model) == {0.0}
    batch = tokens()
    assert torch.equal(model(batch), model(batch))


@pytest.mark.parametrize("kind", sorted(DROPOUT_KEYS))
def test_null_keeps_the_checkpoints_dropout_and_a_number_replaces_it(kind):
    kept = classifier(kind, None).train()
    assert {getattr(kept.model.config, key) for key in DROPOUT_KEYS[kind]} == {0.3}
    assert 0.3 in dropout_probabilities(kept)
    batch = tokens()
    torch.manual_seed(1)
    assert not torch.equal(kept(batch), kept(batch))  # dropout draws differ between calls
    replaced = classifier(kind, 0.25)
    assert {getattr(replaced.model.config, key) for key in DROPOUT_KEYS[kind]} == {0.25}
    assert dropout_probabilities(replaced) == {0.25}


def test_pretrained_minilm_loads_the_same_weights_with_dropout_off():
    pipeline = load_pipeline(ROOT / "pipelines" / "sst2_minilm_dpsgd.yaml")
    torch.manual_seed(0)
    default = build_hf_model(pipeline.model.model_copy(update={"dropout": None}), 2)
    torch.manual_seed(0)
    off = build_hf_model(pipeline.model.model_copy(update={"dropout": 0.0}), 2)
    assert default.model.config.hidden_dropout_prob == 0.1  # the checkpoint's
    assert off.model.config.attention_probs_dropout_prob == 0.0
    assert dropout_probabilities(off) == {0.0}
    default_weights, off_weights = default.state_dict(), off.state_dict()
    assert default_weights.keys() == off_weights.keys()
    assert all(torch.equal(default_weights[k], off_weights[k]) for k in default_weights)
    batch = tokens()
    assert torch.equal(default.eval()(batch), off.eval()(batch))  # eval: dropout plays no part


@pytest.mark.parametrize("value", ["1", "-0.1", "high"])
def test_a_probability_outside_0_to_1_names_the_field(value):
    with pytest.raises(PipelineError, match=r"model\.dropout"):
        load_pipeline(ROOT / "pipelines" / "sst2_minilm_dpsgd.yaml", [f"model.dropout={value}"])
