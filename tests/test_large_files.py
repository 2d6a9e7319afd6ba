"""Large data files are read by row groups, one needed column at a time: `validate` (and the
driver of a run whose workers read their own shards) never holds a whole table, nor a column
it does not use, nor token arrays it did not tokenize; a `data.max_rows` subset is copied a
row group at a time (benchmarks/validate_memory.py measures a 600 MB file)."""

import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from text_files import MINILM

import raydp_train as rt
from raydp_train.data.sources import load_data

ROWS, GROUP_ROWS, MAX_LENGTH = 4_000, 500, 512


@pytest.fixture
def big_text(tmp_path):
    """A text file of several row groups, with a column no pipeline names."""
    path = tmp_path / "big.parquet"
    pq.write_table(pa.table({
        "sentence": [f"a {'good' if i % 2 else 'dull'} film, number {i}" for i in range(ROWS)],
        "label": [i % 2 for i in range(ROWS)],
        "notes": ["unused " * 20] * ROWS}), path, row_group_size=GROUP_ROWS)
    assert pq.ParquetFile(path).num_row_groups == ROWS // GROUP_ROWS
    return path


def _data(path, **more):
    return rt.Pipeline.from_dict({
        "name": "big", "data": {"source": "parquet", "path": str(path),
                                "text_column": "sentence", "max_length": MAX_LENGTH, **more},
        "model": {"kind": "hf", "name_or_path": MINILM, "num_labels": 2},
        "privacy": {"noise_multiplier": 1.0, "delta": 1e-5},
        "training": {"epochs": 1, "batch_size": 8}}).data


@pytest.fixture
def reads(monkeypatch):
    """Every column read by batches, recorded; a read of a whole table fails the test."""
    asked = []
    batches = pq.ParquetFile.iter_batches

    def iter_batches(self, *args, columns=None, **kwargs):
        asked.append(columns)
        return batches(self, *args, columns=columns, **kwargs)

    def whole(*args, **kwargs):
        raise AssertionError("a whole table was read")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", iter_batches)
    for name in ("read", "read_row_groups"):
        monkeypatch.setattr(pq.ParquetFile, name, whole)
    monkeypatch.setattr(pq, "read_table", whole)
    return asked


def test_text_checks_read_the_needed_columns_by_row_groups(big_text, reads):
    dataset = load_data(_data(big_text), 2, MINILM, "model.num_labels", tokenize=False)
    assert dataset.num_train + len(dataset.test_labels) == ROWS
    assert dataset.feature_shape == (2, MAX_LENGTH)
    assert sorted(map(tuple, reads)) == [("label",), ("sentence",)]  # never "notes"


def test_untokenized_text_takes_no_memory_per_row(big_text):
    """Split by train_fraction and a validation fraction, the placeholders of the tokens
    stay one row broadcast: a full array would be 2 x 4 x max_length bytes a row (16 MB)."""
    tracemalloc.start()
    try:
        dataset = load_data(_data(big_text, validation={"fraction": 0.1}), 2, MINILM,
                            "model.num_labels", tokenize=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert dataset.validation_features.shape == (len(dataset.validation_labels), 2, MAX_LENGTH)
    assert peak < ROWS * 2 * 4 * MAX_LENGTH / 4
    assert not np.any(dataset.train_features[:3])


def test_a_max_rows_subset_is_copied_by_row_groups(big_text, reads, monkeypatch, tmp_path):
    """The same rows as before (drawn with data.random_state, in file order), never the
    whole file in memory."""
    monkeypatch.setenv("RAYDP_TRAIN_CACHE", str(tmp_path / "cache"))
    data = _data(big_text, max_rows=1_000)
    dataset = load_data(data, 2, MINILM, "model.num_labels", tokenize=False)
    assert dataset.num_train + len(dataset.test_labels) == 1_000
    (subset,) = (tmp_path / "cache").rglob("big.parquet")
    kept = [int(text.rsplit(" ", 1)[1]) for batch in
            pq.ParquetFile(subset).iter_batches(columns=["sentence"])
            for text in batch.column(0).to_pylist()]
    drawn = np.random.default_rng(data.random_state).choice(ROWS, 1_000, replace=False)
    assert kept == sorted(drawn.tolist())


def test_a_damaged_page_after_a_sound_footer_is_one_line(big_text):
    """The column read by batches fails in one line naming the field, not a traceback."""
    from raydp_train.errors import DataError

    damaged = bytearray(big_text.read_bytes())
    first_page = pq.ParquetFile(big_text).metadata.row_group(0).column(0).data_page_offset
    for offset in range(first_page + 64, first_page + 2_048):
        damaged[offset] ^= 0x5A
    big_text.write_bytes(bytes(damaged))
    with pytest.raises(DataError, match=f"data.text_column: cannot read column 'sentence' of "
                                        f"{big_text} as parquet: "):
        load_data(_data(big_text), 2, MINILM, "model.num_labels", tokenize=False)


def test_numeric_checks_read_by_row_groups_and_name_the_file_s_row(tmp_path, reads):
    """validate checks every feature as training reads it, a batch at a time, and names a
    bad row by its place in the file, not in its batch."""
    from raydp_train.errors import DataError

    rows = 3 * GROUP_ROWS
    x = np.linspace(-1, 1, rows)
    x[2 * GROUP_ROWS + 7] = np.nan
    path = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"x": x, "y": -x, "label": np.arange(rows) % 2,
                             "notes": ["unused"] * rows}), path, row_group_size=GROUP_ROWS)
    data = rt.Pipeline.from_dict({
        "name": "n", "data": {"source": "parquet", "path": str(path),
                              "feature_columns": ["x", "y"]},
        "model": {"kind": "logistic"}, "privacy": {"noise_multiplier": 1.0, "delta": 1e-5},
        "training": {"epochs": 1, "batch_size": 8}}).data
    with pytest.raises(DataError, match=rf"has NaN or inf features in rows \[{2 * GROUP_ROWS + 7}"
                                        r"\]"):
        load_data(data, 2, tokenize=False)
    x[2 * GROUP_ROWS + 7] = 0.5
    pq.write_table(pa.table({"x": x, "y": -x, "label": np.arange(rows) % 2,
                             "notes": ["unused"] * rows}), path, row_group_size=GROUP_ROWS)
    reads.clear()
    dataset = load_data(data, 2, tokenize=False)
    assert dataset.feature_shape == (2,) and dataset.num_train + len(dataset.test_labels) == rows
    assert dataset.train_features.strides[0] == 0 and not dataset.features_read
    assert sorted(map(tuple, reads)) == [("label",), ("x", "y")]  # never "notes"
