"""The clipped sums of a sharded model reduced layer by layer (``training.sharding: fsdp``,
ARCHITECTURE.md §2.15): each rank keeps its own shard of every trained parameter's sum, and one
bucket of layers' full-size sums at a time.

The engine's flat layout (clipping.py's slots) still names every coordinate, but on a sharded
model it is a meta tensor: no rank holds it. Once a micro-batch's clip factors are known, for
each bucket (consecutive layers, at most `bucket_entries` numbers unless one layer alone is
larger) every rank adds its examples' clipped sums into a zeroed scratch buffer, the ranks sum
it (an in-place all-reduce on Gloo, a reduce-scatter elsewhere), and each rank adds the rows it
owns (FSDP2's dim-0 chunks) to its local buffer, then frees the scratch. Sums are linear, so
this is the unsharded sum exactly, summed over ranks micro-batch by micro-batch instead of once
a step; every rank runs as many passes (train/sharded.py's `equal_passes`), so the buckets'
collectives pair up.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from raydp_train.privacy.sharding import dim0_rows, is_sharded

BUCKET_ENTRIES = 1 << 22  # 16 MB of float32: one bucket's scratch unless a layer is larger


class Piece(NamedTuple):
    """A sharded parameter: its range in the layout, its rows' size, each rank's rows, and
    where this rank's rows lie in the local buffer."""

    param: Tensor
    start: int
    row_size: int
    rows: list[tuple[int, int]]
    local: int


class Bucket(NamedTuple):
    start: int  # [start, stop) of the layout
    stop: int
    modules: list[nn.Module]
    pieces: list[Piece]


