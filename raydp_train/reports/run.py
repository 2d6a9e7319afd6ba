"""Run records: what a run trained, how, and the privacy it spent -- never training data.

A run directory holds `pipeline.yaml` (resolved), `metrics.parquet` (one row per epoch),
`privacy.json` (the final statement), `record.json` (all of it), `model.pt`, the write-ahead
`charges/` and Ray Train's checkpoints.
"""

from __future__ import annotations

import importlib.metadata
import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from raydp_train.budget.ledger import as_uri
from raydp_train.budget.run_witnesses import budget_witness
from raydp_train.config.pipeline import Pipeline, PipelineError, dump_pipeline
from raydp_train.privacy.mechanism import mechanism_named
from raydp_train.privacy.noise import NOISE_SOURCES
from raydp_train.train.context import peak_rss_mb
from raydp_train.train.plan import PrivacyPlan


def new_run_dir(pipeline: Pipeline, kind: str = "") -> Path:
    """`<run.output_dir>/<name>[-<kind>]-<timestamp>` with the resolved pipeline in it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # Absolute, so the run record and every message say where the run really is.
    base = Path(pipeline.run.output_dir).resolve() / "-".join(filter(None, (pipeline.name, kind, stamp)))
    run_dir, suffix = base, 1
    while run_dir.exists():
        run_dir, suffix = base.with_name(f"{base.name}-{suffix}"), suffix + 1
    try:
        run_dir.mkdir(parents=True)
    except OSError as error:
        raise PipelineError(pipeline.run.output_dir, [
            f"run.output_dir: cannot create {run_dir}: {error.strerror or error}"]) from None
    (run_dir / "pipeline.yaml").write_text(dump_pipeline(pipeline))
    return run_dir


def privacy_statement(plan: PrivacyPlan, result, workers: int) -> dict:
    """The final (epsilon, delta) claim with everything needed to re-derive it."""
    steps_charged, releases = result.steps_charged, result.releases_charged
    return {
        "epsilon": plan.epsilon(steps_charged, releases=releases),
        "delta": plan.delta,
        "accountant": plan.accountant,
        "epsilon_rdp": plan.epsilon(steps_charged, "rdp", releases),
        "epsilon_pld": plan.reported_epsilon(steps_charged, "pld", releases),
        "rough_epsilon_estimate": plan.rough_epsilon(),
        "sampling_rate": plan.sampling_rate,
        "noise_multiplier": plan.noise_multiplier,
        "noise_calibrated": plan.noise_calibrated,
        "clip_norm": plan.clip_norm,
        "steps": steps_charged,  # every step ever released, restarts included
        "planned_steps": plan.steps,
        # Released beyond the steps of the final trajectory: run again after a restart.
        "steps_run_again": max(steps_charged - result.steps_done, 0),
        "expected_batch_size": plan.expected_batch_size,
        "num_examples": plan.num_examples,  # users, with unit user
        # What (epsilon, delta) protects: one example, or one user with all of its rows, each
        # step using at most rows_per_user of them (ARCHITECTURE.md §2.14).
        "unit": plan.unit,
        "rows_per_user": plan.rows_per_user,
        # With unit user: each user's ONE clipped vector is its rows' gradient sum or mean.
        "user_contribution": plan.user_contribution if plan.unit == "user" else None,
        "validation_releases": releases,  # noisy counts of correct validation predictions
        "release_noise_multiplier": plan.release_noise_multiplier,
        "workers": workers,
        "noise": "one Gaussian draw per step on rank 0, summed by all-reduce",
        "noise_mode": result.noise_mode,  # fast, secure or seeded (run.noise, run.seed)
        "noise_source": NOISE_SOURCES[result.noise_mode],
        "mechanism": plan.mechanism.name,
        "private": plan.private,  # false: the non-private reference
        # A model that never took a step is the untrained initialization: nothing to release.
        "for_release": (result.noise_mode != "seeded" and plan.private
                        and result.steps_done > 0),
        "stop_reason": result.stop_reason,
    }


def noise_description(privacy: dict) -> str:
    """`mode: source` of a privacy statement; records before 0.2.0 called fast noise "secure"."""
    if "noise_source" in privacy:
        return f"{privacy['noise_mode']}: {privacy['noise_source']}"
    if privacy["noise_mode"] == "secure":
        return (f"fast: {NOISE_SOURCES['fast']} (recorded as \"secure\" before 0.2.0, which "
                "had no other mode)")
    return f"{privacy['noise_mode']}: {NOISE_SOURCES['seeded']}"


def unit_words(privacy: dict) -> str:
    """Whom the guarantee protects: "per example", or "per user (at most k rows a step)"."""
    if privacy.get("unit", "example") == "example":
        return "per example"
    mean = ", their mean" if privacy.get("user_contribution") == "mean" else ""
    return (f"per user (all of a user's rows; at most {privacy['rows_per_user']} a "
            f"step{mean})")


def training_statement(pipeline: Pipeline, result) -> dict:
    """What each step trained and communicated (LSG trains far fewer numbers than the model)."""
    statement = {
        "mechanism": pipeline.privacy.mechanism,
        "model_parameters": result.model_parameters,
        "trained_numbers_per_step": result.trained_per_step,
        "allreduce_numbers_per_step": result.trained_per_step,
        "allreduce_collectives_per_step": 1,
        "sampler": result.sampler,  # data.sampler as run (auto resolved; §2.13)
        "training_rows_per_worker": result.shard_sizes,  # they sum to N (ARCHITECTURE.md §2.10)
        "threads_per_worker": result.threads,  # torch's, training.threads_per_worker
        "worker_nodes": result.nodes,  # each rank's node address (training.placement)
        "worker_nodes_ever": result.nodes_ever,  # of every attempt, after failovers too
        # The std of the last step's all-reduced sum before / qN (noise + clipped sums): about
        # sigma C when the noise dominates, whatever the world size (one draw per step).
        "last_step_sum_std": result.final_step_sum_std,
        # privacy.self_check: each worker's checks of the engine and their seconds
        "engine_self_checks_per_worker": [
            {"checks": count, "seconds": seconds} for count, seconds in result.self_checks],
        # Modules without a rule whose per-example gradients torch.func computed
        "per_example_path_modules": result.per_example_path,
        "clipping": pipeline.privacy.clipping,  # fixed, automatic or adaptive (C moves)
    }
    if hasattr(result.model, "pooling"):  # hf: the pooling model.pooling: null resolved to
        head = result.model.pooling_head
        statement.update(pooling=result.model.pooling, normalize=bool(head and head.normalize))
    return statement


def raydp_train_version() -> str:
    try:
        return importlib.metadata.version("raydp-train")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def write_run_record(
    run_dir: Path, pipeline: Pipeline, result, privacy: dict,
    ledger_head: tuple[int, str] | None = None
) -> Path:
    """`ledger_head`: the newest row of the budget's ledger at the end (seq, hash), kept with
    what the run charged (budget/run_witnesses.py): a ledger restored from an older copy is
    then noticed."""
    metrics = result.metrics
    pq.write_table(pa.Table.from_pylist(metrics), run_dir / "metrics.parquet")
    (run_dir / "privacy.json").write_text(json.dumps(privacy, indent=2))
    record = {
        "pipeline": pipeline.model_dump(mode="json"),
        "metrics": metrics,
        "privacy": privacy,
        "training": training_statement(pipeline, result),
        "written_to": locations_statement(run_dir, pipeline),
        "baselines": result.baselines,  # accuracies to beat: chance, the test majority class
        # What rebuilds the model from pipeline.yaml and model.pt (predict.load_model).
        "model": _model_shape(result),
        # Peak resident memory (MB) of this process and of each worker, to size a cluster by.
        "memory": {"driver_peak_rss_mb": peak_rss_mb(),
                   "worker_peak_rss_mb": result.peak_rss_mb,
                   "worker_data_mb": result.data_mb},  # resident growth reading its rows
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        # Which engine produced the run: CHANGELOG.md says which versions to distrust for what.
        "raydp_train_version": raydp_train_version(),
    }
    if ledger_head is not None:
        record["budget"] = budget_witness(
            pipeline.budget.name, pipeline.budget.ledger, Path(run_dir).name,
            (result.steps_charged, result.releases_charged), ledger_head)
    path = run_dir / "record.json"
    path.write_text(json.dumps(record, indent=2))
    mechanism = mechanism_named(pipeline.privacy.mechanism)
    model = mechanism.released(result.model)  # the architecture the pipeline built
    torch.save(model.state_dict(), run_dir / "model.pt")
    if pipeline.model.kind == "hf":
        save_hf_model(model, pipeline.model, run_dir / "model",
                      getattr(pipeline.data, "label_names", None),
                      getattr(pipeline.data, "max_length", None))
    mechanism.save_extras(result.model, run_dir)
    return path


def _model_shape(result) -> dict | None:
    if not getattr(result, "data_shape", ()):
        return None
    feature_shape, num_classes = result.data_shape
    return {"feature_shape": list(feature_shape), "num_classes": int(num_classes)}


def locations_statement(run_dir: Path, pipeline: Pipeline) -> dict:
    """Where this run's files and its budget's ledger are, as absolute paths or URIs."""
    ledger = None if pipeline.budget is None else as_uri(pipeline.budget.ledger)
    return {"run_dir": str(Path(run_dir).resolve()), "budget_ledger": ledger}


def save_hf_model(model, config, folder: Path, label_names: list[str] | None = None,
                  max_length: int | None = None) -> None:
    """`save_pretrained` (+ the tokenizer): loadable by transformers alone, no raydp_train.
    `label_names` (data.label_names) become the saved config's id2label / label2id;
    `max_length` (data.max_length) the tokenizer's, so that transformers truncates each text
    where the run did."""
    if label_names is not None:
        model.model.config.id2label = dict(enumerate(label_names))
        model.model.config.label2id = {name: i for i, name in enumerate(label_names)}
    if getattr(model, "pooling", "cls") == "mean":
        save_mean_pooled(model, folder)
    else:
        model.model.save_pretrained(folder)
    if config.name_or_path is not None:
        from raydp_train.models.hf_files import load_tokenizer

        tokenizer = load_tokenizer(config)
        if max_length is not None:
            tokenizer.model_max_length = max_length
        tokenizer.save_pretrained(folder)


def save_mean_pooled(model, folder: Path) -> None:
    """A mean-pooled classifier as transformers custom code (models/hf_mean_pooled.py): it loads with
    trust_remote_code=True, and is refused without it rather than pooling [CLS] silently."""
    from raydp_train.models.hf_mean_pooled import (
        MeanPooledConfig,
        MeanPooledForSequenceClassification,
        mean_pooled,
    )

    linear = model.pooling_head.linear
    head = next(name for name, module in model.model.named_modules() if module is linear)
    MeanPooledConfig.register_for_auto_class()
    MeanPooledForSequenceClassification.register_for_auto_class(
        "AutoModelForSequenceClassification")
    mean_pooled(model.model, head, model.pooling_head.normalize).save_pretrained(folder)


def read_record(run_dir: Path) -> dict:
    path = Path(run_dir) / "record.json"
    if not path.is_file():
        raise FileNotFoundError(f"no run record at {path}: is {run_dir} a finished run directory?")
    return json.loads(path.read_text())


def metrics_table(record: dict) -> str:
    measured = [c for c in ("test_accuracy", "test_label_accuracy", "test_mse", "test_loss",
                            "test_perplexity", "validation_accuracy")
                if any(c in row for row in record["metrics"])]
    columns = ["epoch", "steps", "steps_charged", "train_loss", *measured, "epsilon"]
    widths = [max(13, len(c)) for c in columns]
    lines = ["  ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True))]
    for row in record["metrics"]:
        lines.append("  ".join(_cell(row.get(c, ""), w) for c, w in zip(columns, widths,
                                                                         strict=True)))
    return "\n".join(lines)


def _cell(value, width: int) -> str:
    return f"{value:>{width}.4f}" if isinstance(value, float) else f"{value:>{width}}"


def write_plots(record: dict, run_dir: Path) -> list[Path]:
    from raydp_train.reports.plots import run_figures, save

    return [save(figure, Path(run_dir) / name) for name, figure in run_figures(record).items()]
