"""Sharded training (privacy/sharding.py) on 2 Gloo ranks in float64, a tiny Llama sharded per
decoder block by FSDP2: the clipped sum equals the unsharded engine's and the naive
per-example loop's, each coordinate gets exactly one noise draw across the ranks, the
self-check passes on the gathered weights, and a sharded step moves the weights as an
unsharded one does."""

import copy
import os
import random
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from oracles import (
    causal_lm_losses,
    engine_sum_in_parameter_order,
    naive_clipped_sum,
    padded_tokens,
)

from raydp_train.optim.updates import Adam
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.layer_reduction import whole_sums
from raydp_train.privacy.mechanism import DpSgd
from raydp_train.privacy.noise import fill_gaussian_noise_
from raydp_train.privacy.self_check import compare_with_per_example
from raydp_train.privacy.sharding import (
    ShardedMechanism,
    ShardedSums,
    shard_model,
    shard_seed,
)
from raydp_train.privacy.slow_gradients import slow_way
from raydp_train.train.step import private_step

transformers = pytest.importorskip("transformers", reason="transformers is a runtime dependency")

pytestmark = pytest.mark.slow  # starts two processes
WORLD, VOCAB, CLIP_NORM, SEED = 2, 40, 4.0, 7
# Each rank's examples: lengths (padded at the end) of its rows of one [B, 2, T] batch.
LENGTHS, TOKENS = (6, 5, 3, 2, 4, 6), 7


