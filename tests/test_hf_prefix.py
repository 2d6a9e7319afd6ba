"""training.cache_frozen_prefix: the frozen bottom of a transformer computed once per example
gives exactly the losses, norms and clipped sums of running it (in eval mode), in float64."""

import pytest
import torch
from oracles import engine_sum_in_parameter_order
from test_clipping_hf import ARCHITECTURES  # tiny BERT, RoBERTa, DistilBERT, GPT-2

from raydp_train.config.pipeline import HFModel, pipeline_from_dict
from raydp_train.data.sources import Dataset
from raydp_train.data.targets import LABEL_KINDS
from raydp_train.models.hf import build_hf_model
from raydp_train.models.hf_prefix import FrozenPrefix, PrefixCacheError, cached_prefix_loss
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.train.context import LocalContext
from raydp_train.train.evaluation import accuracy, held_out_sums
from raydp_train.train.plan import make_plan
from raydp_train.train.step import cross_entropy_loss
from raydp_train.train.worker import train

pytest.importorskip("transformers", reason="transformers is a runtime dependency")
DROPOUT = {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}  # BERT, RoBERTa
THREE_LAYERS = {"bert": {"num_hidden_layers": 3, **DROPOUT},
                "roberta": {"num_hidden_layers": 3, **DROPOUT},
                "distilbert": {"n_layers": 3, "dropout": 0.1, "attention_dropout": 0.1}}
HEAD = {"bert": ["classifier.*"], "roberta": ["classifier.*"], "distilbert": ["classifier.*"]}


def classifier(kind="bert", **model):
    torch.manual_seed(0)
    config = {**ARCHITECTURES[kind], **THREE_LAYERS.get(kind, {})}
    return build_hf_model(HFModel(kind="hf", config=config, num_labels=2, **model), 2).double()


def tokens_and_labels(pad_id: int):
    tokens = torch.randint(2, 40, (6, 2, 9))
    tokens[:, 1] = 1
    tokens[3, 1, 5:], tokens[3, 0, 5:] = 0, pad_id  # one example padded
    return tokens, torch.randint(0, 2, (6,))


TRAINABLE = {"top-layer": {"last_k_layers": 1}, "head-only": "head",
             "every-layer": ["*.layer.*", "classifier.*"]}


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("trainable", list(TRAINABLE))
@pytest.mark.parametrize("kind", ["bert", "roberta", "distilbert"])
def test_cached_prefix_gives_the_same_clipped_sum_as_running_it(kind, trainable, pooling):
    chosen = HEAD[kind] if TRAINABLE[trainable] == "head" else TRAINABLE[trainable]
    model = classifier(kind, pooling=pooling, trainable=chosen)
    tokens, labels = tokens_and_labels(model.model.config.pad_token_id or 0)
    prefix = FrozenPrefix(model)
    assert prefix.first_trained == {"top-layer": 2, "head-only": 3, "every-layer": 0}[trainable]
    cached = prefix.outputs(model, tokens)
    assert cached.shape == (6, 9, 16)
    # The reference: the whole model in training mode (dropout on in the trained layers), the
    # prefix in eval mode, as the cache computed it; the same seed draws the same dropout.
    model.train()
    for module in [prefix.embeddings, *prefix.layers[:prefix.first_trained]]:
        module.eval()
    clipper = PerExampleClipper(model, 0.5)
    torch.manual_seed(1)
    uncached = clipper.accumulate(cross_entropy_loss, model, tokens, labels)
    expected = engine_sum_in_parameter_order(model, clipper).clone()
    clipper.zero_grad()
    torch.manual_seed(1)
    got = clipper.accumulate(cached_prefix_loss(prefix), model, (tokens, cached), labels)
    torch.testing.assert_close(got.losses, uncached.losses, rtol=1e-12, atol=0)
    torch.testing.assert_close(got.norms, uncached.norms, rtol=1e-12, atol=0)
    torch.testing.assert_close(engine_sum_in_parameter_order(model, clipper), expected,
                               rtol=1e-12, atol=1e-15)
    assert expected.abs().sum() > 0
    assert list(prefix.layer_list) == prefix.layers  # the model is whole again


