"""`raydp-train predict RUN_DIR --data FILE`, and `load_model(RUN_DIR)` for Python: a run's
released classifier, rebuilt as the pipeline built it, on a file laid out as the run's
training data (the same columns; the labels, where the file has them, give the accuracy),
in the format its extension names (.parquet, .csv, .json), as `--output` is written. Predicting with a released model is post-processing: it spends no privacy.

Non-Hugging Face kinds are rebuilt from `pipeline.yaml` and `model.pt`, with the input shape
and class count the run recorded (`record.json: model`); a Hugging Face run from its saved
`model/` folder; a mean-pooled one (saved as transformers custom code, models/hf_mean_pooled.py)
through that class, here without trust_remote_code.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raydp_train.errors import UserError


class PredictError(UserError, ValueError):
    """The run directory or the data file cannot be used for predictions."""


# A file's format, by its extension: a Parquet file is read as Parquet on a CSV run too.
FORMATS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".json": "json",
           ".jsonl": "json"}


def file_format(path: Path, field: str, default: str | None = None) -> str:
    """The format `path`'s extension names, else `default`; neither: refused, naming it."""
    found = FORMATS.get(path.suffix.lower(), default)
    if found is None:
        raise PredictError(f"{field}: {path} names no format by its extension; end it in one "
                           f"of {', '.join(FORMATS)}")
    return found


@dataclass
class Predictions:
    # [N] the predicted class of each row; [N, K] values (label_kind real) or 0/1 per label
    # (multi_hot)
    classes: np.ndarray
    metrics: dict[str, float]  # against the file's labels ({} if it has none): accuracy, mse
    outputs: np.ndarray | None = None  # [N, K] the model's raw outputs (logits, values)

    @property
    def accuracy(self) -> float | None:
        return self.metrics.get("accuracy")


def add_predict_command(commands, parents: list) -> None:
    summary = "predict the classes of a Parquet file with a run's released model"
    command = commands.add_parser("predict", help=summary, description=summary, parents=parents)
    command.add_argument("run_dir", metavar="RUN_DIR")
    command.add_argument("--data", required=True, metavar="FILE",
                         help="a file with the run's feature (and label) columns: .parquet, "
                              ".csv or .json by its extension (else the run's own format)")
    command.add_argument("--output", metavar="FILE",
                         help="write the predictions here (row, prediction), in the format "
                              "its extension names: .parquet, .csv or .json (JSON lines)")
    command.set_defaults(command=predict_command)


def predict_command(args: argparse.Namespace) -> int:
    if args.output:
        file_format(Path(args.output), "--output")  # refused before any work
    result = predict(Path(args.run_dir), Path(args.data))
    print(f"{len(result.classes)} rows predicted")
    for name, value in result.metrics.items():
        print(f"{name:<23} {value:.4f}")
    if args.output:
        write_predictions(result.classes, Path(args.output))
        print(f"wrote {args.output}")
    return 0


def write_predictions(predicted: np.ndarray, path: Path) -> None:
    """Columns row and prediction, in the format `path`'s extension names."""
    import pyarrow as pa

    table = pa.table({"row": np.arange(len(predicted)), "prediction": _column(predicted)})
    written = file_format(path, "--output")
    if written == "csv":
        if predicted.ndim > 1:
            raise PredictError(f"--output: {path}: a CSV cell holds one value, and each "
                               f"prediction is {predicted.shape[1]} values; write .parquet or "
                               ".json")
        import pyarrow.csv

        pyarrow.csv.write_csv(table, path)
    elif written == "json":
        path.write_text("".join(json.dumps(row) + "\n" for row in table.to_pylist()))
    else:
        import pyarrow.parquet as pq

        pq.write_table(table, path)