def tiny_llama(train_norms: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # ones at the start: make each example's gradient generic
                p.normal_(1.0, 0.3)
                p.requires_grad_(train_norms)
    return model


def spawn(check, dtype: torch.dtype = torch.float64) -> None:
    """`check(rank)` on each of 2 Gloo ranks (`dtype` the default); an assertion on either
    fails the test."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    mp.spawn(_rank, args=(check, port, dtype), nprocs=WORLD)


def _rank(rank: int, check, port: int, dtype: torch.dtype) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_default_dtype(dtype)
    torch.set_num_threads(1)
    try:
        check(rank)
    finally:
        dist.destroy_process_group()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The same rows on every rank; each rank trains on its half (`mine`)."""
    torch.manual_seed(1)
    tokens = padded_tokens(LENGTHS, TOKENS, VOCAB)
    return tokens, torch.arange(tokens.shape[0])


def mine(rank: int, tensor: torch.Tensor) -> torch.Tensor:
    per_rank = tensor.shape[0] // WORLD
    return tensor[rank * per_rank:(rank + 1) * per_rank]


def gathered(sums: ShardedSums, flat: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of the local buffer `flat`, in one full-layout vector."""
    return sums.reduction.whole(flat)


def sharded_clipper(model, noise_std: float, generator, rank: int, in_place: bool = True,
                    bucket_entries: int = 1 << 22):
    shard_model(model)
    clipper = PerExampleClipper(model, CLIP_NORM)
    clipper.reduction.in_place, clipper.reduction.bucket_entries = in_place, bucket_entries
    clipper.zero_grad()
    # No rank holds a full-size buffer: the layout is a meta tensor, the buffer its own rows.
    assert clipper.layout.is_meta
    assert clipper.flat_grad.numel() == sum(p.to_local().numel() for p in clipper.parameters)
    return clipper, ShardedSums(clipper, noise_std, generator)


def check_clipped_sums(rank: int) -> None:
    tokens, labels = batch()
    # An in-place all-reduce (Gloo's default) of one bucket, and a reduce-scatter (NCCL's)
    # of buckets of one or a few layers.
    for train_norms, naive_rtol, in_place, bucket in ((False, 1e-9, True, 1 << 22),
                                                      (True, 1e-6, False, 700)):
        # Llama's RMSNorm computes in float32 inside a float64 model: its weights' per-example
        # gradients agree with autograd's to float32 rounding (test_rms_norm_families.py).
        model = tiny_llama(train_norms)
        reference, oracle = copy.deepcopy(model), copy.deepcopy(model)
        unsharded = PerExampleClipper(reference, CLIP_NORM)
        unsharded.zero_grad()
        unsharded.accumulate(causal_lm_losses, reference, tokens, labels)
        expected, _, _ = naive_clipped_sum(oracle, causal_lm_losses, tokens, labels, CLIP_NORM)
        got = engine_sum_in_parameter_order(reference, unsharded)
        assert (got - expected).abs().max() / expected.abs().max() < naive_rtol
        clipper, sums = sharded_clipper(model, 0.0, torch.Generator(), rank, in_place, bucket)
        clipper.accumulate(causal_lm_losses, model, mine(rank, tokens), mine(rank, labels))
        assert (len(clipper.reduction.buckets) > 3) == (bucket < 1000)
        full = gathered(sums, clipper.flat_grad)  # reduced in the pass, bucket by bucket
        scale = unsharded.flat_grad.abs().max()
        assert (full - unsharded.flat_grad).abs().max() / scale < 1e-9


def check_one_draw_per_coordinate(rank: int, in_place: bool) -> None:
    std = 2.0
    generator = torch.Generator().manual_seed(shard_seed(SEED, rank))
    clipper, sums = sharded_clipper(tiny_llama(True), std, generator, rank, in_place)
    sums.NOISE_CHUNK = 100  # drawn a chunk at a time
    covered = torch.zeros(clipper.layout.shape)
    for w in range(WORLD):
        for a, b, _ in sums.reduction.ranges(w):
            covered[a:b] += 1
    assert torch.equal(covered, torch.ones_like(covered))  # each coordinate on one rank
    sums.add_noise(clipper.flat_grad)  # nothing clipped: the noise alone
    noise = gathered(sums, clipper.flat_grad)
    expected = torch.zeros_like(noise)  # rank w's draw, from its own seed, on its coordinates
    for w in range(WORLD):
        own = torch.cat([torch.arange(a, b) for a, b, _ in sums.reduction.ranges(w)])
        seeded = torch.Generator().manual_seed(shard_seed(SEED, w))
        for start in range(0, own.numel(), 100):
            draw = torch.empty(min(100, own.numel() - start))
            fill_gaussian_noise_(draw, std, seeded)
            expected[own[start:start + 100]] = draw
    assert torch.equal(noise, expected)
    # sigma C per coordinate, not sqrt(W) sigma C (within 6 standard errors of the estimate)
    assert abs(noise.std().item() / std - 1) < 6 / (2 * noise.numel()) ** 0.5
    assert shard_seed(SEED, 0) != shard_seed(SEED, 1)


def check_self_check(rank: int) -> None:
    tokens, labels = batch()
    model = tiny_llama(True)
    clipper, _ = sharded_clipper(model, 0.0, torch.Generator(), rank)
    args = (model, mine(rank, tokens), mine(rank, labels))
    with whole_sums(clipper):  # the check's passes unreduced, as unsharded
        report = compare_with_per_example(clipper, causal_lm_losses, args, examples=2,
                                          chooser=random.Random(rank))
    assert report.passed, report.message()
    stats = clipper.accumulate(causal_lm_losses, *args)
    state = torch.get_rng_state()
    slow = slow_way(clipper, causal_lm_losses, args, [0, 1, 2], (state, None))
    torch.testing.assert_close(slow.norms, stats.norms, rtol=1e-6, atol=0)


def check_step(rank: int) -> None:
    tokens, labels = batch()
    model = tiny_llama(True)
    reference = copy.deepcopy(model)
    unsharded = PerExampleClipper(reference, CLIP_NORM)
    private_step(reference, unsharded, Adam([{"params": unsharded.parameters}], lr=0.01),
                 [(tokens, labels)], causal_lm_losses, 0.0, 6.0, torch.Generator())
    clipper, sums = sharded_clipper(model, 0.0, torch.Generator(), rank)
    private_step(model, clipper, Adam([{"params": clipper.parameters}], lr=0.01),
                 [(mine(rank, tokens), mine(rank, labels))], causal_lm_losses, 0.0, 6.0,
                 torch.Generator(), mechanism=ShardedMechanism(DpSgd(), sums))
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-9, atol=1e-12,
                                   msg=name)


def check_all(rank: int) -> None:
    check_clipped_sums(rank)
    for in_place in (True, False):
        check_one_draw_per_coordinate(rank, in_place)
    check_self_check(rank)
    check_step(rank)


@pytest.mark.thorough
def test_sharded_over_two_gloo_ranks():
    """One pair of processes for every check (each start imports transformers)."""
    spawn(check_all)
