"""A causal LM run on two Ray Train workers: held-out loss and perplexity summed over both
workers' shards, a saved model that transformers reloads alone, and `raydp-train generate`
sampling from it."""

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from text_files import MINILM, run_pipeline

from raydp_train.commands.cli import main
from raydp_train.commands.generate import continuations
from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.data.sources import load_data
from raydp_train.models.hf_causal import CausalLM, token_loss_sum
from raydp_train.models.hf_files import resolve_name_or_path

transformers = pytest.importorskip("transformers", reason="transformers is a runtime dependency")

# MiniLM's BERT tokenizer has 30,522 ids.
TINY_GPT2 = {"model_type": "gpt2", "vocab_size": 30522, "n_embd": 16, "n_layer": 1, "n_head": 2,
             "n_positions": 32, "bos_token_id": 101, "eos_token_id": 102}


def _sentences(path, rows: int) -> None:
    words = ["good", "dull", "bright", "slow"]
    pq.write_table(pa.table({"sentence": [f"a {words[i % 4]} film number {i}"
                                          for i in range(rows)]}), path)


# make test: test_causal_lm.py (the loss, its clipping, perplexity), test_hf.py's run on 2
# workers
@pytest.mark.long
@pytest.mark.slow
def test_two_workers_train_save_and_generate(ray_session, tmp_path, capsys):
    _sentences(tmp_path / "train.parquet", 80)
    _sentences(tmp_path / "test.parquet", 30)
    pipeline = {
        "name": "tiny-gpt2-causal",
        "data": {"source": "parquet", "path": str(tmp_path / "train.parquet"),
                 "test_path": str(tmp_path / "test.parquet"), "text_column": "sentence",
                 "max_length": 12},
        "model": {"kind": "hf", "name_or_path": MINILM, "config": TINY_GPT2,
                  "task": "causal_lm", "lm_loss": "mean"},
        "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-4},
        "training": {"epochs": 1, "batch_size": 20, "workers": 2, "optimizer": "adam",
                     "lr": 0.01, "threads_per_worker": 1},
        "run": {"output_dir": str(tmp_path / "runs"), "seed": 0},
    }
    run_dir, record = run_pipeline(tmp_path, pipeline)
    assert sum(record["training"]["training_rows_per_worker"]) == 80
    assert record["training"]["threads_per_worker"] == [1, 1]  # as the pipeline set it
    last = record["metrics"][-1]
    assert "test_accuracy" not in last
    assert last["test_perplexity"] == pytest.approx(math.exp(last["test_loss"]))
    assert "test ppl" in capsys.readouterr().out

    # The saved model, reloaded by transformers alone, scores the whole test file as the two
    # workers' summed shards did.
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "model")
    parsed = pipeline_from_dict(pipeline)
    test = load_data(parsed.data, parsed.model.num_classes, tokenizer=resolve_name_or_path(MINILM))
    total, count = token_loss_sum(CausalLM(reloaded), torch.as_tensor(test.test_features))
    assert last["test_loss"] == pytest.approx(total / count, rel=1e-5)

    texts = continuations(run_dir, "a good", samples=2, max_new_tokens=4, seed=0)
    assert len(texts) == 2 and all(text.startswith("a good") for text in texts)
    assert main(["generate", str(run_dir), "--prompt", "a dull", "--samples", "2",
                 "--max-new-tokens", "3", "--seed", "1"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and all(line.startswith("a dull") for line in printed)
    assert main(["report", str(run_dir)]) == 0
    assert "test_perplexity" in capsys.readouterr().out
    assert (run_dir / "perplexity_vs_epoch.png").is_file()


def test_generate_without_a_saved_model_says_so(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "a"]) == 2
    assert "no saved model at" in capsys.readouterr().err
