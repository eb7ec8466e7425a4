"""The store protocols: the only contract between the engine and I/O.

Two layers meet here. A *transport* (an adapter: the built-in local, S3, HTTP and fsspec
ones, or a third party's) implements a few methods, obspec style. A read-only transport
needs two: ``get_ranges`` (:class:`GetsRanges`: bytes of ranges of one object) and ``stat``
(:class:`Versioned`: the object's size and version). It may read in other ways instead
(:class:`ReadsRanges`: into caller-given buffers; :class:`ResumesRanges`: one attempt at one
range into a buffer, resuming a broken body, sending and reporting versions, so the stack
retries each range and compares every answer with the pin; :class:`GetsVersionedRanges`:
``get_ranges`` telling the version the bytes came from), and offer more: ``read_tail``
(:class:`ReadsTail`: an object's last bytes with its size and version, in one request),
``list_info`` (:class:`ListsInfo`: a listing with sizes and versions), ``list``, ``write``,
``close``, ``coalesce_gap``, ``read_into`` (many ranges of many objects into one buffer:
the engine's fast path; converting as it copies where it sets ``supports_convert = True``)
and ``read_windows`` (fixed windows of an element stream, planned and copied by the
transport). The stack finds which of these a transport has once, when it is built.

The registry stacks layers over a transport (``stores/stack.py``: exact lengths, typed
errors, version pinning, retries and timeouts; then counting, the node-local cache and the
checks against what a manifest expects), and the engine sees :class:`Store`, which every
layer implements whole: its ``supports_*`` flags say which of the optional calls the
layers below can serve, so the engine tests flags, not types. Ranges are ``[start, end)``
with exclusive ends. A store never completes a read with fewer bytes than asked for: it
raises :class:`~asyncbatch._errors.ShortReadError` naming the URL and range instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from .._errors import ShortReadError, describe_range

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

Buffer = memoryview
#: (stored dtype, output dtype) of a converting read.
Conversion = tuple["np.dtype[Any]", "np.dtype[Any]"]


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """An object's size and version: the ETag or file identity its store pins (None when
    the store cannot tell one version from another)."""

    size: int
    version: str | None


@runtime_checkable
class Store(Protocol):
    """An async byte-range store bound to the event loop that created it: what every layer
    of the stack implements, whole. The optional calls work where their flag says so."""

    #: Gap in bytes below which two ranges of one object are cheaper read as one.
    coalesce_gap: int
    #: :meth:`read_into` reads a group of ranges of many objects in one call.
    supports_read_into: bool
    #: :meth:`read_into` and :meth:`read_windows` take a ``convert``.
    supports_convert: bool
    #: :meth:`read_windows` may plan and copy windows itself (it may still decline).
    supports_windows: bool
    #: :meth:`discard` forgets copies of bytes (a cache).
    supports_discard: bool

    async def size(self, url: str) -> int:
        """Size of the object at ``url`` in bytes."""
        ...

    async def stat(self, url: str) -> ObjectInfo:
        """Size and version of ``url``; pins the object at that version."""
        ...

    async def list_info(self, url: str) -> list[tuple[str, ObjectInfo | None]]:
        """``(URL, size and version)`` of the entries directly under the prefix ``url``,
        sorted; None where the listing does not tell (and for a folder)."""
        ...

    async def read_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], buffers: Sequence[Buffer]
    ) -> None:
        """Fill ``buffers[i]`` with bytes ``[starts[i], ends[i])`` of ``url``, all or raise."""
        ...

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        """The last ``min(length, size)`` bytes of ``url``, with its size and version."""
        ...

    async def read_into(
        self,
        urls: Sequence[str],
        which: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        ends: npt.NDArray[np.int64],
        dest: npt.NDArray[np.uint8],
        dest_offsets: npt.NDArray[np.int64],
        convert: Conversion | None = None,
    ) -> None:
        """Read ``[starts[i], ends[i])`` of ``urls[which[i]]`` into ``dest[dest_offsets[i]:]``,
        all or raise (``supports_read_into``). ``convert`` (``supports_convert``): the
        elements of ``convert[0]`` in each range written as ``convert[1]`` (a safe cast),
        ``starts`` and ``ends`` counting stored bytes, ``dest_offsets`` bytes of ``dest``."""
        ...

    async def read_windows(
        self,
        urls: Sequence[str],
        ends: npt.NDArray[np.int64],
        offsets: npt.NDArray[np.int64],
        itemsize: int,
        starts: npt.NDArray[np.int64],
        window: int,
        dest: npt.NDArray[np.uint8],
        convert: Conversion | None = None,
    ) -> bool:
        """Copy elements ``[starts[i], starts[i] + window)`` of the concatenation of the
        objects ``urls`` to ``dest[i * window * size:]`` (``supports_windows``). Object ``k``
        holds the elements up to ``ends[k]`` (cumulative counts) of ``itemsize`` bytes from
        its byte ``offsets[k]`` on; a window may cross object ends. ``size`` is the output
        element's (``convert``: stored dtype, output dtype, a safe cast made in the copy).
        False when it cannot here (files it does not map, too many at once, a conversion it
        lacks): the caller then plans byte ranges for all of them instead."""
        ...

    async def write(self, url: str, data: Buffer | bytes) -> None:
        """Write ``data`` as the whole object at ``url``, creating parents as needed."""
        ...

    async def discard(self, url: str, start: int, end: int) -> None:
        """Forget any copy of bytes ``[start, end)`` of ``url`` (``supports_discard``); the
        next read fetches them."""
        ...

    async def close(self) -> None:
        """Release sessions and file descriptors; idempotent."""
        ...

    # Last: within the class, ``list`` names this method from here on.
    async def list(self, url: str) -> list[str]:
        """URLs of the objects directly under the prefix ``url``, sorted."""
        ...


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
        object that no longer has it is a :class:`~asyncbatch._errors.ShardChangedError`."""
        ...


