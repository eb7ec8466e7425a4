"""``device=``: batches copied to an accelerator ahead of the consumer.

The stage runs on the engine's transform thread, after ``transform=``, in batch order and
inside the prefetch bound. On CUDA it issues each tensor's copy with ``non_blocking=True`` on
a side stream of its own and records an event; the consumer's thread makes its current
stream wait for that event when it takes the batch (:func:`ready`), so the copy overlaps the
consumer's work and the batch is never read before it has arrived.

The copy reads the batch's own memory, which is pageable: CUDA stages it through a pinned
buffer of the driver's and returns once the source has been read (the runtime's "API
synchronization behavior": for pageable host to device memory, the call "will return once
the pageable buffer has been copied to the staging memory"), so the engine may fill that
memory with a later batch as soon as the call returns. Pinning the batch first is one more
CPU copy on this thread, and costs more than the faster DMA saves at the sizes measured,
64 KiB to 16 MiB a tensor (docs/benchmarks.md). A tensor the user's transform pinned is
copied as it is: a plain DMA, its block kept by torch's caching host allocator until the
copy is done.

A device other than CUDA (``"xpu"``, ``"mps"``, ``"meta"``) gets a plain ``batch.to(device)``
on the same thread; ``"cpu"`` is no stage at all.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch

from ._batch import Batch, Jagged
from ._errors import ConfigError
from ._transform import Transform, as_batch

#: ``batch.extra`` key of (the CUDA event marking a batch's copy done, its device): ready().
READY = "device_ready"

#: The stream the current thread was last switched to by a :class:`ToDevice` (thread-local:
#: each loader's transform thread, kept across its runs, starts on its default stream).
_switched = threading.local()


def device_of(device: torch.device | str | None) -> torch.device | None:
    """``device`` as a torch.device, None for none or the CPU; a ConfigError for a device
    this process cannot use."""
    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device={device!r}: not a torch device ({exc})") from None
    if resolved.type == "cpu":
        return None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device={device!r}, but torch.cuda.is_available() is False (a CPU build of torch,"
            " or no GPU visible); leave device=None to get batches on the CPU"
        )
    return resolved


class ToDevice:
    """The transform the engine runs when ``device=`` is set: the user's ``transform`` (if
    any), then the copy to ``device``."""

    def __init__(self, device: torch.device, transform: Transform | None = None) -> None:
        self.device = device
        self.transform = transform
        self._stream: Any = None  # the side stream, made on the transform thread's first call

    def __call__(self, batch: Batch) -> Batch:
        epoch, number = batch.extra["epoch"], batch.extra["batch"]
        if self.transform is not None:
            batch = as_batch(self.transform(batch), batch, epoch, number)
        if self.device.type != "cuda":
            return batch.to(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        if self.transform is not None:
            # The user's transform keeps the thread's own stream: switch around the copy only.
            with torch.cuda.stream(self._stream):
                return self._copy(batch)
        # Nothing else runs on this thread: it stays on the side stream for the whole run
        # (a switch per batch, about 10 µs, costs as much as copying 64 KiB).
        if getattr(_switched, "stream", None) is not self._stream:
            torch.cuda.set_stream(self._stream)
            _switched.stream = self._stream
        return self._copy(batch)

    def _copy(self, batch: Batch) -> Batch:
        """``batch`` copied on the side stream (current here), an event recorded after it."""
        moved = batch.to(self.device, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        moved.extra[READY] = (event, self.device)
        return moved

    def __getstate__(self) -> dict[str, Any]:
        return {"device": self.device, "transform": self.transform, "_stream": None}


def ready(batch: Batch) -> Batch:
    """Make the calling thread's current CUDA stream wait for ``batch``'s copy, and tell the
    caching allocator that stream uses its tensors; a batch without a copy as it is."""
    copied = batch.extra.pop(READY, None)
    if copied is None:
        return batch
    event, device = copied
    stream = torch.cuda.current_stream(device)
    stream.wait_event(event)
    for value in batch.fields.values():
        for tensor in _tensors(value):
            if tensor.is_cuda:
                tensor.record_stream(stream)
    return batch


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Jagged):
        return [t for t in (value.values, value.offsets) if isinstance(t, torch.Tensor)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    return []
