"""A DP-LoRA run's `adapter/` loads the standard way: `PeftModel.from_pretrained`
on the checkpoint the pipeline names, with nothing else, is the trained model: its test
accuracy is the run's recorded one. On the real pretrained MiniLM, through `raydp-train run`,
pooling [CLS]; a mean-pooled run's adapter (MiniLM's own pooling) is loaded on its wrapper,
and refused on the [CLS] class, in tests/test_first_hour.py's review run."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from text_files import MINILM, text_pipeline

from raydp_train.commands.cli import main
from raydp_train.models.hf_files import resolve_name_or_path

# Every test here starts processes (Ray, the CLI's embedded Ray or a subprocess).
pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers", reason="transformers is a runtime dependency")
peft = pytest.importorskip("peft", reason="peft is a runtime dependency (DP-LoRA's adapters)")


SETTINGS = ["privacy.mechanism=lora", "privacy.lora.rank=2", "privacy.clip_norm=1.0",
            'privacy.lora.layers=["*query", "*value"]', "training.epochs=2", "training.lr=0.5",
            "run.seed=0"]


def _lora_run(tmp_path):
    pipeline = text_pipeline(tmp_path, pooling="cls", trainable={"last_k_layers": 1})
    assert main(["run", pipeline, *[x for s in SETTINGS for x in ("--set", s)]]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    return run_dir, json.loads((run_dir / "record.json").read_text())


def _test_split(tmp_path):
    """The test split: 20% of the rows (data.train_fraction 0.8) in the order a generator
    seeded with data.random_state (42) permutes them, 8 tokens each."""
    table = pq.read_table(tmp_path / "text.parquet")
    order = np.random.default_rng(42).permutation(table.num_rows)
    test_rows = table.take(order[round(0.8 * table.num_rows):])
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_name_or_path(MINILM))
    inputs = tokenizer(test_rows.column("sentence").to_pylist(), max_length=8,
                       padding="max_length", truncation=True, return_tensors="pt")
    return inputs, np.asarray(test_rows.column("label"))


def _base():
    return transformers.AutoModelForSequenceClassification.from_pretrained(
        resolve_name_or_path(MINILM), num_labels=2)


# make test: test_lora.py's test_lora_trains_only_adapters_and_releases_the_merged_model (peft
# loads the adapter) and test_hf.py's DP-LoRA run on 2 workers
@pytest.mark.long
def test_the_adapter_alone_on_the_checkpoint_reproduces_the_runs_accuracy(ray_session,
                                                                         tmp_path):
    run_dir, record = _lora_run(tmp_path)
    adapted = peft.PeftModel.from_pretrained(_base(), run_dir / "adapter").eval()
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert "classifier" in config["modules_to_save"]  # the head trained by DP-SGD

    inputs, labels = _test_split(tmp_path)
    with torch.no_grad():
        predicted = adapted(**inputs).logits.argmax(-1).numpy()
        merged = transformers.AutoModelForSequenceClassification.from_pretrained(
            run_dir / "model").eval()(**inputs).logits
        torch.testing.assert_close(adapted(**inputs).logits, merged, rtol=1e-4, atol=1e-5)
    accuracy = float(np.mean(predicted == labels))
    assert accuracy == pytest.approx(record["metrics"][-1]["test_accuracy"], abs=1e-6)
