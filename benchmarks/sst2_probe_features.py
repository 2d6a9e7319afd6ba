"""The SST-2 linear probe's inputs, computed once: all-MiniLM-L6-v2 (frozen, as
`pipelines/sst2_minilm_probe.yaml` builds it) run over every train, dev and test sentence, and
the mean-pooled, L2-normalised embedding its classifier reads written to Parquet (a `features`
list column and `label`). A `model.kind: logistic` pipeline on these files trains the same
linear head on the same inputs as the probe, so a sweep's trials do not each re-encode SST-2
(the frozen-prefix cache, shared on disk between trials).

    .venv/bin/python benchmarks/sst2_probe_features.py OUT_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "pipelines/sst2_minilm_probe.yaml"


def encode(sentences: list[str], model, tokenizer, max_length: int) -> torch.Tensor:
    """The classifier's input for each sentence (eval mode, batches of 256)."""
    captured = []
    hook = model.pooling_head.linear.register_forward_pre_hook(
        lambda module, args: captured.append(args[0].detach().clone()))
    with torch.no_grad():
        for start in range(0, len(sentences), 256):
            batch = tokenizer(sentences[start:start + 256], padding="max_length",
                              truncation=True, max_length=max_length, return_tensors="pt")
            model(torch.stack([batch["input_ids"], batch["attention_mask"]], dim=1))
    hook.remove()
    return torch.cat(captured)


def main() -> None:
    from raydp_train.config.pipeline import load_pipeline
    from raydp_train.models.hf import build_hf_model
    from raydp_train.models.hf_files import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    pipeline = load_pipeline(str(PROBE))
    model = build_hf_model(pipeline.model, num_labels=2).eval()
    tokenizer = load_tokenizer(pipeline.model)
    data = pipeline.data
    files = {"train": Path(data.path), "dev": Path(data.validation.path),
             "test": Path(data.test_path)}
    args.out.mkdir(parents=True, exist_ok=True)
    for split, source in files.items():
        table = pq.read_table(source)
        features = encode(table.column("sentence").to_pylist(), model, tokenizer,
                          data.max_length)
        pq.write_table(pa.table({"features": features.numpy().tolist(),
                                 "label": table.column("label")}), args.out / f"{split}.parquet")
        print(f"{split}: {features.shape[0]} rows x {features.shape[1]}", flush=True)


if __name__ == "__main__":
    main()
