"""``device=``: batches pinned and copied to an accelerator ahead of the consumer.

The stage runs on the engine's transform thread, after ``transform=``, in batch order and
inside the prefetch bound: it pins the batch's tensors (page-locked memory, so the copy is
asynchronous) and copies them to the device on a side CUDA stream of its own, then records
an event. The consumer's thread makes its current stream wait for that event when it takes
the batch (:func:`ready`), so the copy overlaps the previous step's compute and the batch is
never read before it has arrived. A device other than CUDA (``"xpu"``, ``"mps"``, ``"meta"``)
gets a plain ``batch.to(device)`` on the same thread; ``"cpu"`` is no stage at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .batch import Batch, Jagged
from .errors import ConfigError
from .transform import Transform, as_batch

#: ``batch.extra`` key of (the CUDA event marking a batch's copy done, its device): ready().
READY = "device_ready"


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
        with torch.cuda.stream(self._stream):
            moved = batch.pin_memory().to(self.device, non_blocking=True)
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