def predict(run_dir: Path, data) -> Predictions:
    """The run's model on every row of `data`, in batches, in this process: a file, or rows
    held in memory (a ray.data.Dataset, a Hugging Face Dataset, a pyarrow Table), read as
    the run read its rows and never written anywhere."""
    import torch

    from raydp_train.data.targets import ClassIds, label_kind

    pipeline = _pipeline(run_dir)
    model = _released_model(Path(run_dir), pipeline)
    kind = label_kind(pipeline.data)
    # A regression or multi-label model's width, as recorded (class ids: read from the file).
    width = None if isinstance(kind, ClassIds) else _recorded(run_dir)["num_classes"]
    if isinstance(data, (str, Path)):
        dataset, labelled = _read(pipeline, Path(data), width)
    else:
        dataset, labelled = _read_rows(pipeline, _arrow(data), width)
    dataset = dataset.to_torch()
    with torch.no_grad():
        outputs = torch.cat([model(batch) for batch in dataset.test_features.split(256)])
    labels = dataset.test_labels
    scored = labelled and len(labels) > 0
    metrics = kind.metrics(kind.score(outputs, labels), "test") if scored else {}
    named = {name.removeprefix("test_"): value for name, value in metrics.items()}
    return Predictions(kind.predict(outputs).numpy(), named, outputs.float().numpy())


def _column(predicted: np.ndarray):
    """Classes as they are; a row of values or 0/1 per label as a list."""
    return predicted if predicted.ndim == 1 else list(predicted)


def load_model(run_dir: str | Path):
    """The run's released classifier (an nn.Module in eval mode), as its pipeline built it."""
    return _released_model(Path(run_dir), _pipeline(Path(run_dir)))


def _released_model(run_dir: Path, pipeline):
    import torch

    config = pipeline.model
    from raydp_train.config.model import is_causal_lm

    if is_causal_lm(config):
        raise PredictError(f"{run_dir}: a causal language model; use `raydp-train generate`")
    from raydp_train.models.frozen_precision import keep_as_saved

    state = torch.load(run_dir / "model.pt", weights_only=True)
    if config.kind == "hf":
        model = _hf_model(run_dir, config)
    else:
        from raydp_train.models.builders import build_model

        shape = _recorded(run_dir)
        model = build_model(config, tuple(shape["feature_shape"]), shape["num_classes"])
        model.load_state_dict(state)
    keep_as_saved(model, state)  # frozen weights kept in bf16 or fp16 (model.frozen_dtype)
    return model.eval()


def _hf_model(run_dir: Path, config):
    from raydp_train.models.hf import SequenceClassifier, build_hf_model
    from raydp_train.models.hf_heads import MeanPoolingHead

    folder = run_dir / "model"
    saved = json.loads((folder / "config.json").read_text())
    if saved.get("model_type") == "raydp_mean_pooled":  # reports/run.py save_mean_pooled
        from raydp_train.models.hf_mean_pooled import MeanPooledForSequenceClassification

        wrapper = MeanPooledForSequenceClassification.from_pretrained(folder)
        head = wrapper.model.get_submodule(wrapper.config.head)
        return SequenceClassifier(wrapper.model, MeanPoolingHead(head, wrapper.config.normalize))
    plain = config.model_copy(update={"name_or_path": str(folder), "config": None,
                                      "pooling": "cls", "normalize": None,
                                      "head_init": "default"})
    return build_hf_model(plain, num_labels=max(len(saved.get("id2label", {})), 2))


def _pipeline(run_dir: Path):
    from raydp_train.config.pipeline import load_pipeline

    if not (run_dir / "pipeline.yaml").is_file() or not (run_dir / "record.json").is_file():
        raise PredictError(f"{run_dir}: not the directory of a finished run (no pipeline.yaml "
                           "and record.json)")
    return load_pipeline(run_dir / "pipeline.yaml")


def _recorded(run_dir: Path) -> dict:
    shape = json.loads((run_dir / "record.json").read_text()).get("model")
    if not shape:
        raise PredictError(f"{run_dir}: its record.json has no `model` (input shape, classes): "
                           "written by a version before 0.4; rebuild the model with "
                           "raydp_train.models.builders.build_model and load model.pt")
    return shape