@runtime_checkable
class GetsVersionedRanges(Protocol):
    """A transport whose ranged reads tell the version they were read from (used in place of
    :class:`GetsRanges`): the stack compares it with the pin, so a replaced object is a
    :class:`~asyncbatch._errors.ShardChangedError`, never mixed bytes."""

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
class Versioned(Protocol):
    """A store that tells an object's version along with its size."""

    async def stat(self, url: str) -> ObjectInfo:
        """Size and version of ``url``; pins the object at that version as ``size`` does."""
        ...


@runtime_checkable
class ReadsTail(Protocol):
    """A store that reads an object's last bytes and learns its size and version at once
    (one suffix request: S3's and HTTP's ``Range: bytes=-N``, a local ``fstat`` + ``pread``).
    Every store the stack builds offers it (through ``stat`` and a range where the
    transport has no ``read_tail``)."""

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        """The last ``min(length, size)`` bytes of ``url``, with its size and version; pins
        the object at that version as ``stat`` does."""
        ...


@runtime_checkable
class ListsInfo(Protocol):
    """A store whose listing tells each object's size and version (S3's does), so that a
    format reading every object's tail after listing them needs no ``stat`` or suffix.
    Every store the stack builds offers it (None for every entry where the transport's
    listing tells nothing)."""

    async def list_info(self, url: str) -> list[tuple[str, ObjectInfo | None]]:
        """``(URL, size and version)`` of the entries directly under the prefix ``url``,
        sorted; None for a folder. Pins each object at its version as ``stat`` does."""
        ...


def offers(transport: object, name: str) -> bool:
    """Whether ``transport`` has the optional method or attribute ``name`` (what a
    ``runtime_checkable`` protocol's ``isinstance`` asks): looked up once per store, when the
    stack is built, never per call."""
    return getattr(transport, name, None) is not None


async def list_with_info(store: Any, url: str) -> list[tuple[str, ObjectInfo | None]]:
    """The listing of ``url`` with sizes and versions where the store's listing tells them
    (:class:`ListsInfo`), else its plain listing with None for every entry."""
    if isinstance(store, ListsInfo):
        return await store.list_info(url)
    return [(name, None) for name in await store.list(url)]


async def fetch_tail(store: object, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
    """The last ``min(length, size)`` bytes of ``url`` with its size and version: one
    request where the store offers :class:`ReadsTail`, else :func:`tail_by_stat`."""
    if isinstance(store, ReadsTail):
        return await store.read_tail(url, length)
    return await tail_by_stat(store, url, length)


async def tail_by_stat(
    store: Any, url: str, length: int, info: ObjectInfo | None = None
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
