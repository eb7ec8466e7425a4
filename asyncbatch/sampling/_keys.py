"""Keys derived from the seed: per epoch, per part of an epoch, per element of an array."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ._feistel import _splitmix64

_MASK64 = (1 << 64) - 1


def epoch_key(seed: int, epoch: int) -> int:
    """The permutation key of one epoch: a hash of (seed, epoch)."""
    _, key = _splitmix64((seed * 0x9E3779B97F4A7C15 + epoch) & _MASK64)
    return key


def derive_key(key: int, tag: int) -> int:
    """An independent key for part ``tag`` of something keyed by ``key``."""
    _, out = _splitmix64((key ^ ((tag + 1) * 0xD1B54A32D192ED03)) & _MASK64)
    return out


def mix64(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser on an array (multiplication wraps modulo 2**64 by design)."""
    z = z ^ (z >> np.uint64(30))
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z
