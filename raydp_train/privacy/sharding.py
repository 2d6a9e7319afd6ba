"""Sharded training (``training.sharding: fsdp``, ARCHITECTURE.md §2.15): torch FSDP2 keeps
1/W of every weight on each of W ranks; the clipped sums and the noise are sharded alike.

FSDP gathers a block's weights before its forward and again before its backward, so the
engine's hooks (clipping.py) record each layer's input and output gradient as they would
unsharded, and every rank computes its own examples' norms and clip factors. Then, for every
trained coordinate k, owned by exactly one rank own(k):

    g^_k = sum_w s_w[k] + N(0, sigma^2 C^2)    the sums reduced onto own(k) bucket of layers
                                               by bucket (layer_reduction.py), the draw made
                                               by own(k) alone

so each coordinate receives exactly one draw across the cluster: the noise of one unsharded
draw, not sqrt(W) times it, and no rank holds more than one bucket's full-size sums. Rank w
draws its shard's noise from a generator of its own: a
seeded run derives it from (run.seed, w) (`shard_seed`), an unseeded one seeds each rank from
os.urandom (fast) or keys it (secure). FSDP's own gradient reduction never runs: inside a
covered layer the weights are detached (ghost differentiation), so autograd gives the
gathered weights no gradient to reduce.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import Tensor, nn

from raydp_train.privacy.noise import NoiseGenerator, fill_gaussian_noise_

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_sharded(tensor: Tensor) -> bool:
    """A DTensor (FSDP's sharded parameter). DTensor's module imports sympy (a second of CPU
    in every worker): until something imported it, nothing is one."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's shard of a sharded parameter; any other tensor as it is."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def shard_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s shard noise in a seeded run: distinct for every rank."""
    digest = hashlib.sha256(f"raydp_train shard noise {seed} {rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def sharded_blocks(model: nn.Module) -> list[nn.Module]:
    """What is sharded as one unit: the entries of the model's largest list of blocks (a
    transformer's layers), else its top-level children that hold parameters."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if lists:
        return list(max(lists, key=len))
    return [child for child in model.children() if any(True for _ in child.parameters())]


def shard_model(model: nn.Module, replicated: set[nn.Parameter] = frozenset()) -> None:
    """FSDP2 over the default process group: each block (`sharded_blocks`), then the root
    (what is left: embeddings, final norm, head). `replicated` parameters stay whole on every
    rank (DP-LoRA's adapters: the engine reads them after the backward)."""
    from torch.distributed.fsdp import fully_shard

    ignored = set(replicated)
    for block in sharded_blocks(model):
        fully_shard(block, ignored_params=ignored or None)
    fully_shard(model, ignored_params=ignored or None)


def shardable_rule(rule) -> bool:
    """Rules that compute from the recorded inputs and output gradients alone (and the
    weights' shapes): they run unchanged on sharded weights."""
    from raydp_train.privacy.embedding_rule import EmbeddingRule
    from raydp_train.privacy.layer_rules import LinearRule
    from raydp_train.privacy.norm_rules import NormRule

    return isinstance(rule, (LinearRule, EmbeddingRule, NormRule))


def shard_of(whole: Tensor, like: DTensor) -> DTensor:
    """This rank's rows of `whole`, sharded as `like` (FSDP2's dim-0 chunks)."""
    from torch.distributed.tensor import DTensor

    rows = dim0_rows(like.shape[0], dist.get_world_size())[dist.get_rank()]
    return DTensor.from_local(whole[slice(*rows)].contiguous(), like.device_mesh, like.placements,
                              run_check=False, shape=like.shape, stride=like.stride())


def dim0_rows(rows: int, world_size: int) -> list[tuple[int, int]]:
    """Each rank's rows of a dim-0 sharded tensor: chunks of ceil(rows / W), the last ones
    short or empty (torch.chunk's, as FSDP2 shards)."""
    chunk = -(-rows // world_size)
    return [(min(w * chunk, rows), min((w + 1) * chunk, rows)) for w in range(world_size)]


class ShardedSums:
    """This rank's shard noise added to its rows of the reduced clipped sums
    (layer_reduction.py), and those rows bound as the sharded parameters' `.grad`."""

    NOISE_CHUNK = 1 << 20  # numbers drawn at a time: no second buffer of the shard's size

    def __init__(self, engine, noise_std: float, noise_generator: NoiseGenerator):
        """`engine`: a clipper on the sharded model (its `reduction`, `flat_grad`: this
        rank's rows of every trained parameter)."""
        if engine.reduction is None:
            raise ValueError("sharded sums need every trained parameter sharded by FSDP")
        self.reduction = engine.reduction
        self.noise_std, self.noise_generator = noise_std, noise_generator
        self.rank, self.world_size = self.reduction.rank, self.reduction.world_size
        self.own_length = engine.flat_grad.numel()

    def add_noise(self, local: Tensor) -> None:
        """local <- local + one N(0, noise_std^2) draw per coordinate of this rank's rows,
        drawn `NOISE_CHUNK` numbers at a time from this rank's generator."""
        if self.noise_std == 0.0:
            return
        draw = local.new_empty(min(self.NOISE_CHUNK, local.numel()))
        for start in range(0, local.numel(), self.NOISE_CHUNK):
            piece = local[start:start + self.NOISE_CHUNK]
            fill_gaussian_noise_(draw[:piece.numel()], self.noise_std, self.noise_generator)
            piece += draw[:piece.numel()]

    def bind(self, local: Tensor) -> None:
        """Each sharded parameter's `.grad`: its rows of `local`, as its shard."""
        from torch.distributed.tensor import DTensor

        for piece in self.reduction.pieces:
            param = piece.param
            shape = param.to_local().shape
            shard = local[piece.local:piece.local + shape.numel()].view(shape)
            param.grad = DTensor.from_local(shard, param.device_mesh, param.placements,
                                            run_check=False, shape=param.shape,
                                            stride=param.stride())


@contextmanager
def weights_held(model: nn.Module, gather_now: bool = False) -> Iterator[None]:
    """FSDP keeps every block's gathered weights from the forward through any number of
    backward passes (the self-check's slow way differentiates each example alone, on the
    gathered weights: one unsharded model's memory while it runs); resharded after.
    `gather_now`: gathered at once, so that ranks may then run different numbers of passes
    (evaluation over each rank's rows) with no collective among them."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
        module.set_reshard_after_backward(False, recurse=False)
        if gather_now:
            module.unshard()
    try:
        yield
    finally:
        for module in modules:
            # FSDP's defaults: the root keeps its weights from forward to backward.
            module.set_reshard_after_forward(module is not model, recurse=False)
            module.set_reshard_after_backward(True, recurse=False)
            module.reshard()


class ShardedMechanism:
    """A run's mechanism (DP-SGD) on a sharded engine: the clipped sums already reduced onto
    the shards (layer_reduction.py), each shard's noise drawn by its own rank."""

    def __init__(self, mechanism, sums: ShardedSums):
        self.mechanism, self.sums = mechanism, sums

    def __getattr__(self, name: str):
        return getattr(self.mechanism, name)

    def reduce(self, engine, all_reduce_sum) -> None:
        """The sums were reduced layer by layer in the passes: the noise is what is left."""
        self.sums.add_noise(engine.flat_grad)

    def write_back(self, engine) -> None:
        self.sums.bind(engine.flat_grad)

    def trained(self, engine) -> Tensor:
        """The whole step's numbers, every rank's shard (a collective: every rank asks)."""
        return self.sums.reduction.whole(engine.flat_grad)
