"""``transform=``: a user's function from each batch to the batch delivered.

The engine calls it on its own thread (``asyncbatch-transform``), one batch at a time in
batch order, while later batches are read, so a transform that releases the GIL (a
tokenizer, a numpy or torch kernel) overlaps the reads. A batch in transform holds its
prefetch slot: at most ``prefetch`` batches are being read, transformed or waiting for the
consumer at once. The transform may return the :class:`Batch` it got (changed in place or
not), a new one, or a mapping of field names to tensors, arrays or :class:`Jagged` columns,
which becomes a ``Batch`` with the original's ``global_indexes`` and position. Whatever it
returns keeps the position (``extra["epoch"]``, ``extra["batch"]``) of the batch it got,
so ``state_dict()`` and resume count delivered batches exactly.

An exception in it ends the run with a :class:`TransformError` naming the epoch and batch,
the original exception as ``__cause__``, after every batch before it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ._batch import Batch, FieldSchema, Jagged
from ._errors import ConfigError, TransformError
from ._handoff import Final

#: What ``transform=`` accepts: a batch in, a batch or a mapping of fields out.
Transform = Callable[[Batch], "Batch | Mapping[str, Any]"]


def check_transform(transform: Transform | None) -> Transform | None:
    """``transform`` if it is None or callable; a ConfigError otherwise."""
    if transform is not None and not callable(transform):
        raise ConfigError(f"transform must be a callable taking a Batch, got {transform!r}")
    return transform


def apply_transform(transform: Transform, group: Sequence[Batch]) -> list[Batch | Final]:
    """``transform`` of each batch of ``group`` in order; at the first failure, the batches
    before it and a :class:`Final` carrying its :class:`TransformError` (the rest skipped)."""
    out: list[Batch | Final] = []
    for batch in group:
        epoch, number = batch.extra["epoch"], batch.extra["batch"]
        try:
            out.append(as_batch(transform(batch), batch, epoch, number))
        # Whatever the user's code raises (SystemExit, KeyboardInterrupt too: here they are
        # plain objects raised on a worker thread) ends the run as an error, never a hang.
        except BaseException as exc:  # noqa: BLE001
            error = TransformError(
                f"transform failed on batch {number} of epoch {epoch}: {type(exc).__name__}: {exc}",
                epoch=epoch,
                batch=number,
            )
            error.__cause__ = exc
            out.append(Final(error))
            break
    return out


def as_batch(result: Any, original: Batch, epoch: int, number: int) -> Batch:
    """``result`` as the batch to deliver in place of ``original`` (batch ``number`` of
    ``epoch``): a Batch as it is, a mapping wrapped; the position set in both cases."""
    if isinstance(result, Batch):
        result.extra = {**result.extra, "epoch": epoch, "batch": number}
        return result
    if not isinstance(result, Mapping):
        raise TypeError(
            f"the transform returned {type(result).__name__}: expected a Batch or a mapping"
            " of field names to tensors"
        )
    fields = dict(result)
    for name in fields:
        if not isinstance(name, str):
            raise TypeError(f"the transform returned a field named {name!r}: names are str")
    schema = {name: field_schema(name, value) for name, value in fields.items()}
    extra = {**original.extra, "epoch": epoch, "batch": number}
    return Batch(original.global_indexes, fields, schema, extra)


def field_schema(name: str, value: Any) -> FieldSchema:
    """The schema of a field a transform returned, from its first axis on (one row per
    sample): a tensor or array, or a jagged column."""
    if isinstance(value, Jagged):
        values = value.values
        if isinstance(values, torch.Tensor):
            return FieldSchema(_dtype_name(values.dtype), (-1, *values.shape[1:]), nested=True)
        return FieldSchema("object", (-1,), nested=True, tensor=False)
    if isinstance(value, torch.Tensor):
        return FieldSchema(_dtype_name(value.dtype), tuple(value.shape[1:]))
    if isinstance(value, np.ndarray):
        tensor = value.dtype != object
        return FieldSchema(str(value.dtype), tuple(value.shape[1:]), tensor=tensor)
    raise TypeError(
        f"the transform returned field {name!r} as {type(value).__name__}: expected a tensor,"
        " a numpy array or an asyncbatch.Jagged"
    )


def _dtype_name(dtype: torch.dtype) -> str:
    """``torch.int64`` → ``"int64"``, as the formats name dtypes."""
    return str(dtype).removeprefix("torch.")
