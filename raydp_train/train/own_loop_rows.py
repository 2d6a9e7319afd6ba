"""Rows and batches in a user's own loop (ARCHITECTURE.md §2.11).

A worker's rows are one structure of tensors (a tensor, a tuple, a dict, nested), every tensor
with the examples on its first axis: loaded once from a DataLoader-like iterable of batches or
a Ray Data shard (each worker draws its Poisson mask over rows it holds, as a pipeline's
worker does: ARCHITECTURE.md §2.10), sampled by index, and cut into micro-batches. The engine
and its self-check cut the rows of tensors, tuples and lists; a dict batch therefore reaches
them as the flat tuple of its tensors, and the user's loss sees the dict again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch.utils._pytree import (
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_map,
    tree_unflatten,
)

from raydp_train.train.own_loop_arguments import PrivateStepError

READ_BATCH = 4096  # rows per batch when a Ray Data shard is read into memory


def load_rows(source) -> object:
    """Every row of `source`, in memory, as one structure of tensors: a Ray Data shard
    (`ray.train.get_dataset_shard(...)`, read with `iter_torch_batches`) or any iterable of
    batches (a `torch.utils.data.DataLoader`), concatenated along the example axis."""
    batches = (source.iter_torch_batches(batch_size=READ_BATCH)
               if hasattr(source, "iter_torch_batches") else source)
    columns: list[list[Tensor]] = []
    spec = None
    for index, batch in enumerate(batches):
        leaves, this_spec = tree_flatten(batch)
        if spec is None:
            spec, columns = this_spec, [[] for _ in leaves]
        elif this_spec != spec:
            raise PrivateStepError(f"load_rows: batch {index} is laid out otherwise than batch 0 "
                                   f"({this_spec} vs {spec}); every batch must hold the same "
                                   "keys and tensors")
        for column, leaf in zip(columns, leaves, strict=True):
            column.append(torch.as_tensor(leaf))
    if spec is None:
        raise PrivateStepError("load_rows: the source yielded no batch; give each worker at "
                               "least one row (or pass an empty tensor of its rows to sample)")
    rows = tree_unflatten([torch.cat(column) for column in columns], spec)
    row_count(rows, "load_rows")
    return rows


def row_count(rows, where: str) -> int:
    """The examples of `rows`: the shared first axis of its tensors; anything else in it is
    refused by its place (`rows['text']`)."""
    if isinstance(rows, tuple) and rows and all(isinstance(part, str) for part in rows):
        raise PrivateStepError(f"{where}: got strings {rows[:3]}, the keys of a dict batch "
                               "(step(*batch) unpacks a dict's keys); pass step(batch)")
    sizes = set()
    for path, leaf in tree_flatten_with_path(rows)[0]:
        if not isinstance(leaf, Tensor) or leaf.dim() == 0:
            raise PrivateStepError(
                f"{where}: batch{keystr(path)} is a {type(leaf).__name__}, not a tensor with "
                "the examples on its first axis; pass tensors (tokenize text first)")
        sizes.add(leaf.shape[0])
    if len(sizes) != 1:
        raise PrivateStepError(f"{where}: the tensors of a batch must share their first axis, "
                               f"the examples; got sizes {sorted(sizes) or 'none (no tensor)'}")
    return sizes.pop()


def take(rows, indices: Tensor):
    """The rows at `indices`, in the structure of `rows`."""
    return tree_map(lambda tensor: tensor[indices.to(tensor.device)], rows)


def flat_micro_batches(batch: tuple, max_physical_batch: int) -> tuple[object, list[tuple]]:
    """(the batch's layout, its micro-batches as flat tuples of tensors): at most
    `max_physical_batch` examples each, none for an empty batch."""
    leaves, spec = tree_flatten(batch)
    count = leaves[0].shape[0]
    chunks = [tuple(leaf[start:start + max_physical_batch] for leaf in leaves)
              for start in range(0, count, max_physical_batch)]
    return spec, chunks


def on_layout(loss: Callable[..., Tensor], spec) -> Callable[..., Tensor]:
    """`loss(model, *batch)` called with a flat tuple of tensors put back in the layout."""

    def flat_loss(model: nn.Module, *leaves: Tensor) -> Tensor:
        return loss(model, *tree_unflatten(list(leaves), spec))

    return flat_loss


def inputs_then_labels(model: nn.Module, *batch: Tensor) -> Tensor:
    """The default loss: cross-entropy of `model(*inputs)` against the last tensor, the class
    ids; one loss per example."""
    *inputs, labels = batch
    return nn.functional.cross_entropy(model(*inputs), labels, reduction="none")


def check_default_loss(batch: Iterable) -> None:
    batch = tuple(batch)
    if len(batch) < 2 or not all(isinstance(part, Tensor) for part in batch):
        raise PrivateStepError(
            "loss: the default loss takes step(inputs..., labels), tensors, got "
            f"step({', '.join(type(part).__name__ for part in batch)}); pass "
            "loss=lambda model, batch: ... returning one loss per example [B]")
