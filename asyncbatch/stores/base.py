"""The store protocols: the only contract between the engine and I/O.

Two layers meet here. A *transport* (an adapter: the built-in local, S3, HTTP and fsspec
ones, or a third party's) implements small capability protocols, obspec style. A read-only
transport needs two methods: :class:`GetsRanges` (``get_ranges``: bytes of ranges of one
object) and :class:`Versioned` (``stat``: the object's size and version). Optional
capabilities are protocols of their own, detected by type (``isinstance``), never looked up
by name: :class:`ReadsRanges` (into caller-given buffers), :class:`ResumesRanges` (one
attempt at one range into a buffer, resuming a broken body, sending and reporting versions:
the stack then retries each range and compares every answer with the pin),
:class:`GetsVersionedRanges` (``get_ranges`` with the version the bytes came from),
:class:`ReadsInto` (many ranges of
many objects into one buffer: the engine's fast path), :class:`ReadsIntoConverted` (the
same, widening each element to the output dtype as it copies), :class:`Lists`, :class:`Writes`,
:class:`Closes`, :class:`Coalesces` (a gap below which neighbouring ranges are cheaper read
as one), :class:`Discards` (a cache forgetting bytes), :class:`Unbounded` (calls the stack
does not time),
:class:`ReadsTail` (an object's last bytes with its size and version, in one request:
:func:`fetch_tail` uses it, or a ``stat`` and a ranged read without it) and
:class:`ListsInfo` (a listing with sizes and versions).

The registry stacks wrappers over a transport (``stores/stack.py``: exact lengths, typed
errors, version pinning, retries and timeouts; then counting and the node-local cache), and
the engine sees :class:`Store`, which every wrapper implements. Ranges are ``[start, end)``
with exclusive ends. A store never completes a read with fewer bytes than asked for: it
raises :class:`~asyncbatch.errors.ShortReadError` naming the URL and range instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..errors import ShortReadError, describe_range

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from ..layout import ShardMap

Buffer = memoryview
#: (stored dtype, output dtype) of a converting read.
Conversion = tuple["np.dtype[Any]", "np.dtype[Any]"]


@runtime_checkable
class Store(Protocol):
    """An async byte-range store bound to the event loop that created it."""

    #: Gap in bytes below which two ranges of one object are cheaper read as one.
    coalesce_gap: int

    async def size(self, url: str) -> int:
        """Size of the object at ``url`` in bytes."""
        ...

    async def list(self, url: str) -> list[str]:
        """URLs of the objects directly under the prefix ``url``, sorted."""
        ...

    async def read_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], buffers: Sequence[Buffer]
    ) -> None:
        """Fill ``buffers[i]`` with bytes ``[starts[i], ends[i])`` of ``url``, all or raise."""
        ...

    async def write(self, url: str, data: Buffer | bytes) -> None:
        """Write ``data`` as the whole object at ``url``, creating parents as needed."""
        ...

    async def close(self) -> None:
        """Release sessions and file descriptors; idempotent."""
        ...


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """An object's size and version: the ETag or file identity its store pins (None when
    the store cannot tell one version from another)."""

    size: int
    version: str | None


@runtime_checkable
class GetsRanges(Protocol):
    """A transport that returns the bytes of ranges of one object."""

    async def get_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int]
    ) -> Sequence[bytes | memoryview]:
        """Bytes ``[starts[i], ends[i])`` of ``url``, one buffer per range. A range past the
        end may come back short: the stack checks every length."""
        ...


@runtime_checkable
class ReadsRanges(Protocol):
    """A transport that fills caller-given buffers itself (all or raise)."""

    async def read_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], buffers: Sequence[Buffer]
    ) -> None:
        """Fill ``buffers[i]`` with bytes ``[starts[i], ends[i])`` of ``url``, all or raise."""
        ...


@runtime_checkable
class Lists(Protocol):
    """A transport that lists a prefix."""

    async def list(self, url: str) -> list[str]:
        """URLs of the objects directly under the prefix ``url``, sorted."""
        ...


@runtime_checkable
class Writes(Protocol):
    """A transport that writes whole objects."""

    async def write(self, url: str, data: Buffer | bytes) -> None:
        """Write ``data`` as the whole object at ``url``, creating parents as needed."""
        ...


@runtime_checkable
class Closes(Protocol):
    """A transport holding sessions, threads or descriptors to release."""

    async def close(self) -> None:
        """Release what the transport holds; idempotent."""
        ...


@runtime_checkable
class Coalesces(Protocol):
    """A transport that knows its own coalescing gap (the stack picks one otherwise)."""

    #: Gap in bytes below which two ranges of one object are cheaper read as one.
    coalesce_gap: int


@dataclass
class Progress:
    """How far one range has got, kept across the attempts at it: ``got`` bytes received
    (``buffer[:got]`` holds them), ``version`` the version the answer they came in told
    (None until one did, or if the system tells none)."""

    got: int = 0
    version: str | None = None


@runtime_checkable
class ResumesRanges(Protocol):
    """A transport that makes one attempt at one range into a buffer, resuming where an
    earlier attempt stopped, and knows versions (HTTP's and S3's ``If-Match`` and ETag).

    The stack keeps one :class:`Progress` per range across its attempts, so a body that
    breaks off is asked again only for its missing tail. Such a transport bounds each phase
    of its request itself (connect, first byte, idle pauses in the body): the stack puts no
    bound on the whole call, so a slow body that keeps moving is never cut.
    """

    async def read_range(
        self,
        url: str,
        *,
        start: int,
        end: int,
        buffer: Buffer,
        progress: Progress,
        version: str | None,
    ) -> None:
        """Fill ``buffer[progress.got:]`` with bytes ``[start + progress.got, end)`` of
        ``url``, advancing ``progress.got`` as bytes land; set ``progress.version`` to the
        version the answer tells as soon as its headers arrive (before the body). Send
        ``version`` (the pinned one), when given, as a precondition (``If-Match``): an
        object that no longer has it is a :class:`~asyncbatch.errors.ShardChangedError`."""
        ...


@runtime_checkable
class GetsVersionedRanges(Protocol):
    """A transport whose ranged reads tell the version they were read from (used in place of
    :class:`GetsRanges`): the stack compares it with the pin, so a replaced object is a
    :class:`~asyncbatch.errors.ShardChangedError`, never mixed bytes."""

    async def get_versioned_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], version: str | None
    ) -> tuple[Sequence[bytes | memoryview], str | None]:
        """``get_ranges``, with ``version`` (the pinned one), when given, sent as a
        precondition; returns the buffers and the version they came from (None if unknown)."""
        ...


class Unbounded:
    """Base of a transport whose calls the stack runs with no time bound (the local store):
    they run in threads that no timeout can stop, and a large group read from a slow
    filesystem is slow, not stalled."""


@runtime_checkable
class ReadsInto(Protocol):
    """A store that reads many ranges of many objects into one caller's buffer at once."""

    async def read_into(
        self,
        urls: Sequence[str],
        which: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        ends: npt.NDArray[np.int64],
        dest: npt.NDArray[np.uint8],
        dest_offsets: npt.NDArray[np.int64],
    ) -> None:
        """Read ``[starts[i], ends[i])`` of ``urls[which[i]]`` into ``dest[dest_offsets[i]:]``,
        all or raise."""
        ...