@pytest.mark.parametrize(("model", "expected"), [
    ({"trainable": "all"}, ("training.cache_frozen_prefix: the prefix is not frozen: the "
                           "embeddings train")),
    ({"kind": "gpt2", "trainable": ["score.*"]},
     "training.cache_frozen_prefix: cannot split GPT2Model"),
])
def test_a_prefix_that_cannot_be_cached_is_refused(model, expected):
    with pytest.raises(PrefixCacheError) as caught:
        FrozenPrefix(classifier(**model))
    assert str(caught.value).startswith(expected)
    with pytest.raises(PrefixCacheError, match="needs model.kind hf"):
        FrozenPrefix(torch.nn.Linear(2, 2))


@pytest.mark.thorough
def test_a_run_with_the_cache_trains_the_same_model():
    """worker.train with and without the cache, seeded, dropout off: the same steps."""
    config = {**ARCHITECTURES["bert"], "num_hidden_layers": 3}
    pipeline = pipeline_from_dict({
        "name": "prefix", "data": {"source": "parquet", "path": "unused", "text_column": "t"},
        "model": {"kind": "hf", "config": config, "num_labels": 2,
                  "trainable": {"last_k_layers": 1}},
        "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-3},
        "training": {"epochs": 2, "batch_size": 16, "max_physical_batch": 8, "lr": 0.05},
        "run": {"seed": 4}})
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, 40, (80, 2, 8), generator=generator)
    tokens[:, 1] = (torch.arange(8) < torch.randint(3, 9, (80, 1), generator=generator)).long()
    labels = torch.randint(0, 2, (80,), generator=generator)
    dataset = Dataset(tokens[:64], labels[:64], tokens[64:72], labels[64:72], 2,
                      tokens[72:], labels[72:])
    plan = make_plan(pipeline, 64)
    runs = [train(pipeline_from_dict({**pipeline.model_dump(), "training": {
        **pipeline.training.model_dump(), "cache_frozen_prefix": cache}}), plan,
        LocalContext(on_epoch=lambda row: None), dataset=dataset) for cache in (False, True)]
    for plain, cached in zip(*(run.model.state_dict().values() for run in runs), strict=True):
        torch.testing.assert_close(cached, plain, rtol=1e-5, atol=1e-6)
    losses = [[row["train_loss"] for row in run.metrics] for run in runs]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    scores = [[(row["test_accuracy"], row["validation_accuracy"]) for row in run.metrics]
              for run in runs]
    assert scores[1] == scores[0]


@pytest.mark.parametrize("trainable", ["top-layer", "head-only"])
def test_scoring_from_the_cached_prefix_predicts_what_the_whole_model_predicts(trainable):
    model = classifier(trainable=HEAD["bert"] if trainable == "head-only" else TRAINABLE[trainable])
    with torch.no_grad():  # a head that tells the examples apart (its init may be zeros)
        for name, parameter in model.named_parameters():
            if "classifier" in name:
                parameter.normal_(0.0, 3.0, generator=torch.Generator().manual_seed(2))
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(2, 40, (300, 2, 9), generator=generator)
    tokens[:, 1] = (torch.arange(9) < torch.randint(2, 10, (300, 1), generator=generator)).long()
    model.eval()
    with torch.no_grad():
        own_predictions = model(tokens).argmax(1)
    assert 0 < own_predictions.sum() < 300  # both classes, so a row mix-up shows
    prefix = FrozenPrefix(model)
    hidden = prefix.outputs(model, tokens)
    assert accuracy(model, tokens, own_predictions) == 1.0
    rows = len(own_predictions)
    classes = LABEL_KINDS["class"]
    assert held_out_sums(model, (tokens, hidden), own_predictions, classes, prefix) == [rows,
                                                                                       rows]
    assert held_out_sums(model, (tokens, hidden.flip(0)), own_predictions, classes,
                         prefix)[0] < rows
