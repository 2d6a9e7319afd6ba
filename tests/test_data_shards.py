"""Parquet splits as Ray Data shards (ARCHITECTURE.md §2.10): every training row lies in
exactly one worker's shard, and a shard holds what the in-memory reader makes of its rows."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from text_files import MINILM

from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.data.shards import ShardEveryRow, file_splits, materialize, split_datasets
from raydp_train.data.sources import load_data
from raydp_train.models.hf_files import tokenizer_source

ROWS = 2_500


def numeric_pipeline(tmp_path):
    for name, rows in (("train", ROWS), ("test", 40)):
        ids = np.arange(rows)
        # Small row groups, so the file is read as several blocks for the shards to share.
        pq.write_table(pa.table({"row": ids, "x": ids * 0.5, "label": ids % 3}),
                       tmp_path / f"{name}.parquet", row_group_size=100)
    return pipeline_from_dict({
        "name": "shards",
        "data": {"source": "parquet", "path": str(tmp_path / "train.parquet"),
                 "test_path": str(tmp_path / "test.parquet"), "feature_columns": ["row", "x"],
                 "label_column": "label", "normalize": {"x": [100.0, 50.0]}},
        "model": {"kind": "logistic", "num_classes": 3},
        "privacy": {"noise_multiplier": 1.0},
    })


def shards_of(pipeline, world_size: int,
              feature_shape=(2,)) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each worker's training shard, read side by side as Ray Train's workers read them."""
    shards = ShardEveryRow().configure(split_datasets(pipeline), world_size, None, None)
    with ThreadPoolExecutor(world_size) as pool:
        return list(pool.map(lambda shard: materialize(
            shard["train"], pipeline, "train", feature_shape,
            tokenizer=tokenizer_source(pipeline.model)), shards))


def test_the_shards_partition_the_training_rows(ray_session, tmp_path):
    pipeline = numeric_pipeline(tmp_path)
    assert set(file_splits(pipeline.data)) == {"train", "test"}
    expected = load_data(pipeline.data, 3)  # the in-memory reader, the same standardization

    (alone,) = shards_of(pipeline, 1)  # one worker holds every row, in file order
    np.testing.assert_array_equal(alone[0], expected.train_features)
    np.testing.assert_array_equal(alone[1], expected.train_labels)

    shards = shards_of(pipeline, 3)
    rows = np.concatenate([features[:, 0] for features, _ in shards]).astype(int)
    assert len(rows) == ROWS and set(rows) == set(range(ROWS))  # disjoint, and cover all
    # Contiguous, in file order, and the same rows every time: a seeded run samples the same
    # examples whichever worker asks for its shard first, on one node or several.
    np.testing.assert_array_equal(rows, np.arange(ROWS))
    again = shards_of(pipeline, 3)
    for (features, _), (repeated, _) in zip(shards, again, strict=True):
        np.testing.assert_array_equal(features, repeated)
    assert sum(len(features) > 0 for features, _ in shards) > 1  # the rows were shared
    for features, labels in shards:  # each row keeps its own label and features
        np.testing.assert_array_equal(labels, features[:, 0].astype(int) % 3)
        np.testing.assert_allclose(features[:, 1], (features[:, 0] * 0.5 - 100) / 50)


def test_each_worker_tokenizes_its_text_shard_as_the_in_memory_reader_does(ray_session,
                                                                          tmp_path):
    """Text shards reach the workers as sentences; each worker's token ids and masks, side
    by side, are the in-memory reader's of the whole file, row for row."""
    sentences = [f"a {'good' if i % 3 else 'dull'} film, number {i} " * (i % 4 + 1)
                 for i in range(300)]
    for name in ("train", "test"):
        pq.write_table(pa.table({"sentence": sentences, "label": [i % 2 for i in range(300)]}),
                       tmp_path / f"{name}.parquet", row_group_size=50)
    pipeline = pipeline_from_dict({
        "name": "text-shards",
        "data": {"source": "parquet", "path": str(tmp_path / "train.parquet"),
                 "test_path": str(tmp_path / "test.parquet"), "text_column": "sentence",
                 "label_column": "label", "max_length": 12},
        "model": {"kind": "hf", "name_or_path": MINILM, "num_labels": 2},
        "privacy": {"noise_multiplier": 1.0},
    })
    expected = load_data(pipeline.data, 2, tokenizer_source(pipeline.model))
    shards = shards_of(pipeline, 2, feature_shape=(2, 12))
    assert all(len(labels) > 0 for _, labels in shards)
    features = np.concatenate([features for features, _ in shards])
    assert features.dtype == np.int32 and features.shape == (300, 2, 12)
    np.testing.assert_array_equal(features, expected.train_features)
    np.testing.assert_array_equal(np.concatenate([labels for _, labels in shards]),
                                  expected.train_labels)
    assert (features[:, 1].sum(axis=1) == 12).any() and (features[:, 1].sum(axis=1) < 12).any()


def test_a_split_cut_from_a_file_is_not_sharded(tmp_path):
    pipeline = numeric_pipeline(tmp_path)
    cut = pipeline.data.model_copy(update={"test_path": None, "train_fraction": 0.8})
    assert file_splits(cut) is None


def test_split_files_are_read_by_ray_datas_first_parquet_reader(ray_session, tmp_path):
    """Ray Data 2.60's default Parquet reader lists files through a pool of 32 footer-reading
    actors on every read: a storm of processes for one file per split (2.7x the wall time of
    a run on 2 cores, benchmarks/RESULTS.md). The splits go through its first reader
    (data/parquet_reads.py), and the caller's DataContext keeps its own setting."""
    import ray.data

    context = ray.data.DataContext.get_current()
    before = context.use_datasource_v2, context.enable_progress_bars
    datasets = split_datasets(numeric_pipeline(tmp_path))
    assert (context.use_datasource_v2, context.enable_progress_bars) == before
    stats = datasets["test"].materialize().stats()
    assert "ReadParquet" in stats and "ListFiles" not in stats, stats


def test_a_ray_dataset_is_sharded_as_the_same_rows_in_a_parquet_file(ray_session, tmp_path):
    """However a handed-over Ray Dataset is cut into blocks, every row lies in exactly one
    shard, and each rank holds the very rows it would hold of the same rows in Parquet."""
    import ray.data

    from raydp_train.data.shards import shard_ready

    pipeline = numeric_pipeline(tmp_path)
    from_file = [features[:, 0] for features, _ in shards_of(pipeline, 3)]
    table = pq.read_table(tmp_path / "train.parquet")
    handed = pipeline_from_dict({**pipeline.model_dump(mode="json", exclude_unset=True),
                                 "data": {"source": "ray_dataset", "feature_columns": ["row", "x"],
                                          "normalize": {"x": [100.0, 50.0]}}})
    for blocks in (1, 7):
        datasets = shard_ready({"train": ray.data.from_arrow(table).repartition(blocks)},
                               handed, ROWS)
        shards = ShardEveryRow().configure(datasets, 3, None, None)
        rows = [materialize(shard["train"], handed, "train", (2,))[0][:, 0] for shard in shards]
        for mine, theirs in zip(rows, from_file, strict=True):
            np.testing.assert_array_equal(mine, theirs)
        assert sorted(np.concatenate(rows).astype(int).tolist()) == list(range(ROWS))
