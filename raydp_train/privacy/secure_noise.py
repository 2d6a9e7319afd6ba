"""Gaussian noise for ``run.noise: secure``: a cryptographic source, floating-point robust.

torch's generator is a Mersenne Twister: predictable from its output, so not a cryptographic
source even when seeded from ``os.urandom``. And a plain float Gaussian sampler leaks through
the gaps in its set of possible outputs (Mironov 2012; Jin et al. 2021). Here:

- uniform bits come from AES-256 in counter mode (the ``cryptography`` package) keyed and
  started from ``os.urandom``: the keystream is the random stream;
- 53-bit uniforms on (0, 1] become standard normals by Box-Muller in float64;
- each entry is the Holohan & Braghin construction ("Secure Random Sampling in Differential
  Privacy", ESORICS 2021), as Opacus's ``secure_mode`` applies it with n = 2:
  ``N(0, s^2) = (1 / sqrt(2n)) * sum_{i=1}^{2n} N_i(0, s^2)``. The sum of 2n draws fills the
  gaps a single float draw leaves, so the output no longer reveals which draw produced it.

The draw is made on the CPU in float64, then cast and moved to the tensor's dtype and device.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

# n of Holohan & Braghin: each entry sums 2n Gaussian draws (Opacus uses n = 2).
HOLOHAN_BRAGHIN_N = 2
# Entries drawn at once: bounds the float64 scratch memory (2n draws of 8 bytes each).
CHUNK_ENTRIES = 1 << 20
_UNIFORM_BITS = 53


class SecureGaussian:
    """Independent ``N(0, std^2)`` entries from an AES-CTR keystream keyed by ``os.urandom``."""

    def __init__(self) -> None:
        key, counter_start = os.urandom(32), os.urandom(16)
        self._keystream = Cipher(algorithms.AES(key), modes.CTR(counter_start)).encryptor()

    @property
    def device(self) -> torch.device:
        """Where the draws are made, as ``torch.Generator.device`` says for its own."""
        return torch.device("cpu")

    def fill_(self, tensor: torch.Tensor, std: float) -> None:
        """``tensor <- N(0, std^2 I)`` in place (a contiguous tensor, e.g. the flat gradient)."""
        flat = tensor.view(-1)
        for start in range(0, flat.numel(), CHUNK_ENTRIES):
            piece = flat[start:start + CHUNK_ENTRIES]
            piece.copy_(torch.from_numpy(self.gaussians(piece.numel(), std)))

    def gaussians(self, count: int, std: float) -> np.ndarray:
        """``count`` float64 draws of N(0, std^2), each a Holohan-Braghin sum of 2n draws."""
        draws = 2 * HOLOHAN_BRAGHIN_N
        normals = self.standard_normals(draws * count).reshape(draws, count)
        return normals.sum(axis=0) * (std / math.sqrt(draws))

    def standard_normals(self, count: int) -> np.ndarray:
        """``count`` float64 N(0, 1) draws by Box-Muller: two uniforms give two normals."""
        pairs = (count + 1) // 2
        u1, u2 = self.uniforms(2 * pairs).reshape(2, pairs)
        radius = np.sqrt(-2.0 * np.log(u1))  # u1 > 0, so the log is finite
        angle = 2.0 * math.pi * u2
        return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:count]

    def uniforms(self, count: int) -> np.ndarray:
        """``count`` float64 uniforms on (0, 1]: k * 2^-53 for k in 1..2^53 from the keystream."""
        words = np.frombuffer(self._keystream.update(bytes(8 * count)), dtype=np.uint64)
        return ((words >> np.uint64(64 - _UNIFORM_BITS)) + 1).astype(np.float64) * 2.0**-_UNIFORM_BITS
