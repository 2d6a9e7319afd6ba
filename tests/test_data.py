"""Data sources and model builders: shapes, parquet reading and the errors users see."""

import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.data.sources import DataError, load_data
from raydp_train.models.builders import ModelError, build_model
from raydp_train.train.context import LocalContext
from raydp_train.train.plan import make_plan
from raydp_train.train.worker import train


def config(data, model=None, **sections):
    raw = {
        "name": "t",
        "data": data,
        "model": model or {"kind": "logistic"},
        "privacy": {"noise_multiplier": 1.0, "delta": 1e-4},
        **sections,
    }
    return pipeline_from_dict(raw)


def write(path, **columns):
    pq.write_table(pa.table(columns), path)
    return str(path)


def test_synthetic_matches_the_seed_setting():
    data = load_data(config({"source": "synthetic"}).data)
    assert data.num_train == 800 and len(data.test_labels) == 200
    assert data.feature_shape == (20,) and data.num_classes == 2


def test_digits_are_images_scaled_to_unit_range():
    data = load_data(config({"source": "sklearn_digits"}).data)
    assert data.feature_shape == (1, 8, 8) and data.num_classes == 10
    assert data.train_features.max() <= 1.0 and data.train_features.min() >= 0.0


def test_parquet_feature_columns_with_separate_test_file(tmp_path):
    train = write(tmp_path / "train.parquet", a=[0.0, 1.0, 2.0], b=[1, 2, 3], label=[0, 1, 2])
    test = write(tmp_path / "test.parquet", a=[5.0], b=[6], label=[1])
    source = {"source": "parquet", "path": train, "test_path": test, "feature_columns": ["a", "b"]}
    data = load_data(config(source).data, num_classes=3)
    assert data.train_features.tolist() == [[0.0, 1.0], [1.0, 2.0], [2.0, 3.0]]
    assert data.test_labels.tolist() == [1] and data.num_classes == 3


def test_normalize_uses_the_public_statistics_it_is_given(tmp_path):
    from raydp_train.data.columns import FeatureScaleWarning

    train = write(tmp_path / "train.parquet", income=[40_000.0, 55_000.0, 70_000.0],
                  age=[20.0, 30.0, 40.0], label=[0, 1, 0])
    test = write(tmp_path / "test.parquet", income=[55_000.0], age=[50.0], label=[1])
    source = {"source": "parquet", "path": train, "test_path": test,
              "feature_columns": ["income", "age"], "normalize": {"income": [50_000, 10_000]}}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FeatureScaleWarning)  # age stays raw, but is small
        data = load_data(config(source).data, num_classes=2)
    assert data.train_features.tolist() == [[-1.0, 20.0], [0.5, 30.0], [2.0, 40.0]]
    assert data.test_features.tolist() == [[0.5, 50.0]]  # the same public statistics


def test_raw_features_far_from_unit_scale_get_a_warning_naming_the_column(tmp_path):
    from raydp_train.data.columns import FeatureScaleWarning

    train = write(tmp_path / "t.parquet", income=[40_000.0, 55_000.0, 70_000.0, 1.0],
                  age=[20.0, 30.0, 40.0, 50.0], label=[0, 1, 0, 1])
    source = {"source": "parquet", "path": train, "feature_columns": ["income", "age"]}
    with pytest.warns(FeatureScaleWarning, match=r"'income'.*data.normalize: \{income"):
        load_data(config(source).data, num_classes=2)


@pytest.mark.parametrize(("normalize", "message"), [
    ({"salary": [0, 1]}, "data.normalize: 'salary' is not one of data.feature_columns"),
    ({"income": [0, 0]}, "data.normalize: income: the std must be > 0, got 0"),
])
def test_bad_normalize_is_refused_naming_the_field(normalize, message):
    from raydp_train.config.pipeline import PipelineError

    source = {"source": "parquet", "path": "x.parquet", "feature_columns": ["income"],
              "normalize": normalize}
    with pytest.raises(PipelineError, match=message):
        config(source)


def test_the_classes_of_private_labels_are_given_never_read_from_them(tmp_path):
    """1 + the largest label would be the model's width: removing the one row of label 2
    would change the released model's shape."""
    train = write(tmp_path / "t.parquet", a=[0.0, 1.0, 2.0], label=[1, 2, 1])
    source = {"source": "parquet", "path": train, "feature_columns": ["a"]}
    with pytest.raises(DataError, match=r"model.num_classes: not set, nor data.label_names: .*"
                                        r"private labels"):
        load_data(config(source).data)
    assert load_data(config(source).data, num_classes=3).num_classes == 3
    assert load_data(config({**source, "label_names": ["a", "b", "c"]}).data).num_classes == 3


