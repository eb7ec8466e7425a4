"""The guards the registry stacks over any transport, so a small adapter is as safe as a
built-in store.

From the bottom: :class:`TransportStore` turns a transport (two methods, see
:mod:`~asyncbatch.stores._base`) into the full :class:`~asyncbatch.stores._base.Store`: it
checks every range's length (:class:`~asyncbatch._errors.ShortReadError` naming the URL and
range, never short or shifted bytes), pins each object at the version it was first seen
with (``stat``, a tail, a listing, or a read that tells one) and raises
:class:`~asyncbatch._errors.ShardChangedError` naming both versions when a later one
differs, and refuses what the transport cannot do with a typed error.
:class:`RetryingStore` above it maps the transport's built-in exceptions to typed errors
(:func:`map_error`) and runs each call under the
:class:`~asyncbatch.stores._retry.RetryPolicy`.

A call is one attempt, bounded by ``connect_timeout + first_byte_timeout + idle_timeout``
(not bounded for an :class:`~asyncbatch.stores._base.Unbounded` transport: the local one),
retried whole; except the ranges of a transport that offers
:class:`~asyncbatch.stores._base.ResumesRanges` (the built-in S3 and HTTP ones): each range
is retried on its own, with one :class:`~asyncbatch.stores._base.Progress` kept across its
attempts so that only its missing tail is asked again, the pin passed in as a precondition
and the version of every answer compared with it. Such a transport times each phase of its
request itself, so no bound cuts a slow body that keeps moving.

Each layer is one class that states, in its ``supports_*`` flags, what the transport
below can do: a transport's ``read_into`` (converting too where it sets
``supports_convert``) and ``read_windows`` pass through both layers as one call per group,
no Python per range, so the engine's fast path stays fast (their contract is all or raise;
:mod:`asyncbatch.testing` checks that a transport keeps it). Both layers offer ``read_tail``
(the transport's own, pinned and length-checked, or a ``stat`` and a ranged read) and
``list_info`` (the transport's own, pinned, or a plain listing that tells nothing).
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from .._errors import (
    AsyncBatchError,
    ConfigError,
    NotFoundError,
    PermissionDeniedError,
    ShardChangedError,
    StoreError,
    StoreTimeoutError,
    describe_range,
)
from .._redact import stand_in
from ._base import (
    Buffer,
    Conversion,
    GetsRanges,
    GetsVersionedRanges,
    ListsInfo,
    ObjectInfo,
    Progress,
    ReadsRanges,
    ReadsTail,
    ResumesRanges,
    Store,
    Unbounded,
    Versioned,
    check_length,
    offers,
    tail_by_stat,
)
from ._counting import ReadCounts
from ._ranged import REMOTE_COALESCE_GAP, fail, run_all
from ._retry import DEFAULT_POLICY, RetryPolicy, with_retries

T = TypeVar("T")


def is_transient(exc: BaseException) -> bool:
    """Whether a built-in exception may pass by waiting: a reset or refused connection, or
    a plain ``OSError`` (``EIO`` of a remote or parallel filesystem); not a missing file, a
    denied one or a wrong path (``IsADirectoryError`` and its kind), which no retry fixes."""
    return isinstance(exc, ConnectionError) or type(exc) is OSError


def map_error(
    exc: BaseException, url: str, start: int | None = None, end: int | None = None
) -> BaseException:
    """The typed error for what a transport raised: asyncbatch's own errors pass unchanged;
    ``FileNotFoundError`` (and ``NotADirectoryError``) is :class:`NotFoundError`,
    ``PermissionError`` :class:`PermissionDeniedError`; ``TimeoutError`` a retried
    :class:`StoreTimeoutError`; ``ConnectionError`` and other plain ``OSError`` a retried
    :class:`StoreError` (a reset, an I/O error of a remote or parallel filesystem); anything
    else a :class:`StoreError` not retried (a bug does not pass by waiting)."""
    if isinstance(exc, AsyncBatchError):
        return exc
    # The cause stays chained (as its scrubbed stand-in); the message says what it means.
    # A path through a file (NotADirectoryError) names no object either.
    if isinstance(exc, FileNotFoundError | NotADirectoryError):
        return fail(NotFoundError, "not found", url, start, end)
    if isinstance(exc, PermissionError):
        return fail(PermissionDeniedError, "permission denied", url, start, end)
    what = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, TimeoutError):
        return fail(StoreTimeoutError, f"timed out ({what})", url, start, end)
    return fail(StoreError, f"request failed: {what}", url, start, end, retryable=is_transient(exc))


class Unsupported(StoreError):
    """The transport lacks what was asked of it (``list()``, ``write()``)."""


def _unsupported(url: str, what: str, capability: str) -> StoreError:
    return Unsupported(f"this store cannot {what} (its transport has no {capability}): {url}", url)


class TransportStore:
    """The :class:`Store` over a transport: lengths checked, versions pinned, and the
    transport's optional calls found once (its ``supports_*`` flags)."""

    def __init__(self, transport: object) -> None:
        reads = GetsRanges | ReadsRanges | ResumesRanges | GetsVersionedRanges
        if not isinstance(transport, reads) or not (
            isinstance(transport, Versioned) or offers(transport, "size")
        ):
            raise ConfigError(
                f"{type(transport).__name__} is not a store transport: it needs get_ranges"
                " (or read_ranges, read_range, get_versioned_ranges) and stat; see"
                " docs/adapters.md"
            )
        self.transport = transport
        #: The transport's optional calls, found once here (a protocol ``isinstance`` costs
        #: microseconds, and a run stats every shard); the engine's fast paths cross the
        #: stack as one call per group.
        self._versioned: Versioned | None = transport if isinstance(transport, Versioned) else None
        #: The transport as :class:`ResumesRanges`, if it is (checked once: not per range).
        self._resumer: ResumesRanges | None = (
            transport if isinstance(transport, ResumesRanges) else None
        )
        #: Whether the transport resumes ranges: the retrying layer then retries each one.
        self.resumes = self._resumer is not None
        #: Ranges the transport keeps in flight at most (its ``max_inflight``; 64 if it
        #: says none): the retrying layer reads a group's ranges in as many slots.
        inflight = getattr(transport, "max_inflight", None)
        self.max_inflight = inflight if isinstance(inflight, int) and inflight > 0 else 64
        #: The transport as a :class:`Store` for its optional calls, each behind its flag.
        below: Any = transport
        self._below = below
        self.supports_read_into = _can(transport, "read_into", "supports_read_into")
        self.supports_convert = self.supports_read_into and _flag(transport, "supports_convert")
        self.supports_windows = _can(transport, "read_windows", "supports_windows")
        self.supports_discard = _can(transport, "discard", "supports_discard")
        self._lists = offers(transport, "list")
        self._writes = offers(transport, "write")
        self._closes = offers(transport, "close")
        if self.supports_convert:
            # The transport's own group reads, called straight (no frame of this layer on
            # the engine's fast path): they take what these methods take.
            self.read_into = below.read_into  # type: ignore[method-assign]
        if self.supports_windows:
            self.read_windows = below.read_windows  # type: ignore[method-assign]
        gap = getattr(transport, "coalesce_gap", None)
        self.coalesce_gap: int = REMOTE_COALESCE_GAP if gap is None else gap
        self._pins: dict[str, str] = {}

    async def stat(self, url: str) -> ObjectInfo:
        """Size and version; pins ``url`` at the first version seen."""
        if self._versioned is not None:
            info = await self._versioned.stat(url)
        else:  # a store written before stat existed: size only, nothing to pin
            info = ObjectInfo(await self._below.size(url), None)
        self._pin(url, info.version)
        return info

    def _pin(self, url: str, version: str | None) -> None:
        """Pin ``url`` at ``version`` if not yet pinned, else require the same version."""
        if version is not None:
            pinned = self._pins.setdefault(url, version)
            if pinned != version:
                raise ShardChangedError(
                    f"the object changed since it was pinned: version {pinned} when first"
                    f" seen, {version} now: {url}",
                    url,
                )

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        """The transport's tail read, pinned and length-checked; a stat and a ranged read
        when it has none."""
        transport = self.transport
        if not isinstance(transport, ReadsTail):
            return await tail_by_stat(self, url, length)
        tail, info = await transport.read_tail(url, length)
        self._pin(url, info.version)
        count = max(0, min(length, info.size))
        check_length(url, info.size - count, info.size, len(tail))
        return tail, info

    async def size(self, url: str) -> int:
        return (await self.stat(url)).size

    async def read_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], buffers: Sequence[Buffer]
    ) -> None:
        transport = self.transport
        if self.resumes:  # one attempt per range (the retrying layer retries each one)
            await run_all(
                self.attempt_range(url, start, end, buffer, Progress())
                for start, end, buffer in zip(starts, ends, buffers, strict=True)
                if end > start
            )
            return
        if isinstance(transport, ReadsRanges):
            await transport.read_ranges(url, starts=starts, ends=ends, buffers=buffers)
            return
        wanted = [i for i, (start, end) in enumerate(zip(starts, ends, strict=True)) if end > start]
        if not wanted:
            return
        wanted_starts, wanted_ends = [starts[i] for i in wanted], [ends[i] for i in wanted]
        chunks: Sequence[bytes | memoryview]
        if isinstance(transport, GetsVersionedRanges):
            chunks, version = await transport.get_versioned_ranges(
                url, starts=wanted_starts, ends=wanted_ends, version=self._pins.get(url)
            )
            self._pin(url, version)
        else:
            assert isinstance(transport, GetsRanges)
            chunks = await transport.get_ranges(url, starts=wanted_starts, ends=wanted_ends)
        if len(chunks) != len(wanted):
            raise StoreError(
                f"get_ranges returned {len(chunks)} buffers for {len(wanted)} ranges: {url}", url
            )
        for index, chunk in zip(wanted, chunks, strict=True):
            data = memoryview(chunk).cast("B")
            check_length(url, starts[index], ends[index], len(data))
            buffers[index][:] = data

    async def attempt_range(
        self, url: str, start: int, end: int, buffer: Buffer, progress: Progress
    ) -> None:
        """One attempt of a :class:`ResumesRanges` transport at ``[start, end)``, from
        ``progress`` on: the pin sent as its precondition, the version its answer told
        pinned or compared with the pin, all the bytes or :class:`ShortReadError`."""
        transport = self._resumer
        assert transport is not None
        try:
            await transport.read_range(
                url,
                start=start,
                end=end,
                buffer=buffer,
                progress=progress,
                version=self._pins.get(url),
            )
        except Exception:
            self._pin(url, progress.version)  # bytes of another version explain a failure best
            raise
        self._pin(url, progress.version)
        check_length(url, start, end, progress.got)

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
        """The transport's own group read (``supports_read_into``); its contract is all or
        raise, which :mod:`asyncbatch.testing` checks."""
        if not self.supports_read_into or (convert is not None and not self.supports_convert):
            raise _unsupported(urls[0] if urls else "", "read into one buffer", "read_into()")
        if convert is None:  # a third party's read_into may take no conversion
            await self._below.read_into(urls, which, starts, ends, dest, dest_offsets)
        else:
            await self._below.read_into(urls, which, starts, ends, dest, dest_offsets, convert)

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
        if not self.supports_windows:
            return False
        return bool(
            await self._below.read_windows(
                urls, ends, offsets, itemsize, starts, window, dest, convert
            )
        )

    async def list(self, url: str) -> list[str]:
        if not self._lists:
            raise _unsupported(url, "list", "list()")
        names: builtins.list[str] = await self._below.list(url)
        return names

    async def list_info(self, url: str) -> builtins.list[tuple[str, ObjectInfo | None]]:
        """The transport's listing with sizes and versions, each object pinned; without
        one, the plain listing with no sizes or versions (None for every entry)."""
        transport = self.transport
        if not isinstance(transport, ListsInfo):
            return [(name, None) for name in await self.list(url)]
        found = await transport.list_info(url)
        for name, info in found:
            if info is not None:
                self._pin(name, info.version)
        return found

    async def write(self, url: str, data: Buffer | bytes) -> None:
        if not self._writes:
            raise _unsupported(url, "write", "write()")
        await self._below.write(url, data)
        self._pins.pop(url, None)  # our own write: the next stat pins the new version

    async def discard(self, url: str, start: int, end: int) -> None:
        if self.supports_discard:
            await self._below.discard(url, start, end)

    async def close(self) -> None:
        if self._closes:
            await self._below.close()


