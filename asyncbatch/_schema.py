"""What every sample's value of one field looks like (:class:`FieldSchema`), apart from the
batch itself so that the formats' descriptions import no torch (a ``prepare`` worker loads
them and never builds a batch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FieldSchema:
    """What every sample's value of one field looks like."""

    dtype: str
    #: Shape of one sample's value; ``-1`` marks a variable-length axis.
    shape: tuple[int, ...]
    #: Values of all samples in one buffer plus offsets, rather than one dense array.
    nested: bool = False
    #: False for values that are not numbers (strings, JSON objects).
    tensor: bool = True
    #: What bytes hold where the format says so (a Hugging Face ``Image`` column:
    #: ``"image"``; ``Audio``: ``"audio"``); empty where it does not.
    media: str = ""
