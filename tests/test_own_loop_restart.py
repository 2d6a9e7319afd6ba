"""PrivateStep with LSG (tensor rows) and with DP-LoRA (dict rows from a Ray Data shard) in
the user's own TorchTrainer loop on 2 workers:
the workers raise once after a checkpoint, `FailureConfig(max_failures=1)` restarts the group,
which resumes from the checkpoint (`load_state_dict`), and the final `epsilon()` is
dp-accounting's for every step released: the steps the dead attempt released past its
checkpoint were released again by the next attempt, so they count twice."""

import sys
import tempfile
from pathlib import Path

import dp_accounting
import pytest
import torch
from ray import cloudpickle

import raydp_train as rt

N, B, C, SIGMA, DELTA = 40, 10, 4.0, 3.0, 1e-3
STEPS, CHECKPOINT_AT, FAIL_AT = 8, 3, 5  # released: 5 by the dead attempt, 5 after step 3


def _data():
    generator = torch.Generator().manual_seed(3)
    return (torch.randn(N, 6, generator=generator) * 3,
            torch.randint(0, 2, (N,), generator=generator))


def restarting_loop(config) -> dict:
    import ray.train

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    rows, loss = _rows(config["mechanism"], rank, world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8),
                                torch.nn.Tanh(), torch.nn.Linear(8, 2))
    mechanism = config["mechanism"]
    private = rt.PrivateStep(model, torch.optim.SGD(model.parameters(), lr=0.05), clip_norm=C,
                             noise_multiplier=SIGMA, expected_batch_size=B, num_examples=N,
                             delta=DELTA, mechanism=mechanism, **{mechanism: {"rank": 2}},
                             steps_per_charge=2, **loss)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            private.load_state_dict(torch.load(Path(folder) / "private.pt", weights_only=False))
    resumed_at = private.steps_done
    while private.steps_done < STEPS:
        batch = private.sample(rows)
        private.step(batch) if isinstance(batch, dict) else private.step(*batch)
        if private.steps_done == CHECKPOINT_AT:
            _report_checkpoint(private, rank)
        failed_once = Path(config["markers"]) / f"failed-{rank}"
        if private.steps_done == FAIL_AT and not failed_once.exists():
            failed_once.touch()
            raise RuntimeError("injected: this worker fails once after the checkpoint")
    private.finish()
    return {"epsilon": private.epsilon(), "released": private.steps_released,
            "steps": private.steps_done, "resumed_at": resumed_at,
            "groups": len(private.optimizer.param_groups), "rows": _every_ranks_rows(rows)}


def _rows(mechanism: str, rank: int, world: int) -> tuple:
    """This rank's rows and the loss they need: LSG's a tuple cut from the data, LoRA's the
    dicts of its Ray Data shard."""
    if mechanism == "lsg":
        inputs, labels = _data()
        return (inputs[rank::world], labels[rank::world]), {}  # disjoint shards
    import ray.train

    def loss(model, batch):
        return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"],
                                                 reduction="none")

    return rt.PrivateStep.load_rows(ray.train.get_dataset_shard("train")), {"loss": loss}


def _every_ranks_rows(rows) -> int:
    count = torch.tensor(len(rows["y"] if isinstance(rows, dict) else rows[1]))
    torch.distributed.all_reduce(count)
    return int(count)


def _report_checkpoint(private, rank: int) -> None:
    import ray.train

    state = private.state_dict()
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = None
        if rank == 0:
            torch.save(state, Path(folder) / "private.pt")
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report({"steps": private.steps_done}, checkpoint=checkpoint)


# lora: make test-long (make test: lsg here; LoRA's step and dict rows through load_rows in
# test_own_loop_mechanisms.py)
@pytest.mark.parametrize("mechanism", ["lsg", pytest.param("lora", marks=pytest.mark.long)])
def test_a_restarted_own_loop_counts_every_step_released(ray_session, tmp_path, mechanism):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    markers = tmp_path / "markers"
    markers.mkdir()
    inputs, labels = _data()
    dataset = ray_session.data.from_items([{"x": x.numpy(), "y": int(y)}
                                           for x, y in zip(inputs, labels, strict=True)])
    result = TorchTrainer(
        restarting_loop, train_loop_config={"mechanism": mechanism, "markers": str(markers)},
        scaling_config=ScalingConfig(num_workers=2),
        datasets={"train": dataset} if mechanism == "lora" else None,
        run_config=RunConfig(storage_path=str(tmp_path / "storage"), name=mechanism,
                             failure_config=FailureConfig(max_failures=1))).fit()
    metrics = result.return_value
    assert sorted(path.name for path in markers.iterdir()) == ["failed-0", "failed-1"]
    assert metrics["resumed_at"] == CHECKPOINT_AT and metrics["steps"] == STEPS
    released = FAIL_AT + (STEPS - CHECKPOINT_AT)  # steps 3 and 4 twice
    assert metrics["released"] == released
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(
        B / N, dp_accounting.GaussianDpEvent(SIGMA)), released)
    expected = dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(DELTA)
    assert metrics["epsilon"] == pytest.approx(expected, rel=1e-12)
    assert metrics["groups"] == (2 if mechanism == "lora" else 1)  # LoRA's adapters joined
    assert metrics["rows"] == N  # the shards hold every row once
