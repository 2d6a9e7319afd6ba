"""The worker loop with `training.sharding: fsdp` on 2 Gloo ranks (no Ray: a context of
torch.distributed collectives): DP-SGD sharded takes the unsharded run's steps, DP-LoRA
shards its frozen base, and a sharded checkpoint resumes."""

import pytest
import torch
import torch.distributed as dist
from test_sharding import spawn

from raydp_train.config.pipeline import pipeline_from_dict
from raydp_train.privacy.sharding import is_sharded
from raydp_train.train import sharded as sharded_module
from raydp_train.train.context import LocalContext
from raydp_train.train.plan import make_plan
from raydp_train.train.sharded import gathered
from raydp_train.train.worker import WorkerRun, train

pytestmark = pytest.mark.slow  # starts two processes


class GlooContext(LocalContext):
    """A rank of the default process group; charges kept in memory; checkpoints kept here."""

    def __init__(self, restored: dict | None = None):
        super().__init__(on_epoch=lambda row: None, restored=restored)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.states: list[dict] = []

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    def broadcast_parameters(self, model) -> None:
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)

    def gather(self, value) -> list:
        values = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def report(self, row: dict, state: dict) -> None:
        self.states.append(state)


def digits(sharding: str, mechanism: str = "dpsgd", noise_multiplier: float = 1.0,
           max_physical_batch: int = 256):
    """`max_physical_batch` 16: ~8 micro-batches a rank, rarely as many on both ranks (the
    sharded loop pads the fewer with zero-weight passes); the self-check on 1 step in 5."""
    privacy = {"mechanism": mechanism, "noise_multiplier": noise_multiplier, "clip_norm": 1.0,
               "self_check": {"step_fraction": 0.2}}
    if mechanism == "lora":
        privacy["lora"] = {"rank": 4, "alpha": 8, "layers": ["1"]}
    return pipeline_from_dict({
        "name": "digits", "data": {"source": "sklearn_digits"},
        "model": {"kind": "mlp", "hidden_sizes": [64]}, "privacy": privacy,
        "training": {"epochs": 2, "batch_size": 128, "lr": 0.5, "workers": 2,
                     "sharding": sharding, "threads_per_worker": 1,
                     "max_physical_batch": max_physical_batch},
        "run": {"seed": 0}})


def check_dpsgd_sharded_is_the_unsharded_step(rank: int) -> None:
    padded, equal_passes = [], sharded_module.equal_passes

    def counted(batches, spare, context):
        passes = equal_passes(batches, spare, context)
        padded.append(len(passes) - len(batches))
        return passes

    sharded_module.equal_passes = counted
    results = {}
    for sharding in ("none", "fsdp"):  # noise ~0: the same steps, sharded or not
        pipeline = digits(sharding, noise_multiplier=1e-3, max_physical_batch=16)
        results[sharding] = train(pipeline, make_plan(pipeline, 1438), GlooContext())
    sharded, whole = results["fsdp"], results["none"]
    assert not any(is_sharded(p) for p in sharded.model.parameters())
    assert len(set(sharded.checksums)) == 1 and sharded.steps_done == whole.steps_done
    assert sharded.trained_per_step == whole.trained_per_step  # every shard, not one
    assert all(count >= 1 for count, _ in sharded.self_checks)  # the check ran sharded
    assert sum(GlooContext().gather(sum(padded))) > 0  # zero-weight passes ran, and added 0
    for p, q in zip(sharded.model.parameters(), whole.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=3e-4)
    noisy = digits("fsdp")
    assert train(noisy, make_plan(noisy, 1438), GlooContext()).metrics[-1][
        "test_accuracy"] > 0.3


def check_lora_shards_the_frozen_base_and_resumes(rank: int) -> None:
    pipeline = digits("fsdp", "lora")
    plan = make_plan(pipeline, 1438)
    context = GlooContext()
    result = train(pipeline, plan, context)
    names = [n for n, p in result.model.named_parameters() if p.requires_grad]
    assert names == ["1.lora_A", "1.lora_B", "2.weight", "2.bias"] or names == [
        "1.lora_A", "1.lora_B", "3.weight", "3.bias"]
    assert len(set(result.checksums)) == 1 and result.metrics[-1]["test_accuracy"] > 0.3
    first_epoch = context.states[0]
    run = WorkerRun.setup(pipeline, plan, GlooContext(restored=first_epoch), None, None)
    assert any(is_sharded(p) for p in run.model.parameters())  # the base, sharded
    restored = gathered(run.model.state_dict())
    for key, value in first_epoch["model"].items():
        assert torch.equal(restored[key], value), key
    assert run.step == first_epoch["step"] and run.first_epoch == 2
    run.clipper.close()


def check_both(rank: int) -> None:
    check_dpsgd_sharded_is_the_unsharded_step(rank)
    check_lora_shards_the_frozen_base_and_resumes(rank)


@pytest.mark.thorough
def test_the_worker_loop_sharded_over_two_gloo_ranks():
    spawn(check_both, torch.float32)
