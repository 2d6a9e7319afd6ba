"""A model whose unsharded private step does not fit a per-worker memory limit trains sharded
(training.sharding: fsdp) on 2 Gloo ranks under that limit, with the exact clipped sums.

Each rank limits its own data segment (RLIMIT_DATA: every private writable mapping, so the
heap and torch's large mmap'ed blocks alike) to LIMIT_MB above what it holds after its
imports; an allocation past it fails (torch: "can't allocate memory"). Under the limit, the
sharded private step (clipped sums reduced onto the shards, each rank's rows only) runs; the
unsharded one (the whole model and a whole clipped-sum buffer on the worker) fails. The limit
lifted, the sharded sum is checked against the unsharded engine in float64 (relative 1e-9),
and that against the naive per-example loop (1e-6: Llama's RMSNorm computes in float32). Weights are drawn parameter by parameter from seeds of their names,
so the sharded model (built on the meta device, its rows filled in place) and the unsharded one
start equal without a whole copy ever on a sharded rank.
"""

import gc
import hashlib
import resource

import pytest
import torch
import torch.distributed as dist
from oracles import causal_lm_losses, engine_sum_in_parameter_order, naive_clipped_sum
from test_sharding import CLIP_NORM, spawn, tiny_llama

from raydp_train.optim.updates import SGD
from raydp_train.privacy.clipping import PerExampleClipper
from raydp_train.privacy.mechanism import DpSgd
from raydp_train.privacy.sharding import ShardedMechanism, ShardedSums, dim0_rows, shard_model
from raydp_train.train.step import private_step

transformers = pytest.importorskip("transformers", reason="transformers is a runtime dependency")

pytestmark = pytest.mark.slow  # starts two processes
# 19.6M parameters, 157 MB in float64: unsharded, the weights and the clipped-sum buffer alone
# are 314 MB; sharded over 2, each rank's rows of both are 157 MB, and a block gathered 19 MB.
HIDDEN, LAYERS, VOCAB, TOKENS = 384, 8, 1000, 8
LIMIT_MB = 270


def config():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=TOKENS)
    config._attn_implementation = "eager"
    return config


def weights_of(name: str, shape: torch.Size) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02
    return values + 1.0 if "norm" in name else values


def whole_model() -> torch.nn.Module:
    model = transformers.LlamaForCausalLM(config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights_of(name, param.shape))
    return model


def sharded_model() -> torch.nn.Module:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config())
    shard_model(model)
    model.to_empty(device="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            a, b = dim0_rows(param.shape[0], world)[rank]
            param.to_local().copy_(weights_of(name, param.shape)[a:b])  # one parameter at a time
    model.model.rotary_emb = type(model.model.rotary_emb)(config())  # its buffers, computed
    return model


def tokens() -> torch.Tensor:
    """[4, 2, T]: ids and a full attention mask; rank w trains on rows 2w, 2w+1."""
    ids = torch.randint(1, VOCAB, (4, TOKENS), generator=torch.Generator().manual_seed(3))
    return torch.stack([ids, torch.ones_like(ids)], dim=1)


def private_sgd_step(model, clipper, rows, mechanism=None) -> None:
    """One DP-SGD step, noise 0, plain SGD (no optimizer state): the clipped sum / B."""
    extra = {} if mechanism is None else {"mechanism": mechanism}
    private_step(model, clipper, SGD([{"params": clipper.parameters}], lr=0.0), [(rows, None)],
                 causal_lm_losses, 0.0, 4.0, torch.Generator(), **extra)


def warm_up() -> None:
    """One sharded private step of a tiny Llama: what the first one imports and allocates
    once (DTensor, FSDP, the engine's rules) is the process's own cost, before the limit."""
    model = tiny_llama(True)
    shard_model(model)
    clipper = PerExampleClipper(model, CLIP_NORM)
    mechanism = ShardedMechanism(DpSgd(), ShardedSums(clipper, 0.0, torch.Generator()))
    tiny = torch.ones(1, 2, 4, dtype=torch.long)
    private_sgd_step(model, clipper, tiny, mechanism)
    clipper.close()
    del model, clipper, mechanism
    gc.collect()


def data_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmData:"))
    return int(line.split()[1]) / 1024


def unsharded_fails(rows: torch.Tensor) -> str:
    """The unsharded private step (what each worker holds unsharded) under the limit: the
    error it fails with ("" if it ran)."""
    try:
        whole = whole_model()
        private_sgd_step(whole, PerExampleClipper(whole, CLIP_NORM), rows)
    except (RuntimeError, MemoryError) as error:
        return f"{type(error).__name__}: {error}"
    return ""


def check_limited(rank: int) -> None:
    rows = tokens()[2 * rank:2 * rank + 2]
    warm_up()
    base = data_mb()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (int((base + LIMIT_MB) * 2**20), hard))
    try:
        failure = unsharded_fails(rows)
        gc.collect()
        assert data_mb() < base + 16  # what the failed step held is given back
        model = sharded_model()
        clipper = PerExampleClipper(model, CLIP_NORM)
        sums = ShardedSums(clipper, 0.0, torch.Generator())
        private_sgd_step(model, clipper, rows, ShardedMechanism(DpSgd(), sums))
        local = clipper.flat_grad.clone()
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    assert "can't allocate memory" in failure or failure.startswith("MemoryError"), failure
    sharded_sum = sums.reduction.whole(local) * 4.0  # private_step divided by B
    if rank == 0:
        reference = whole_model()
        unsharded = PerExampleClipper(reference, CLIP_NORM)
        unsharded.zero_grad()
        unsharded.accumulate(causal_lm_losses, reference, tokens(), None)
        assert (sharded_sum - unsharded.flat_grad).abs().max() / sharded_sum.abs().max() < 1e-9
        expected, _, _ = naive_clipped_sum(whole_model(), causal_lm_losses, tokens(),
                                           torch.arange(4), CLIP_NORM)
        got = engine_sum_in_parameter_order(reference, unsharded)
        # Llama's RMSNorm computes in float32: its weights' per-example gradients agree with
        # autograd's to float32 rounding (test_sharding.py, test_rms_norm_families.py).
        assert (got - expected).abs().max() / expected.abs().max() < 1e-6
    dist.barrier()


def test_sharded_fits_a_limit_the_unsharded_step_exceeds(monkeypatch):
    # glibc returns freed large blocks at once, so the limit meets what is live
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    spawn(check_limited)
