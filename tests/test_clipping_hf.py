"""The clipping engine on a real Hugging Face BERT (tiny, random init, float64)."""

import pytest
import torch
import torch.nn.functional as F

from raydp_train.privacy.clipping import BatchDimensionError, PerExampleClipper

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


def test_bert_clipped_sum_matches_naive_loop():
    model = tiny_bert()
    ids, labels = torch.randint(0, 40, (BATCH, TOKENS)), torch.randint(0, 2, (BATCH,))
    params = [p for p in model.parameters() if p.requires_grad]
    per_example = []
    for i in range(BATCH):
        grads = torch.autograd.grad(
            losses(model, ids[i : i + 1], labels[i : i + 1]).sum(), params, allow_unused=True
        )
        per_example.append(
            torch.cat([(torch.zeros_like(p) if g is None else g).flatten()
                       for p, g in zip(params, grads)])
        )
    per_example = torch.stack(per_example)
    norms = per_example.norm(dim=1)
    clip_norm = norms.median().item()
    expected = (per_example * (clip_norm / norms.clamp(min=clip_norm)).unsqueeze(1)).sum(0)

    clipper = PerExampleClipper(model, clip_norm)
    stats = clipper.accumulate(losses, model, ids, labels)
    by_param = {id(p): p.grad.flatten() for p in clipper.parameters}
    got = torch.cat([by_param[id(p)] for p in params])
    torch.testing.assert_close(stats.norms, norms, rtol=1e-7, atol=1e-10)
    assert torch.linalg.norm(got - expected) / torch.linalg.norm(expected) < 1e-5


def test_bert_with_broadcast_position_ids_is_refused():
    model = tiny_bert()
    ids, labels = torch.randint(0, 40, (BATCH, TOKENS)), torch.randint(0, 2, (BATCH,))
    clipper = PerExampleClipper(model, 1.0)
    with pytest.raises(BatchDimensionError, match="position_embeddings"):
        clipper.accumulate(losses, model, ids, labels, False)