class LayerReduction:
    """The local buffer (this rank's rows of every trained parameter, in the engine's parameter
    order) and the buckets whose full sums are reduced into it."""

    def __init__(self, bound: list[tuple[Tensor, Tensor]], layout: Tensor,
                 slots: dict[nn.Module, dict[str, Tensor]], like: Tensor,
                 in_place: bool | None = None, bucket_entries: int = BUCKET_ENTRIES):
        """`bound`: (sharded parameter, its view of `layout`); `like`: a local shard (dtype,
        device). `in_place` (default: on Gloo): sum each bucket by an in-place all-reduce
        (Gloo's reduce-scatter allocates 1.5x its input and needs a packed copy)."""
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.in_place = dist.get_backend() == "gloo" if in_place is None else in_place
        if not all(is_sharded(p) for p, _ in bound):
            raise ValueError("training.sharding: fsdp: every trained parameter must be sharded "
                             "by FSDP (a trained parameter outside every sharded module)")
        if sum(p.numel() for p, _ in bound) != layout.numel():
            raise ValueError("training.sharding: fsdp: a trained module keeps a gradient slot "
                             "that is not a parameter (no shard to reduce it onto)")
        self.layout, self.slots, self.bucket_entries = layout, slots, bucket_entries
        self.pieces, local = [], 0
        for param, view in bound:
            self.pieces.append(self._piece(param, view, local))
            local += param.to_local().numel()
        self.local = like.new_zeros(local)
        self.buckets: list[Bucket] = []
        self._modules: tuple = ()

    def _piece(self, param: Tensor, view: Tensor, local: int) -> Piece:
        rows = dim0_rows(param.shape[0], self.world_size)
        row_size = param.numel() // param.shape[0] if param.shape[0] else 0
        a, b = rows[self.rank]
        if (b - a) * row_size != param.to_local().numel():
            raise RuntimeError(f"a sharded parameter of shape {tuple(param.shape)} holds "
                               f"{param.to_local().numel()} numbers on rank {self.rank}, not "
                               f"the {(b - a) * row_size} of FSDP2's dim-0 chunks")
        start = view.storage_offset() - self.layout.storage_offset()
        return Piece(param, start, row_size, rows, local)

    def ranges(self, rank: int) -> list[tuple[int, int, int]]:
        """(layout start, layout stop, local offset on `rank`) of each parameter's rows."""
        return [(p.start + a * p.row_size, p.start + b * p.row_size, p.local)
                for p in self.pieces for a, b in [p.rows[rank]]]

    def add_clipped_sums(self, layers: list, calls: dict, clip_factors: Tensor) -> None:
        """Each bucket's clipped sums over this rank's examples, summed over the ranks and
        added to this rank's rows of the local buffer (collectives, in the same order on every
        rank). `layers`: the micro-batch's (name, module, rule), each with its `calls`."""
        rules = {module: rule for _, module, rule in layers}
        for bucket in self._buckets(rules):
            scratch = self.local.new_zeros(bucket.stop - bucket.start)
            for module in bucket.modules:
                if module in rules:
                    slots = {name: self._in(scratch, bucket, view)
                             for name, view in self.slots[module].items()}
                    rules[module].add_clipped_sum(module, calls[module], clip_factors, slots)
            self.reduce_into_local(bucket, scratch)

    def add_nothing(self) -> None:
        """An empty micro-batch: the buckets' collectives, with zeros (the other ranks')."""
        for bucket in self._buckets({}):
            self.reduce_into_local(bucket, self.local.new_zeros(bucket.stop - bucket.start))

    def reduce_into_local(self, bucket: Bucket, scratch: Tensor) -> None:
        """local[own rows] += sum over ranks of `scratch` (bucket `bucket` of the layout)."""
        pieces = [(p, p.start - bucket.start, *p.rows[w]) for p in bucket.pieces
                  for w in [self.rank]]
        if self.in_place:
            dist.all_reduce(scratch)
            for p, offset, a, b in pieces:
                n = (b - a) * p.row_size
                self.local[p.local:p.local + n] += scratch[offset + a * p.row_size:][:n]
            return
        sizes = [sum((p.rows[w][1] - p.rows[w][0]) * p.row_size for p in bucket.pieces)
                 for w in range(self.world_size)]
        send = scratch.new_zeros(self.world_size, max(sizes))
        for w in range(self.world_size):
            torch.cat([scratch[p.start - bucket.start + p.rows[w][0] * p.row_size:][
                :(p.rows[w][1] - p.rows[w][0]) * p.row_size] for p in bucket.pieces],
                out=send[w, :sizes[w]])
        own = scratch.new_empty(max(sizes))
        dist.reduce_scatter_tensor(own, send.view(-1))
        offset = 0
        for p, _, a, b in pieces:
            n = (b - a) * p.row_size
            self.local[p.local:p.local + n] += own[offset:offset + n]
            offset += n

    def whole(self, local: Tensor) -> Tensor:
        """`local` (this rank's rows) laid out as the whole layout, every rank's rows summed in
        (a collective every rank joins)."""
        whole = local.new_zeros(self.layout.numel())
        for start, stop, offset in self.ranges(self.rank):
            whole[start:stop] = local[offset:offset + stop - start]
        dist.all_reduce(whole)
        return whole

    def _in(self, scratch: Tensor, bucket: Bucket, view: Tensor) -> Tensor:
        start = view.storage_offset() - self.layout.storage_offset() - bucket.start
        return scratch[start:start + view.numel()].view(view.shape)

    def _buckets(self, rules: dict) -> list[Bucket]:
        """The buckets of the engine's current layers (the engine may take a shared path after
        its first pass): built again when the modules change."""
        modules = tuple(self.slots)
        if modules != self._modules:
            self.buckets, self._modules = self._make_buckets(), modules
        missing = [m for m in rules if self.slots.get(m) and not any(
            m in b.modules for b in self.buckets)]
        if missing:
            raise RuntimeError(f"a trained module ({type(missing[0]).__name__}) has no bucket")
        return self.buckets

    def _make_buckets(self) -> list[Bucket]:
        base = self.layout.storage_offset()
        spans = sorted(
            (min(v.storage_offset() - base for v in views.values()),
             max(v.storage_offset() - base + v.numel() for v in views.values()), i, module)
            for i, (module, views) in enumerate(self.slots.items()) if views)
        groups: list[list] = []  # [start, stop, modules]; overlapping spans (ties) merged
        for start, stop, _, module in spans:
            last = groups[-1] if groups else None
            if last and (start < last[1] or stop - last[0] <= self.bucket_entries):
                last[1], last[2] = max(last[1], stop), [*last[2], module]
            else:
                groups.append([start, stop, [module]])
        return [Bucket(a, b, modules, [p for p in self.pieces if a <= p.start < b])
                for a, b, modules in groups]


@contextmanager
def whole_sums(clipper) -> Iterator[None]:
    """The engine as if unsharded while the block runs (a full-size buffer, no collectives in
    its passes: the self-check's passes and its leave-one-out sums); then that buffer's
    clipped sums reduced onto this rank's rows. Nothing to do on an unsharded engine."""
    reduction = clipper.reduction
    if reduction is None:
        yield
        return
    local, slots = clipper.flat_grad, clipper.slots
    whole = local.new_zeros(reduction.layout.numel())
    clipper.flat_grad = clipper.layout = whole
    clipper.slots = {module: {name: reduction._in(whole, Bucket(0, 0, [], []), view)
                              for name, view in named.items()} for module, named in slots.items()}
    clipper.reduction = None
    try:
        yield
    finally:
        clipper.flat_grad, clipper.layout, clipper.slots = local, reduction.layout, slots
        clipper.reduction = reduction
    for bucket in reduction._buckets({}):
        reduction.reduce_into_local(bucket, whole[bucket.start:bucket.stop])