@runtime_checkable
class ReadsIntoConverted(Protocol):
    """A store that reads into one buffer and converts the elements as it copies them."""

    async def read_into_converted(
        self,
        urls: Sequence[str],
        which: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        ends: npt.NDArray[np.int64],
        dest: npt.NDArray[np.uint8],
        dest_offsets: npt.NDArray[np.int64],
        convert: Conversion,
    ) -> None:
        """``read_into``, with the elements of ``convert[0]`` in each range written to
        ``dest`` as ``convert[1]`` (a safe cast): ``starts`` and ``ends`` count stored bytes,
        ``dest_offsets`` bytes of ``dest``."""
        ...


@runtime_checkable
class ReadsWindows(Protocol):
    """A store that plans and copies fixed windows of a dataset's element stream itself, in
    one call per group (local mapped files: no per-read arrays, no Python per window)."""

    async def read_windows(
        self,
        urls: Sequence[str],
        layout: ShardMap,
        starts: npt.NDArray[np.int64],
        window: int,
        dest: npt.NDArray[np.uint8],
        convert: Conversion | None = None,
    ) -> bool:
        """Copy elements ``[starts[i], starts[i] + window)`` of the concatenation of the
        shards ``urls`` (laid out as ``layout`` says; a window may cross shard ends) to
        ``dest[i * window * size:]``, ``size`` the output element's (``convert``: stored
        dtype, output dtype, a safe cast made in the copy). False when it cannot here
        (files it does not map, too many at once, a conversion it lacks): the caller then
        plans byte ranges for all of them and reads those into ``dest`` instead."""
        ...


