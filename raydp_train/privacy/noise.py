"""The Gaussian noise of DP-SGD (ARCHITECTURE.md §2.1-2.2): one draw of
``N(0, (sigma * C)^2 I)`` per step.

Three noise modes (``run.noise``, ``run.seed``); the run record says which one a run used:
- ``fast``: torch's Mersenne Twister seeded from ``os.urandom``. Not a cryptographic generator
  and, like any plain float Gaussian sampler, not robust to floating-point attacks (Mironov 2012).
  0.1.0 and earlier labelled this mode "secure".
- ``secure``: ``secure_noise.SecureGaussian`` (AES-CTR keystream, Holohan-Braghin sums).
- ``seeded``: torch's generator seeded by ``run.seed``: reproducible, for tests, never a release.

torch draws normal numbers on one CPU thread, and a draw over every parameter of a model is a
sizeable part of a step. A large draw on the CPU is therefore split into contiguous chunks,
one per torch thread: the step's generator fills the first chunk, and each other chunk comes
from a helper generator seeded, for this draw, by the step's generator. Every entry is still
an independent N(0, std^2) sample and a seeded run still reproduces.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import torch

from raydp_train.privacy.secure_noise import SecureGaussian

NoiseMode = Literal["fast", "secure", "seeded"]
NoiseGenerator = torch.Generator | SecureGaussian
NOISE_SOURCES: dict[str, str] = {
    "fast": "torch Mersenne Twister seeded from os.urandom; not robust to floating-point attacks",
    "secure": "AES-CTR keystream (cryptography) keyed from os.urandom; Holohan-Braghin sums of "
              "4 Box-Muller draws, robust to floating-point attacks",
    "seeded": "torch Mersenne Twister seeded by run.seed: reproducible, NOT for release",
}
# Below this many entries a draw runs on one thread (handing chunks to threads costs more).
PARALLEL_DRAW_MIN_ENTRIES = 1 << 17
_SEED_LIMIT = 1 << 62

_pool: ThreadPoolExecutor | None = None


def make_generator(
    seed: int | None, device: str | torch.device = "cpu"
) -> tuple[torch.Generator, NoiseMode]:
    """A ``torch.Generator`` on ``device`` and its mode: ``"fast"`` if ``seed`` is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.manual_seed(int.from_bytes(os.urandom(8), "little"))
        return generator, "fast"
    generator.manual_seed(seed)
    return generator, "seeded"


def make_noise_generator(
    noise: Literal["fast", "secure"], seed: int | None, device: str | torch.device = "cpu"
) -> tuple[NoiseGenerator, NoiseMode]:
    """The generator of a run's gradient noise (``run.noise``, ``run.seed``) and its mode."""
    if noise == "fast":
        return make_generator(seed, device)
    if seed is not None:  # the schema refuses this too; a seeded run cannot be secure
        raise ValueError("run.noise: secure cannot be seeded: remove run.seed")
    return SecureGaussian(), "secure"


def noise_std(noise_multiplier: float, clip_norm: float) -> float:
    """``sigma * C``: the std of the noise added to the sum of clipped gradients."""
    return noise_multiplier * clip_norm


def fill_gaussian_noise_(tensor: torch.Tensor, std: float, generator: NoiseGenerator) -> None:
    """``tensor <- N(0, std^2 I)`` in place, one draw over the whole tensor; ``std == 0``: zeros.

    A step starts its gradient sum from the noise and adds the clipped gradients onto it:
    the same sum as adding the noise afterwards, without a second buffer or pass.
    """
    if not std >= 0.0:
        raise ValueError(f"noise std must be >= 0, got {std}")
    if std == 0.0:
        tensor.zero_()
        return
    if isinstance(generator, SecureGaussian):
        generator.fill_(tensor, std)
        return
    chunks = _draw_chunks(tensor)
    if len(chunks) == 1:
        tensor.normal_(mean=0.0, std=std, generator=generator)
        return
    seeds = torch.randint(_SEED_LIMIT, (len(chunks) - 1,), generator=generator).tolist()
    helpers = [torch.Generator().manual_seed(seed) for seed in seeds]
    pending = [_thread_pool().submit(chunk.normal_, mean=0.0, std=std, generator=helper)
               for chunk, helper in zip(chunks[1:], helpers, strict=True)]
    chunks[0].normal_(mean=0.0, std=std, generator=generator)
    for done in pending:
        done.result()


def _draw_chunks(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The tensor as contiguous pieces, one per torch thread for a large CPU tensor."""
    threads = torch.get_num_threads()
    if (tensor.device.type != "cpu" or not tensor.is_contiguous() or threads < 2
            or tensor.numel() < PARALLEL_DRAW_MIN_ENTRIES):
        return [tensor]
    return list(tensor.view(-1).chunk(threads))


def _thread_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1),
                                   thread_name_prefix="noise")
    return _pool