def _read(pipeline, data: Path, width: int | None):
    """`data` read and checked as the run read its test file (columns, normalization, label
    names, tokenization), and whether it has labels."""
    from raydp_train.config.pipeline import pipeline_from_dict
    from raydp_train.data.sources import load_data
    from raydp_train.data.table_files import CONVERTED, parquet_copy
    from raydp_train.models.hf_files import tokenizer_source

    kind = pipeline.data.source
    if kind in ("ray_dataset", "hf_dataset"):  # rows handed over: the same columns in a file
        kind = "parquet"
    if kind not in ("parquet", *CONVERTED):
        raise PredictError(f"predict reads files laid out as the run's data; this run "
                           f"trained on data.source {kind}")
    if not data.is_file():
        raise PredictError(f"--data: {data.resolve()} is not a file")
    given_file = data.resolve()
    given = file_format(data, "--data", default=kind)
    if given in CONVERTED:  # read as a run reads its csv or json files
        data = parquet_copy(data, given, "--data")
    labelled = _has_labels(pipeline, data)
    with tempfile.TemporaryDirectory() as scratch:
        source = data if labelled else _unlabeled_copy(pipeline, data, Path(scratch), width)
        raw = pipeline.model_dump(mode="json")
        for field in ("name", "subset", "split", "test_split", "validation_split"):  # hf_dataset's
            raw["data"].pop(field, None)
        raw["data"].update(source="parquet", path=str(source), test_path=str(source),
                           validation=None)
        raw["tune"] = None  # a sweep's metric needs the validation split dropped here
        try:
            reading = pipeline_from_dict(raw, source=str(given_file))
            return load_data(reading.data, width or reading.model.num_classes,
                             tokenizer_source(reading.model)), labelled
        except UserError as error:  # the user's file by its name, not a copy's
            message = str(error)
            for copy in {str(source), str(data)} - {str(given_file)}:
                message = message.replace(copy, str(given_file))
            if message == str(error):
                raise
            raise PredictError(message) from error


def _has_labels(pipeline, data: Path) -> bool:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(data).names
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise PredictError(f"--data: {data}: not a Parquet file ({error})") from error
    return pipeline.data.label_column in names


def _unlabeled_copy(pipeline, data: Path, scratch: Path, width: int | None) -> Path:
    """A copy of `data` (no label column) in `scratch` with placeholder labels (class 0, or
    `width` zeros): the loader checks labels, predictions ignore them."""
    import pyarrow.parquet as pq

    copy = scratch / data.name
    pq.write_table(_with_placeholder(pq.read_table(data), pipeline, width), copy)
    return copy


def _with_placeholder(table, pipeline, width: int | None):
    import pyarrow as pa

    names = pipeline.data.label_names
    placeholder = pa.array([names[0]] * table.num_rows) if names else pa.array(
        np.zeros(table.num_rows, np.int64))
    if width is not None:
        placeholder = pa.array([[0.0] * width] * table.num_rows)
    return table.append_column(pipeline.data.label_column, placeholder)


def _arrow(rows):
    """Rows held in memory as one Arrow table (a Ray Dataset's blocks fetched here)."""
    import pyarrow as pa

    if isinstance(rows, pa.Table):
        return rows
    if hasattr(rows, "to_arrow_refs"):  # ray.data.Dataset
        import ray

        return pa.concat_tables([ray.get(ref) for ref in rows.to_arrow_refs()])
    if hasattr(rows, "flatten_indices"):  # a Hugging Face datasets.Dataset
        return rows.flatten_indices().data.table
    raise PredictError(f"data: a file, a ray.data.Dataset, a Hugging Face Dataset or a pyarrow "
                       f"Table, got {type(rows).__name__}")


def _read_rows(pipeline, table, width: int | None):
    """Rows in memory read as a run's workers read their shard (data/shards.py)."""
    from raydp_train.data.shards import shard_rows
    from raydp_train.data.sources import Dataset
    from raydp_train.models.hf_files import tokenizer_source

    if not (labelled := pipeline.data.label_column in table.column_names):
        table = _with_placeholder(table, pipeline, width)
    features, labels = shard_rows(table, pipeline.data, "the rows given",
                                  tokenizer_source(pipeline.model))
    return Dataset(features[:0], labels[:0], features, labels,
                   width or pipeline.model.num_classes or 0), labelled
