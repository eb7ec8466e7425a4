"""A keyed pseudo-random permutation of ``range(size)`` in O(1) memory.

A balanced Feistel network over the smallest even number of bits covering ``size``, with
cycle walking to stay inside ``range(size)``. Every operation is integer arithmetic on
``uint64`` arrays (multiplication wraps modulo 2**64 by design), so a whole array of
positions is permuted per call and any size from 1 to 2**63 - 1 works.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError

ROUNDS = 4
_MASK64 = (1 << 64) - 1


def _splitmix64(state: int) -> tuple[int, int]:
    """One step of splitmix64 on Python ints: (next state, output)."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


class FeistelPermutation:
    """Bijection of ``range(size)`` keyed by ``seed``; call it on an int64 array.

    ``perm(np.arange(size))`` is a permutation of ``range(size)``; ``perm.inverse(perm(x))``
    returns ``x``. Different seeds give independent permutations.
    """

    def __init__(self, size: int, seed: int) -> None:
        size = int(size)
        if not 1 <= size < 1 << 63:
            raise ConfigError(f"permutation size must be in [1, 2**63), got {size}")
        self.size = size
        self.seed = int(seed)
        bits = max(2, (size - 1).bit_length())
        bits += bits & 1
        self._half = bits // 2
        self._half_mask = np.uint64((1 << self._half) - 1)
        self._shift = np.uint64(self._half)
        # The round function keeps the top `half` bits of a 64-bit multiply-add hash
        # (multiply-shift hashing: its high bits are the well-mixed ones).
        self._out_shift = np.uint64(64 - self._half)
        state = self.seed & _MASK64
        multipliers, addends = [], []
        for _ in range(ROUNDS):
            state, m = _splitmix64(state)
            state, a = _splitmix64(state)
            multipliers.append(np.uint64(m | 1))
            addends.append(np.uint64(a))
        self._rounds = list(zip(multipliers, addends, strict=True))

    def _round(
        self, right: npt.NDArray[np.uint64], m: np.uint64, a: np.uint64
    ) -> npt.NDArray[np.uint64]:
        out = right * m
        out += a
        out >>= self._out_shift
        return out

    def _forward(self, x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        left = x >> self._shift
        right = x & self._half_mask
        for m, a in self._rounds:
            left ^= self._round(right, m, a)
            left, right = right, left
        left <<= self._shift
        left |= right
        return left

    def _backward(self, x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        left = x >> self._shift
        right = x & self._half_mask
        for m, a in reversed(self._rounds):
            left, right = right, left
            left ^= self._round(right, m, a)
        left <<= self._shift
        left |= right
        return left

    def _walk(self, positions: npt.ArrayLike, step: str) -> npt.NDArray[np.int64]:
        x = np.asarray(positions, dtype=np.int64)
        if x.size and (int(x.min()) < 0 or int(x.max()) >= self.size):
            raise ConfigError(f"positions must lie in [0, {self.size})")
        apply = self._forward if step == "forward" else self._backward
        out = apply(x.astype(np.uint64))
        # Cycle walking: re-apply until inside range(size). The domain is < 4 * size, so
        # few rounds are needed, and each one only touches the values still outside.
        limit = np.uint64(self.size)
        outside = np.flatnonzero(out >= limit)
        while outside.size:
            again = apply(out[outside])
            out[outside] = again
            outside = outside[again >= limit]
        return out.astype(np.int64)

    def __call__(self, positions: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Permuted values of ``positions`` (each in ``[0, size)``)."""
        return self._walk(positions, "forward")

    def inverse(self, values: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Positions whose permuted values are ``values``."""
        return self._walk(values, "backward")

    def __repr__(self) -> str:
        return f"FeistelPermutation(size={self.size}, seed={self.seed})"