@runtime_checkable
class Versioned(Protocol):
    """A store that tells an object's version along with its size."""

    async def stat(self, url: str) -> ObjectInfo:
        """Size and version of ``url``; pins the object at that version as ``size`` does."""
        ...


@runtime_checkable
class Discards(Protocol):
    """A store that keeps copies of bytes (a cache) and can forget them."""

    async def discard(self, url: str, start: int, end: int) -> None:
        """Forget any copy of bytes ``[start, end)`` of ``url``; the next read fetches them."""
        ...


@runtime_checkable
class ReadsTail(Protocol):
    """A store that reads an object's last bytes and learns its size and version at once
    (one suffix request: S3's and HTTP's ``Range: bytes=-N``, a local ``fstat`` + ``pread``)."""

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        """The last ``min(length, size)`` bytes of ``url``, with its size and version; pins
        the object at that version as ``stat`` does."""
        ...


@runtime_checkable
class ListsInfo(Protocol):
    """A store whose listing tells each object's size and version (S3's does), so that a
    format reading every object's tail after listing them needs no ``stat`` or suffix."""

    async def list_info(self, url: str) -> list[tuple[str, ObjectInfo | None]]:
        """``(URL, size and version)`` of the entries directly under the prefix ``url``,
        sorted; None for a folder. Pins each object at its version as ``stat`` does."""
        ...


async def list_with_info(store: Store, url: str) -> list[tuple[str, ObjectInfo | None]]:
    """The listing of ``url`` with sizes and versions where the store's listing tells them
    (:class:`ListsInfo`), else its plain listing with None for every entry."""
    if isinstance(store, ListsInfo):
        return await store.list_info(url)
    return [(name, None) for name in await store.list(url)]


async def fetch_tail(store: Store, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
    """The last ``min(length, size)`` bytes of ``url`` with its size and version: one
    request where the store offers :class:`ReadsTail`, else :func:`tail_by_stat`."""
    if isinstance(store, ReadsTail):
        return await store.read_tail(url, length)
    return await tail_by_stat(store, url, length)


async def tail_by_stat(
    store: Store, url: str, length: int, info: ObjectInfo | None = None
) -> tuple[bytearray, ObjectInfo]:
    """What :func:`fetch_tail` returns, in two requests: the size and version (unless given
    as ``info``), then a range."""
    if info is None and isinstance(store, Versioned):
        info = await store.stat(url)
    elif info is None:
        info = ObjectInfo(await store.size(url), None)
    count = max(0, min(length, info.size))
    tail = bytearray(count)
    if count:
        start = info.size - count
        await store.read_ranges(url, starts=[start], ends=[info.size], buffers=[memoryview(tail)])
    return tail, info


def check_length(url: str, start: int, end: int, got: int) -> None:
    """Raise :class:`ShortReadError` unless a read of ``[start, end)`` returned all its bytes."""
    if got != end - start:
        raise ShortReadError(
            f"short read: {describe_range(url, start, end)} returned {got} of {end - start} bytes",
            url,
            start,
            end,
        )
