"""Sharded training (``training.sharding: fsdp``, ARCHITECTURE.md §2.15): torch FSDP2 keeps
1/W of every weight on each of W ranks; the clipped sums and the noise are sharded alike.

FSDP gathers a block's weights before its forward and again before its backward, so the
engine's hooks (clipping.py) record each layer's input and output gradient as they would
unsharded, and every rank computes its own examples' norms and full-size clipped sum s_w.
Then, for every trained coordinate k, owned by exactly one rank own(k):

    g^_k = sum_w s_w[k] + N(0, sigma^2 C^2)    summed by one reduce-scatter onto own(k),
                                               the draw made by own(k) alone

so each coordinate receives exactly one draw across the cluster: the noise of one unsharded
draw, not sqrt(W) times it. Rank w draws its shard's noise from a generator of its own: a
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

import torch
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

    rows = _rows(like.shape[0], dist.get_world_size())[dist.get_rank()]
    return DTensor.from_local(whole[slice(*rows)].contiguous(), like.device_mesh, like.placements,
                              run_check=False, shape=like.shape, stride=like.stride())


def _rows(rows: int, world_size: int) -> list[tuple[int, int]]:
    """Each rank's rows of a dim-0 sharded tensor: chunks of ceil(rows / W), the last ones
    short or empty (torch.chunk's, as FSDP2 shards)."""
    chunk = -(-rows // world_size)
    return [(min(w * chunk, rows), min((w + 1) * chunk, rows)) for w in range(world_size)]


class ShardedSums:
    """The reduce-scatter of the engine's clipped sums onto the parameters' shards, this
    rank's shard noise, and the shards bound as the sharded parameters' `.grad`.

    Each rank's rows of a row-major parameter are one contiguous range of the engine's flat
    buffer; rank w's ranges, packed, are row w of the [W, S] buffer one
    `reduce_scatter_tensor` sums (one collective a step, as the unsharded all-reduce)."""

    def __init__(self, bound: list[tuple[Tensor, Tensor]], flat: Tensor, noise_std: float,
                 noise_generator: NoiseGenerator, rank: int, world_size: int,
                 in_place: bool | None = None):
        """`bound`: (sharded parameter, its slot in `flat`, the engine's flat buffer).
        `in_place` (default: on Gloo): sum by an in-place all-reduce of `flat`, then keep this
        rank's coordinates. Gloo's reduce-scatter allocates 1.5x its input (measured: 244 MB
        for 160 MB) and needs the packed copy, its all-reduce nothing; NCCL reduce-scatters
        natively, moving half the data."""
        self.in_place = dist.get_backend() == "gloo" if in_place is None else in_place
        if not bound or not all(is_sharded(p) for p, _ in bound):
            raise ValueError("sharded sums need every trained parameter sharded by FSDP")
        self.noise_std, self.noise_generator = noise_std, noise_generator
        self.rank, self.world_size = rank, world_size
        # (parameter, [(start, stop) in flat of each rank's rows])
        self.pieces = [(p, _rank_ranges(p, view, flat, world_size)) for p, view in bound]
        lengths = [sum(r[w][1] - r[w][0] for _, r in self.pieces) for w in range(world_size)]
        self.own_length, self.packed_length = lengths[rank], max(lengths)

    def reduce(self, flat: Tensor) -> None:
        """flat <- at this rank's coordinates: the sum over ranks of the clipped sums plus
        this rank's one noise draw; elsewhere 0."""
        own = flat.new_empty(self.packed_length)
        if self.in_place:
            dist.all_reduce(flat)
            torch.cat([flat[a:b] for a, b in self._ranges(self.rank)], out=own[:self.own_length])
        else:
            send = flat.new_zeros(self.world_size, self.packed_length)
            for w in range(self.world_size):
                torch.cat([flat[a:b] for a, b in self._ranges(w)],
                          out=send[w, :self._length(w)])
            dist.reduce_scatter_tensor(own, send.view(-1))
            del send
        noise = flat.new_empty(self.own_length)
        fill_gaussian_noise_(noise, self.noise_std, self.noise_generator)
        own[:self.own_length] += noise
        flat.zero_()
        offset = 0
        for a, b in self._ranges(self.rank):
            flat[a:b] = own[offset:offset + b - a]
            offset += b - a

    def bind(self, flat: Tensor) -> None:
        """Each sharded parameter's `.grad`: its rows of `flat`, as its shard."""
        from torch.distributed.tensor import DTensor

        for param, ranges in self.pieces:
            a, b = ranges[self.rank]
            shard = flat[a:b].view(param.to_local().shape)
            param.grad = DTensor.from_local(shard, param.device_mesh, param.placements,
                                            run_check=False, shape=param.shape,
                                            stride=param.stride())

    def _ranges(self, w: int) -> list[tuple[int, int]]:
        return [ranges[w] for _, ranges in self.pieces]

    def _length(self, w: int) -> int:
        return sum(b - a for a, b in self._ranges(w))


def _rank_ranges(param: Tensor, view: Tensor, flat: Tensor,
                 world_size: int) -> list[tuple[int, int]]:
    """Where each rank's rows of `param` (FSDP2: dim-0 chunks of ceil(n / W) rows) lie in
    `flat`; checked against this rank's own shard shape."""
    rows = param.shape[0]
    row_size = param.numel() // rows if rows else 0
    start = view.storage_offset() - flat.storage_offset()
    ranges = [(start + a * row_size, start + b * row_size) for a, b in _rows(rows, world_size)]
    rank = dist.get_rank()
    a, b = ranges[rank]
    if b - a != param.to_local().numel():
        raise RuntimeError(f"a sharded parameter of shape {tuple(param.shape)} holds "
                           f"{param.to_local().numel()} numbers on rank {rank}, not the "
                           f"{b - a} of FSDP2's dim-0 chunks")
    return ranges


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
    """A run's mechanism (DP-SGD) whose reduce is `ShardedSums`': the clipped sums
    reduce-scattered onto the shards, each shard's noise drawn by its own rank."""

    def __init__(self, mechanism, sums: ShardedSums):
        self.mechanism, self.sums = mechanism, sums

    def __getattr__(self, name: str):
        return getattr(self.mechanism, name)

    def reduce(self, engine, all_reduce_sum) -> None:
        self.sums.reduce(engine.flat_grad)

    def write_back(self, engine) -> None:
        self.sums.bind(engine.flat_grad)

    def trained(self, engine) -> Tensor:
        """The whole step's numbers, every rank's shard (a collective: every rank asks)."""
        whole = engine.flat_grad.clone()  # this rank's coordinates, zero elsewhere
        dist.all_reduce(whole)
        return whole
