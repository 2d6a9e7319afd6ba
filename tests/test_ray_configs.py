"""Ray's own ScalingConfig and RunConfig through `rt.run` (train/ray_configs.py): their fields
land in the pipeline's (and the run's record), storage and filesystem reach Ray Train (a
`file://` URI and a pyarrow filesystem of our own stand in for s3://, which this machine
cannot reach), and what conflicts with the pipeline or with privacy is refused by name in one
line before Ray starts or any budget is reserved."""

import pyarrow.fs
import pytest
import yaml
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from test_ray_datasets import pipeline_dict, rows

import raydp_train as rt
from raydp_train.train.ray_configs import with_ray_configs


def pipeline(tmp_path, **training) -> rt.Pipeline:
    raw = pipeline_dict(tmp_path, {"source": "ray_dataset"})
    raw["training"] = {"epochs": 2, "batch_size": 40, **training}
    return rt.Pipeline.from_dict(raw)


def test_the_configs_fields_land_in_the_pipeline(tmp_path):
    scaling = ScalingConfig(num_workers=3, use_gpu=True, accelerator_type="H100",
                            resources_per_worker={"CPU": 2, "GPU": 1, "fast_disk": 1},
                            placement_strategy="STRICT_SPREAD")
    run = RunConfig(failure_config=FailureConfig(max_failures=2),
                    checkpoint_config=CheckpointConfig(num_to_keep=4),
                    storage_path="s3://bucket/runs")
    mapped, settings = with_ray_configs(pipeline(tmp_path), scaling, run)
    training = mapped.training
    assert (training.workers, training.use_gpu, training.accelerator_type) == (3, True, "H100")
    assert (training.cpus_per_worker, training.worker_resources) == (2.0, {"fast_disk": 1.0})
    assert training.placement == "strict_spread"
    assert training.worker_bundle() == {"GPU": 1.0, "CPU": 2.0, "accelerator_type:H100": 0.001,
                                        "fast_disk": 1.0}
    assert (mapped.run.max_failures, mapped.run.keep_checkpoints) == (2, 4)
    assert settings.storage_path == "s3://bucket/runs"
    # Ray's defaults say nothing: the pipeline's own values stay.
    unchanged, settings = with_ray_configs(pipeline(tmp_path, workers=2), ScalingConfig(),
                                           RunConfig())
    assert unchanged.training.workers == 2 and unchanged.run.keep_checkpoints == 2
    assert settings.storage_path is None  # Ray's default (~/ray_results): the run directory


@pytest.mark.parametrize("scaling, run, message", [
    (ScalingConfig(num_workers=2), None,
     ("scaling_config.num_workers: 2, but the pipeline sets training.workers: 3; give it in "
      "one place")),
    (None, RunConfig(checkpoint_config=CheckpointConfig(num_to_keep=1,
                                                        checkpoint_score_attribute="loss")),
     ("run_config.checkpoint_config.checkpoint_score_attribute: keeping checkpoints by score "
      "may delete the newest one")),
    (None, RunConfig(failure_config=FailureConfig(max_failures=-1)),
     "run_config.failure_config.max_failures: -1 restarts without end"),
    (None, RunConfig(name="mine"), "run_config.name: a run is named by its run directory"),
    (ScalingConfig(placement_strategy="STRICT_PACK"), None,
     "scaling_config.placement_strategy: 'STRICT_PACK' is not offered"),
    (ScalingConfig(use_gpu=True, resources_per_worker={"GPU": 2}), None,
     "scaling_config.resources_per_worker: GPU 2: a worker has one GPU"),
    (ScalingConfig(accelerator_type="A100"), None,
     ("training.accelerator_type: a GPU model is asked for GPUs: set use_gpu: true too "
      "(from the Ray config passed)")),
])
def test_conflicts_are_refused_by_name_before_ray_starts(tmp_path, monkeypatch, scaling, run,
                                                         message):
    import raydp_train.runs.resources

    def no_ray(*_, **__):
        raise AssertionError("Ray was joined or started before the refusal")

    monkeypatch.setattr(raydp_train.runs.resources, "connect", no_ray)
    with pytest.raises(rt.UserError) as refused:
        rt.run(pipeline(tmp_path, workers=3), datasets={"train": None}, scaling_config=scaling,
               run_config=run, on_line=None)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "runs").exists()  # nothing written, nothing spent