def test_label_names_map_string_labels_and_fix_the_class_count(tmp_path):
    train = write(tmp_path / "t.parquet", a=[0.0, 1.0, 2.0], label=["pos", "neg", "pos"])
    source = {"source": "parquet", "path": train, "feature_columns": ["a"], "test_path": train,
              "label_names": ["neg", "pos", "neutral"]}
    data = load_data(config(source).data)
    assert data.num_classes == 3 and sorted(data.train_labels.tolist()) == [0, 1, 1]
    with pytest.raises(DataError, match=r"model.num_classes: 2 classes, but data.label_names "
                                        r"names 3"):
        load_data(config(source).data, num_classes=2)
    unknown = {**source, "label_names": ["neg", "other"]}
    with pytest.raises(DataError, match=r"data.label_names: labels \['pos'\]"):
        load_data(config(unknown).data)


def test_string_labels_as_pandas_writes_them_map_too(tmp_path):
    """pandas writes a string column as Arrow's large_string; label_names maps it alike."""
    path = tmp_path / "large.parquet"
    pq.write_table(pa.table({"a": [0.0, 1.0, 2.0],
                             "label": pa.array(["pos", "neg", "pos"], pa.large_string())}), path)
    source = {"source": "parquet", "path": str(path), "feature_columns": ["a"],
              "test_path": str(path), "label_names": ["neg", "pos"]}
    assert load_data(config(source).data).train_labels.tolist() == [1, 0, 1]


def test_parquet_tensor_column_keeps_the_tensor_shape(tmp_path):
    images = [np.full((1, 2, 2), i).tolist() for i in range(10)]
    path = write(tmp_path / "x.parquet", pixels=images, label=[i % 2 for i in range(10)])
    data = load_data(config({"source": "parquet", "path": path, "tensor_column": "pixels"}).data,
                     num_classes=2)
    assert data.feature_shape == (1, 2, 2) and data.num_train == 8


@pytest.mark.parametrize(
    ("columns", "source", "message"),
    [
        # a relative path in a dict (as from --set) names a file in the current directory
        (None, {"path": "nowhere.parquet"},
         f"data.path: parquet file not found: {Path('nowhere.parquet').resolve()}"),
        ({"a": [1.0], "label": [0]}, {"feature_columns": ["zz"]}, "column(s) ['zz'] not in"),
        ({"a": [1.0, float("nan")], "label": [0, 1]}, {}, "NaN or inf features in rows [1]"),
        ({"a": [1.0, 2.0], "label": [0.5, 1.0]}, {}, "data.label_column: column 'label'"),
        ({"a": pa.array([], pa.float64()), "label": pa.array([], pa.int64())}, {}, "no rows"),
        ({"a": ["x", "y"], "label": [0, 1]}, {}, "column 'a'"),
        ({"a": [1.0, 2.0, 3.0], "label": [0, 1, 7]}, {"num_classes": 3}, "labels must lie in [0, 2]"),
    ],
)
def test_bad_parquet_is_refused_with_the_field_and_file(tmp_path, columns, source, message):
    path = write(tmp_path / "d.parquet", **columns) if columns else source.pop("path")
    num_classes = source.pop("num_classes", None)
    data = {"source": "parquet", "path": path, "feature_columns": ["a"], "test_path": path}
    data.update(source)
    with pytest.raises(DataError) as error:
        load_data(config(data).data, num_classes)
    assert message in str(error.value)


def test_ragged_tensor_column_is_refused(tmp_path):
    path = write(tmp_path / "r.parquet", x=[[1.0, 2.0], [1.0]], label=[0, 1])
    source = {"source": "parquet", "path": path, "tensor_column": "x", "test_path": path}
    with pytest.raises(DataError, match="equally-shaped lists"):
        load_data(config(source).data)


def test_cnn_needs_image_features():
    with pytest.raises(ModelError, match="model.kind: 'cnn' needs image features"):
        build_model(config({"source": "synthetic"}, {"kind": "cnn"}).model, (20,), 2)


@pytest.mark.thorough
def test_cnn_trains_privately_on_digits():
    pipeline = config(
        {"source": "sklearn_digits"},
        {"kind": "cnn", "channels": [8, 16], "hidden_size": 32},
        training={"epochs": 2, "batch_size": 128, "optimizer": "adam", "lr": 0.01},
        run={"seed": 3},
    )
    data = load_data(pipeline.data)
    plan = make_plan(pipeline, data.num_train)
    result = train(pipeline, plan, LocalContext(on_epoch=lambda row: None))
    assert result.steps_done == plan.steps == 2 * 1438 // 128
    assert result.metrics[-1]["test_accuracy"] > 0.3  # 10 classes: chance is 0.1


@pytest.mark.parametrize("kind", ["int8", "int32", "int64", "uint16", "float16", "float32",
                                  "float64"])
def test_numbers_read_from_arrow_buffers_equal_pyarrow_s_own(kind):
    from raydp_train.data.arrow_numbers import numbers_as_numpy

    arrow_type = pa.from_numpy_dtype(np.dtype(kind))
    values = np.arange(1, 8).astype(kind)
    # Several chunks, one a slice (its data starts at an offset into its buffer).
    column = pa.chunked_array([pa.array(values[:3], arrow_type),
                               pa.array(values[2:], arrow_type).slice(1)])
    got = numbers_as_numpy(column)
    assert got.dtype == np.dtype(kind)
    np.testing.assert_array_equal(got, column.to_numpy())
