"""Peak resident memory per worker of private and non-private training of a Llama config,
whole on every worker vs sharded by FSDP2 (training.sharding: fsdp), W Gloo processes on CPU.

Each configuration runs in fresh processes: W ranks build the model (sharded ones on the meta
device, then materialized shard by shard, as a sharded model too big for one worker must be),
take `--steps` steps of `--batch` sequences each, and report their peak RSS minus the RSS
after imports (the process's own cost: Python, torch, transformers). Private: DP-SGD through
the engine (clipped sums reduced layer by layer onto the shards, each rank's shard noise;
whole: all-reduce, rank-0 noise). Non-private: a plain backward, FSDP's own reduce-scatter (sharded) or an all-reduce.

glibc keeps freed blocks of a few MB in its heap (its mmap threshold grows after each free),
so RSS counted what FSDP had gathered and freed block after block: a sharded non-private
step's peak was 907 MB with glibc's default and 471 MB with MALLOC_MMAP_THRESHOLD_=65536
(42M parameters). The ranks start with that setting (`--mmap-threshold 0`: glibc's default),
so RSS measures what is live.

    python benchmarks/sharded_memory.py --hidden 512 --layers 8 --workers 2
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import resource
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = ("whole-private", "sharded-private", "whole-nonprivate", "sharded-nonprivate")
OPACUS_MODES = ("opacus-whole", "opacus-sharded")  # ghost clipping; FSDP2Wrapper + ghost_fsdp


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def build(args, sharded: bool):
    import transformers

    from raydp_train.privacy.sharding import shard_model

    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
        max_position_embeddings=args.tokens)
    config._attn_implementation = "eager"
    if not sharded:
        return transformers.LlamaForCausalLM(config)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    shard_model(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(0.0, 0.02)
    model.model.rotary_emb = type(model.model.rotary_emb)(config)  # its buffers, computed
    return model


def losses(model, tokens, labels=None):
    log_probs = model(tokens).logits.log_softmax(-1)[:, :-1]
    return -log_probs.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1).sum(1)


def steps(args, mode: str, model, rank: int, world: int) -> None:
    from raydp_train.optim.updates import Adam
    from raydp_train.privacy.clipping import PerExampleClipper
    from raydp_train.privacy.mechanism import DpSgd
    from raydp_train.privacy.sharding import ShardedMechanism, ShardedSums
    from raydp_train.train.step import private_step

    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randint(args.vocab, (args.batch, args.tokens), generator=generator)
               for _ in range(args.steps)]
    if mode.endswith("nonprivate"):
        optimizer = Adam([{"params": list(model.parameters())}], lr=1e-4)
        for tokens in batches:
            losses(model, tokens).sum().backward()  # FSDP reduce-scatters (sharded)
            if mode.startswith("whole"):
                for p in model.parameters():
                    dist.all_reduce(p.grad)
            optimizer.step()
            for p in model.parameters():
                p.grad = None
        return
    clipper = PerExampleClipper(model, 1.0)
    mechanism, std = DpSgd(), (1.0 if rank == 0 else 0.0)
    if mode.startswith("sharded"):
        sums = ShardedSums(clipper, 1.0, generator)
        mechanism, std = ShardedMechanism(mechanism, sums), 0.0
    optimizer = Adam([{"params": clipper.parameters}], lr=1e-4)
    for tokens in batches:
        private_step(model, clipper, optimizer, [(tokens, None)], losses, std,
                     float(args.batch * world), generator, dist.all_reduce, mechanism)


def opacus_steps(args, mode: str, model, rank: int) -> None:
    """Opacus 1.6 beside: ghost clipping (whole), FSDP2Wrapper with ghost_fsdp (sharded)."""
    from opacus import PrivacyEngine
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    if mode == "opacus-sharded":
        model = FSDP2Wrapper(model)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(args.vocab, (args.batch * args.steps, args.tokens), generator=generator)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, optimizer, criterion, loader = PrivacyEngine().make_private(
        module=model, optimizer=optimizer, data_loader=loader, criterion=torch.nn.CrossEntropyLoss(),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=(
            "ghost_fsdp" if mode == "opacus-sharded" else "ghost"), poisson_sampling=False)
    for inputs, targets in loader:
        logits = model(inputs).logits
        loss = criterion(logits.reshape(-1, args.vocab), targets.reshape(-1),
                         shape=logits.shape)  # per sequence (Opacus's unit for LMs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def data_mb() -> float:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("VmData:")).split()[1]) / 1024


def rank_main(rank: int, args, mode: str, port: int, out: str) -> None:
    """One rank: peak RSS over the imports' (and with `--limit-mb`, whether it fit a data
    segment limited to that much above them: RLIMIT_DATA refuses an allocation past it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.workers,
                            timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    for module in ("torch.distributed.fsdp", "torch.distributed.tensor"):  # the first use's
        importlib.import_module(module)
    import transformers  # noqa: F401  (its import is the process's own cost)

    import raydp_train.privacy.clipping  # noqa: F401

    base, result = rss_mb(), {"fits": True}
    if args.limit_mb:
        limit = int((data_mb() + args.limit_mb) * 2**20)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    try:
        model = build(args, mode.startswith("sharded"))
        result["parameters"] = sum(p.numel() for p in model.parameters())
        if mode.startswith("opacus"):
            opacus_steps(args, mode, model, rank)
        else:
            steps(args, mode, model, rank, args.workers)
        dist.barrier()
    except Exception as error:  # noqa: BLE001 -- over the limit, or a peer that was
        result = {"fits": False, "error": f"{type(error).__name__}: {error}"[:400]}
    result["peak_mb"] = round(peak_mb() - base, 1)
    with open(f"{out}.{rank}", "w") as file:
        json.dump(result, file)
    if not result["fits"]:
        os._exit(0)  # a peer may be stuck in a collective: no orderly teardown
    dist.destroy_process_group()


def measure(args, mode: str) -> dict:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    out = f"/tmp/sharded_memory_{os.getpid()}_{mode}"
    mp.spawn(rank_main, args=(args, mode, port, out), nprocs=args.workers)
    ranks = []
    for rank in range(args.workers):
        written = Path(f"{out}.{rank}")
        ranks.append(json.loads(written.read_text()))
        written.unlink()
    failed = [r["error"] for r in ranks if not r["fits"]]
    return {"mode": mode, "parameters": ranks[0].get("parameters"), "fits": not failed,
            "peak_mb_per_worker": max(r["peak_mb"] for r in ranks),
            **({"error": failed[0]} if failed else {})}


def run_arguments(parser: argparse.ArgumentParser, layers: int, vocab: int) -> None:
    """The model's and the run's arguments (shared with largest_model.py)."""
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--vocab", type=int, default=vocab)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mmap-threshold", type=int, default=65536)


def start(args) -> None:
    if args.mmap_threshold:  # read by glibc when each spawned rank starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    run_arguments(parser, layers=8, vocab=8000)
    parser.add_argument("--modes", nargs="*", default=list(MODES),
                        choices=[*MODES, *OPACUS_MODES])
    parser.add_argument("--limit-mb", type=int, default=0,
                        help="each rank's data segment limit over its imports' (0: none)")
    args = parser.parse_args()
    start(args)
    for mode in args.modes:
        print(json.dumps({**measure(args, mode), "workers": args.workers,
                          "hidden": args.hidden, "layers": args.layers}), flush=True)


if __name__ == "__main__":
    main()