def _flag(transport: object, name: str) -> bool:
    """A ``supports_*`` flag the transport sets itself (False where it sets none)."""
    return getattr(transport, name, False) is True


def _can(transport: object, method: str, flag: str) -> bool:
    """Whether ``transport`` has ``method``, unless it says otherwise in ``flag`` (a store
    the stack built, stacked again, has every method and says which work)."""
    return offers(transport, method) and getattr(transport, flag, True) is not False


class RetryingStore:
    """Forwards every call to ``inner`` with typed errors, retried under ``policy``.

    Each attempt is bounded by ``connect_timeout + first_byte_timeout + idle_timeout``: a
    transport's call is opaque, so one bound covers its whole request; not over an
    :class:`Unbounded` transport (local files: no timeout stops a thread's read). Over a
    :class:`TransportStore` whose transport resumes ranges, each range is retried on its own
    for its missing tail, without that bound (the transport times each phase itself). A
    group read (``read_into``, ``read_windows``) is one call under the policy.
    """

    def __init__(
        self, inner: Store, policy: RetryPolicy = DEFAULT_POLICY, counts: ReadCounts | None = None
    ) -> None:
        self.inner = inner
        #: Where this layer, right above the transport, counts the byte ranges asked of it
        #: (a loader's; retries are not counted).
        self.counts = counts
        self._resuming = inner if isinstance(inner, TransportStore) and inner.resumes else None
        self.policy = policy
        self.coalesce_gap = inner.coalesce_gap
        self.supports_read_into = inner.supports_read_into
        self.supports_convert = inner.supports_convert
        self.supports_windows = inner.supports_windows
        self.supports_discard = inner.supports_discard
        unbounded = isinstance(inner, TransportStore) and isinstance(inner.transport, Unbounded)
        self._timeout: float | None = (
            None
            if unbounded
            else policy.connect_timeout + policy.first_byte_timeout + policy.idle_timeout
        )

    def _attempt(
        self,
        call: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        url: str,
        start: int | None = None,
        end: int | None = None,
    ) -> Callable[[], Awaitable[T]]:
        """One attempt at ``call(*args)``, for :func:`with_retries`: bounded by the policy's
        timeout, a built-in exception mapped to its typed error."""
        timeout = self._timeout

        async def attempt() -> T:
            # An Unbounded transport's call arms no timer: a group read's cost stays small.
            bound = None if timeout is None else asyncio.timeout(timeout)
            try:
                if bound is None:
                    return await call(*args)
                async with bound:
                    return await call(*args)
            except Exception as exc:
                error = self._error(exc, bound, url, start, end)
                if error is exc:
                    raise
                cause = stand_in(exc)
            # Raised out of the handler, so another library's exception (whose text may
            # quote a signed URL) is chained only as its scrubbed stand-in.
            raise error from cause

        return attempt

    def _error(
        self,
        exc: Exception,
        bound: asyncio.Timeout | None,
        url: str,
        start: int | None = None,
        end: int | None = None,
    ) -> BaseException:
        """What an attempt that raised ``exc`` raises: a timeout past the bound, ``exc``
        mapped to its typed error (``exc`` itself when it is one)."""
        if bound is not None and bound.expired():
            detail = f"no answer within {self._timeout:g} s"
            return fail(StoreTimeoutError, detail, url, start, end)
        return map_error(exc, url, start, end)

    async def _retry_group(
        self,
        call: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        what: str,
        url: str,
        exc: Exception,
        bound: asyncio.Timeout | None,
    ) -> T:
        """A group read whose first attempt (made by the caller, in line) raised ``exc``:
        the retries under the policy, that failure counted as their first."""
        failed = [exc]
        attempt = self._attempt(call, args, url)

        async def again() -> T:
            if failed:
                first = failed.pop()
                error = self._error(first, bound, url)
                if error is first:
                    raise first
                raise error from first
            return await attempt()

        return await with_retries(self.policy, again, what=what, url=url)

    async def _run(
        self,
        call: Callable[..., Awaitable[T]],
        args: tuple[Any, ...],
        what: str,
        url: str,
        start: int | None = None,
        end: int | None = None,
    ) -> T:
        attempt = self._attempt(call, args, url, start, end)
        return await with_retries(self.policy, attempt, what=what, url=url, start=start, end=end)

    async def stat(self, url: str) -> ObjectInfo:
        inner = self.inner
        return await self._run(inner.stat, (url,), f"stat of {url}", url)

    async def size(self, url: str) -> int:
        return await self._run(self.inner.size, (url,), f"size of {url}", url)

    async def read_ranges(
        self, url: str, *, starts: Sequence[int], ends: Sequence[int], buffers: Sequence[Buffer]
    ) -> None:
        if self.counts is not None:
            self.counts.requests += len(starts)
            self.counts.bytes_fetched += sum(ends) - sum(starts)
        if self._resuming is not None:
            await run_all(
                self._read_range(self._resuming, url, start, end, buffer)
                for start, end, buffer in zip(starts, ends, buffers, strict=True)
                if end > start
            )
            return
        if len(starts) == 0:
            return
        # One call reads the group: the range named is the span it covers.
        low, high = min(starts), max(ends)
        await self._run(
            lambda: self.inner.read_ranges(url, starts=starts, ends=ends, buffers=buffers),
            (),
            f"read of {describe_range(url, low, high)}"
            + (f" ({len(starts)} ranges)" if len(starts) > 1 else ""),
            url,
            low,
            high,
        )

    async def read_each(
        self,
        urls: Sequence[str],
        which: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        ends: npt.NDArray[np.int64],
        dest: npt.NDArray[np.uint8],
        dest_offsets: npt.NDArray[np.int64],
    ) -> bool:
        """A group's ranges, each retried on its own, over a transport that resumes ranges:
        read in ``max_inflight`` slots that take the next range as they finish one (not a
        task per range: a group of thousands keeps only its slots' objects alive, and the
        collector scans less). False, reading nothing, over another transport."""
        inner = self._resuming
        if inner is None:
            return False
        if self.counts is not None:
            self.counts.requests += int(starts.size)
            self.counts.bytes_fetched += int(ends.sum() - starts.sum())
        view = memoryview(dest)  # type: ignore[arg-type]
        ranges = iter(
            zip(which.tolist(), starts.tolist(), ends.tolist(), dest_offsets.tolist(), strict=True)
        )

        async def slot() -> None:
            for index, start, end, at in ranges:  # shared: each range taken once
                if end > start:
                    await self._read_range(
                        inner, urls[index], start, end, view[at : at + end - start]
                    )

        await run_all(slot() for _ in range(min(int(starts.size), inner.max_inflight)))
        return True

    async def _read_range(
        self, inner: TransportStore, url: str, start: int, end: int, buffer: Buffer
    ) -> None:
        """``[start, end)`` under the policy, one :class:`Progress` across the attempts."""
        progress = Progress()

        async def attempt() -> None:
            try:
                await inner.attempt_range(url, start, end, buffer, progress)
                return
            except Exception as exc:
                error = map_error(exc, url, start, end)
                if error is exc:
                    raise
                cause = stand_in(exc)
            raise error from cause  # out of the handler: see TransportStore.attempt

        what = f"read of {describe_range(url, start, end)}"
        await with_retries(self.policy, attempt, what=what, url=url, start=start, end=end)

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
        first = urls[int(which[0])] if which.size else ""
        what = f"read of {int(which.size)} ranges of {len(urls)} objects ({first}, ...)"
        args = (urls, which, starts, ends, dest, dest_offsets, convert)
        if self.counts is not None:
            self.counts.requests += int(starts.size)
            self.counts.bytes_fetched += int(ends.sum() - starts.sum())
        # The first attempt in line: no frame between this layer and the one below.
        bound = None if self._timeout is None else asyncio.timeout(self._timeout)
        try:
            if bound is None:
                await self.inner.read_into(*args)
                return
            async with bound:
                await self.inner.read_into(*args)
                return
        except Exception as exc:
            failed = exc
        # Out of the except clause: a later error is not raised "during" this one.
        await self._retry_group(self.inner.read_into, args, what, first, failed, bound)

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
        first = urls[0] if urls else ""
        what = f"read of {int(starts.size)} windows of {len(urls)} objects ({first}, ...)"
        args = (urls, ends, offsets, itemsize, starts, window, dest, convert)
        bound = None if self._timeout is None else asyncio.timeout(self._timeout)
        failed: Exception | None = None
        try:
            if bound is None:
                copied = await self.inner.read_windows(*args)
            else:
                async with bound:
                    copied = await self.inner.read_windows(*args)
        except Exception as exc:
            failed = exc
        if failed is not None:  # out of the except clause: a later error is not "during" it
            copied = await self._retry_group(
                self.inner.read_windows, args, what, first, failed, bound
            )
        if not copied:
            return False
        if self.counts is not None:  # each window counts as one read
            self.counts.requests += int(starts.size)
            self.counts.bytes_fetched += int(starts.size) * window * itemsize
        return True

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        """Counted as one request, whether the transport reads tails itself or stats and
        reads a range (a stat is never counted)."""
        if self.counts is not None:
            self.counts.requests += 1
        tail, info = await self._run(
            self.inner.read_tail,
            (url, length),
            f"read of the last {length} bytes of {url}",
            url,
        )
        if self.counts is not None:
            self.counts.bytes_fetched += len(tail)
        return tail, info

    async def list(self, url: str) -> builtins.list[str]:
        return await self._run(self.inner.list, (url,), f"list of {url}", url)

    async def list_info(self, url: str) -> builtins.list[tuple[str, ObjectInfo | None]]:
        return await self._run(self.inner.list_info, (url,), f"list of {url}", url)

    async def write(self, url: str, data: Buffer | bytes) -> None:
        # A write is not retried: the transport may have half-applied it.
        try:
            await self.inner.write(url, data)
            return
        except Exception as exc:
            error = map_error(exc, url)
            if error is exc:
                raise
            cause = stand_in(exc)
        raise error from cause  # out of the handler: see TransportStore.attempt

    async def discard(self, url: str, start: int, end: int) -> None:
        await self.inner.discard(url, start, end)

    async def close(self) -> None:
        await self.inner.close()


def stacked(
    transport: object,
    policy: RetryPolicy = DEFAULT_POLICY,
    pins: Mapping[str, str] | None = None,
    counts: ReadCounts | None = None,
) -> Store:
    """``transport`` under the guards: lengths, pins, typed errors, retries and timeouts,
    keeping its ``read_into`` (converting or not) and ``read_windows`` if it has them.
    ``pins``: versions objects must have from the start (those a dataset was opened from);
    ``counts``: where the byte ranges asked of the transport are counted."""
    inner = TransportStore(transport)
    inner._pins.update(pins or {})
    return RetryingStore(inner, policy, counts)
