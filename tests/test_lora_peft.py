"""A DP-LoRA run's `adapter/` loads the standard way (issue 31): `PeftModel.from_pretrained`
on the checkpoint the pipeline names, with nothing else, is the trained model: its test
accuracy is the run's recorded one. On the real pretrained MiniLM, through `raydp-train run`."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from text_files import MINILM, text_pipeline

from raydp_train.cli import main
from raydp_train.hf_files import resolve_name_or_path

transformers = pytest.importorskip("transformers", reason="transformers is a runtime dependency")
peft = pytest.importorskip("peft", reason="peft is a runtime dependency (DP-LoRA's adapters)")


def test_the_adapter_alone_on_the_checkpoint_reproduces_the_runs_accuracy(ray_session,
                                                                         tmp_path):
    pipeline = text_pipeline(tmp_path, pooling="cls")
    settings = ["privacy.mechanism=lora", "privacy.lora.rank=2", "privacy.clip_norm=1.0",
                'privacy.lora.layers=["*query", "*value"]', "training.epochs=2",
                "training.lr=0.5", "run.seed=0"]
    assert main(["run", pipeline, *[x for s in settings for x in ("--set", s)]]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    record = json.loads((run_dir / "record.json").read_text())

    checkpoint = resolve_name_or_path(MINILM)
    base = transformers.AutoModelForSequenceClassification.from_pretrained(checkpoint,
                                                                          num_labels=2)
    adapted = peft.PeftModel.from_pretrained(base, run_dir / "adapter").eval()
    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    assert "classifier" in config["modules_to_save"]  # the head trained by DP-SGD

    # The test split: the last 20% of the rows (data.train_fraction 0.8), 8 tokens each.
    table = pq.read_table(tmp_path / "text.parquet")
    test_rows = table.slice(int(0.8 * table.num_rows))
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    inputs = tokenizer(test_rows.column("sentence").to_pylist(), max_length=8,
                       padding="max_length", truncation=True, return_tensors="pt")
    with torch.no_grad():
        predicted = adapted(**inputs).logits.argmax(-1).numpy()
        merged = transformers.AutoModelForSequenceClassification.from_pretrained(
            run_dir / "model").eval()(**inputs).logits
        torch.testing.assert_close(adapted(**inputs).logits, merged, rtol=1e-4, atol=1e-5)
    accuracy = float(np.mean(predicted == np.asarray(test_rows.column("label"))))
    assert accuracy == pytest.approx(record["metrics"][-1]["test_accuracy"], abs=1e-6)