def test_the_guides_example_maps_as_it_says(tmp_path):
    """The block of docs/guides/python-api.md, its rt.run call caught."""
    from types import SimpleNamespace

    from doc_blocks import ROOT, blocks

    (block,) = [block for block in blocks(ROOT / "docs/guides/python-api.md")
                if block.marker == "ray configs"]
    calls = []
    exec(block.text, {"rt": SimpleNamespace(run=lambda _, **configs: calls.append(configs)),  # noqa: S102
                      "pipeline": None})
    mapped, settings = with_ray_configs(pipeline(tmp_path), **calls[0])
    assert (mapped.training.workers, mapped.training.cpus_per_worker) == (2, 2.0)
    assert (mapped.run.max_failures, mapped.run.keep_checkpoints) == (2, 2)
    assert settings.storage_path == "s3://bucket/runs"


def test_a_sweep_takes_no_storage_of_its_own(tmp_path):
    with pytest.raises(rt.UserError, match="run_config.storage_path: not for a sweep"):
        with_ray_configs(pipeline(tmp_path), None, RunConfig(storage_path="/elsewhere"),
                         sweep=True)


# make test: the mapping tests above, and test_ray_datasets.py's run on 2 workers
@pytest.mark.long
def test_scaling_and_run_configs_pass_through_run_on_two_workers(ray_session, tmp_path):
    import ray.data

    datasets = {"train": ray.data.from_arrow(rows(300, 1)), "test": ray.data.from_arrow(
        rows(80, 2))}
    store = tmp_path / "store"
    result = rt.run(
        pipeline(tmp_path), datasets=datasets, on_line=None, on_epoch=None,
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5},
                                     placement_strategy="SPREAD"),
        run_config=RunConfig(storage_path=f"file://{store}",
                             failure_config=FailureConfig(max_failures=1),
                             checkpoint_config=CheckpointConfig(num_to_keep=1)))
    assert result.status == "completed"
    saved = yaml.safe_load((result.run_dir / "pipeline.yaml").read_text())
    assert saved["training"]["workers"] == 2 and saved["training"]["cpus_per_worker"] == 0.5
    assert saved["training"]["placement"] == "spread"
    assert (saved["run"]["max_failures"], saved["run"]["keep_checkpoints"]) == (1, 1)
    kept = [path for path in (store / result.run_dir.name).glob("checkpoint_*") if path.is_dir()]
    assert len(kept) == 1 and (kept[0] / "state.pt").is_file()  # the newest alone, there
    assert not list(result.run_dir.glob("checkpoint_*"))
    assert str(store) in result.checkpoint.path

    # A filesystem of the caller's own (as an s3 one would be), under a path of its own.
    own = pyarrow.fs.SubTreeFileSystem(str(tmp_path / "bucket"), pyarrow.fs.LocalFileSystem())
    (tmp_path / "bucket").mkdir()
    again = rt.run(pipeline(tmp_path, workers=2), datasets=datasets, on_line=None,
                   on_epoch=None, new=True,
                   run_config=RunConfig(storage_path="runs", storage_filesystem=own))
    assert again.status == "completed"
    assert (tmp_path / "bucket" / "runs" / again.run_dir.name / "checkpoint_manager_snapshot.json"
            ).is_file()
    (again.run_dir / "record.json").unlink()  # as an interrupted run's, after its last epoch
    with pytest.raises(rt.UserError, match="run_config.storage_filesystem: the run resumed "
                                           "keeps its checkpoints in runs on a filesystem"):
        rt.run(pipeline(tmp_path, workers=2), datasets=datasets, resume=again.run_dir,
               on_line=None)
    # Given again, the resumed run starts from the checkpoint there: no epoch runs twice.
    resumed = rt.run(pipeline(tmp_path, workers=2), datasets=datasets, resume=again.run_dir,
                     on_line=None, on_epoch=None, run_config=RunConfig(storage_filesystem=own))
    assert resumed.status == "completed" and resumed.epsilon == again.epsilon
    assert resumed.metrics == again.metrics
