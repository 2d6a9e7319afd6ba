"""The clipping engine on real Hugging Face transformers (tiny, random init, float64):
BERT, RoBERTa, DistilBERT and GPT-2 against a naive per-example loop, padding included."""

import pytest
import torch
import torch.nn.functional as F
from oracles import (
    assert_engine_is_the_per_example_loop,
    engine_sum_in_parameter_order,
    naive_clipped_sum,
)

from raydp_train.privacy.clipping import PerExampleClipper

transformers = pytest.importorskip("transformers", reason="transformers is a runtime dependency")

BATCH, TOKENS = 5, 7


def tiny_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = transformers.BertForSequenceClassification(config).double()
    return model


def losses(model, ids, labels, per_example_positions=True):
    batch, tokens = ids.shape
    positions = torch.arange(tokens).expand(batch, tokens) if per_example_positions else None
    logits = model(
        input_ids=ids,
        position_ids=positions,
        token_type_ids=torch.zeros_like(ids),
    ).logits
    return F.cross_entropy(logits, labels, reduction="none")


def test_bert_with_broadcast_position_ids_is_exact():
    """position_ids [1, T], broadcast over the batch: each example reads its own copy."""
    torch.manual_seed(0)
    model = tiny_bert()
    ids, labels = torch.randint(0, 40, (BATCH, TOKENS)), torch.randint(0, 2, (BATCH,))
    assert_engine_is_the_per_example_loop(
        model, lambda m, x, y: losses(m, x, y, False), ids, labels, 0.05)


def test_query_key_and_value_share_one_input_gram(monkeypatch):
    """Q, K and V read one tensor: its Gram matrix is formed once per layer and reused."""
    from raydp_train.privacy import layer_rules

    reused, original = [], layer_rules.linear_weight_norm

    def spy(a, g, gram_cache, key):
        reused.append(key is not None and key in gram_cache)
        return original(a, g, gram_cache, key)

    monkeypatch.setattr(layer_rules, "linear_weight_norm", spy)
    model = tiny_bert()
    ids, labels = torch.randint(0, 40, (BATCH, TOKENS)), torch.randint(0, 2, (BATCH,))
    PerExampleClipper(model, 1.0).accumulate(losses, model, ids, labels)
    # Layer 0: K and V reuse Q's Gram. Layer 1 (the last): only the [CLS] query has a
    # gradient, so Q keeps one token and K, V share theirs.
    assert sum(reused) == 3


TINY = {"hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 32,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
ARCHITECTURES = {
    "bert": {"model_type": "bert", "vocab_size": 40, "num_hidden_layers": 2,
             "max_position_embeddings": 16, **TINY},
    "roberta": {"model_type": "roberta", "vocab_size": 40, "num_hidden_layers": 2,
                "max_position_embeddings": 20, "pad_token_id": 1, **TINY},
    "distilbert": {"model_type": "distilbert", "vocab_size": 40, "n_layers": 2, "dim": 16,
                   "n_heads": 2, "hidden_dim": 32, "max_position_embeddings": 16,
                   "dropout": 0.0, "attention_dropout": 0.0, "seq_classif_dropout": 0.0},
    "gpt2": {"model_type": "gpt2", "vocab_size": 40, "n_layer": 2, "n_embd": 16, "n_head": 2,
             "n_positions": 16, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
             "pad_token_id": 0},
}


def _classifier(kind: str):
    from raydp_train.config.pipeline import HFModel
    from raydp_train.models.hf import build_hf_model

    torch.manual_seed(0)
    config = HFModel(kind="hf", config=ARCHITECTURES[kind], num_labels=2)
    return build_hf_model(config, num_labels=2).double()


# Example lengths and T: the last position in use, or padding at the end of every example
# (the engine then drops those positions and every padded row).
LAYOUTS = {"dense-end": ((7, 5, 3, 7, 4), 7), "padded-end": ((6, 5, 3, 2, 4), 9)}


def _padded_tokens(pad_id: int, lengths: tuple, tokens: int) -> torch.Tensor:
    """[B, 2, T]: ids and attention mask, examples of the given lengths padded on the right."""
    ids = torch.randint(2, 40, (BATCH, tokens))
    mask = torch.zeros(BATCH, tokens, dtype=torch.long)
    for i, length in enumerate(lengths):
        mask[i, :length] = 1
    return torch.stack([ids.masked_fill(mask == 0, pad_id), mask], dim=1)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_transformer_clipped_sum_matches_naive_loop_with_padding(kind, layout):
    model = _classifier(kind)
    pad_id = model.model.config.pad_token_id or 0
    tokens, labels = _padded_tokens(pad_id, *LAYOUTS[layout]), torch.randint(0, 2, (BATCH,))

    def example_losses(model, tokens, labels):
        return F.cross_entropy(model(tokens), labels, reduction="none")

    expected, norms, clip_norm = naive_clipped_sum(model, example_losses, tokens, labels)

    clipper = PerExampleClipper(model, clip_norm)
    stats = clipper.accumulate(example_losses, model, tokens, labels)
    got = engine_sum_in_parameter_order(model, clipper)
    torch.testing.assert_close(stats.norms, norms, rtol=1e-7, atol=1e-10)
    assert torch.linalg.norm(got - expected) / torch.linalg.norm(expected) < 1e-5
    if kind == "gpt2":  # its attention and MLP projections are transformers' Conv1D
        assert any(type(m).__name__ == "Conv1D" for m in model.modules())
