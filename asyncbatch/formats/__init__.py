"""Formats: how a sample maps to element spans and how bytes decode into fields."""

from __future__ import annotations

from .tokens import TokenWindows as TokenWindows

__all__ = ["TokenWindows"]
