"""Sample order: pure functions of (seed, epoch, rank, world size, position)."""

from __future__ import annotations

from ._feistel import FeistelPermutation as FeistelPermutation

__all__ = ["FeistelPermutation"]
