"""What every remote range read checks, whatever the client: status, range, version, length.

A range completes only with exactly the bytes asked for: a 206 whose ``Content-Range``
matches, or a 200 when the whole object was asked for. A server that ignores ``Range``
gets one :class:`~asyncbatch._errors.RangeNotSupportedError`, never retried. The stack pins
each object (``stack.py``) and passes the pin in: it goes out as ``If-Match``
(:func:`if_match`), and a 412 is a :class:`~asyncbatch._errors.ShardChangedError`
(:func:`changed`). Bodies are read into the caller's buffer in chunks, each under the idle
timeout, advancing a :class:`~asyncbatch.stores._base.Progress`; one that breaks off keeps
the bytes received, so the next attempt asks only for the missing tail.

A suffix request (``Range: bytes=-N``: an object's last bytes, its size told by
``Content-Range``) is read by :func:`receive_tail`, which also copes with servers that
ignore or misread it; :func:`tail_from` completes what such an answer lacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .._errors import (
    CredentialsError,
    EndpointError,
    NotFoundError,
    PermissionDeniedError,
    RangeNotSupportedError,
    ShardChangedError,
    ShortReadError,
    StoreError,
    StoreTimeoutError,
    ThrottledError,
    describe_range,
)
from .._redact import redact, stand_in
from ._base import Buffer, ObjectInfo, Progress, ResumesRanges, Store, Versioned, check_length
from ._retry import refused
from ._wire import HeaderError, Response

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from aiohttp import ClientResponse

    Body = ClientResponse | Response

#: Bytes asked of a body at a time.
CHUNK = 1 << 20

#: Gap below which neighbouring ranges are merged. With tens of requests in flight, one more
#: request costs about RTT / in-flight ≈ 10 ms / 64 ≈ 150 µs ≈ 150 KB at 1 GB/s: merging
#: across larger gaps moves more bytes than the request it saves.
REMOTE_COALESCE_GAP = 128 * 1024

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)$")


def fail(
    cls: type[StoreError],
    detail: str,
    url: str,
    start: int | None = None,
    end: int | None = None,
    *,
    retryable: bool | None = None,
    retry_after: float | None = None,
) -> StoreError:
    """An error of type ``cls`` whose message is ``detail`` and where it happened.

    ``detail`` alone is kept as ``error.detail`` for the list of attempts; ``retryable``
    overrides what the error's type says about retrying.
    """
    where = url if start is None or end is None else describe_range(url, start, end)
    error = cls(f"{detail}: {where}", url, start, end)  # scrubbed of secrets by the error
    error.detail = redact(detail)  # type: ignore[attr-defined]
    if retryable is not None:
        error.retryable = retryable  # type: ignore[attr-defined]
    if retry_after is not None and isinstance(error, ThrottledError):
        error.retry_after = retry_after
    return error


def status_error(
    status: int,
    reason: str,
    url: str,
    start: int | None = None,
    end: int | None = None,
    *,
    retry_after: float | None = None,
) -> StoreError:
    """The typed error for an HTTP error status (S3's too: they are the same codes)."""
    # S3 answers HEADs without a body, so botocore's error code is the status again.
    detail = f"HTTP {status} {reason if reason != str(status) else ''}".rstrip()
    if status == 404:
        return fail(NotFoundError, f"not found ({detail})", url, start, end)
    if status == 401:
        detail = f"the server wants credentials ({detail}): check those given (S3: key, secret"
        detail += " and profile; HTTP: storage_options headers, e.g. Authorization)"
        return fail(CredentialsError, detail, url, start, end)
    if status == 403:
        return fail(PermissionDeniedError, f"permission denied ({detail})", url, start, end)
    if status in (429, 503) or "SlowDown" in reason:
        return fail(ThrottledError, detail, url, start, end, retry_after=retry_after)
    if status == 416:
        return fail(ShortReadError, f"range past the end of the object ({detail})", url, start, end)
    return fail(StoreError, detail, url, start, end, retryable=status >= 500)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it wraps: chained causes, aiohttp's ``os_error`` and
    ``certificate_error``, botocore's ``error`` keyword."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        cause = todo.pop()
        if cause is None or id(cause) in seen:
            continue
        seen.add(id(cause))
        yield cause
        kwargs = getattr(cause, "kwargs", None)
        wrapped = kwargs.get("error") if isinstance(kwargs, dict) else None
        todo += [cause.__cause__, cause.__context__]
        todo += [getattr(cause, name, None) for name in ("os_error", "certificate_error")]
        if isinstance(wrapped, BaseException):
            todo.append(wrapped)


def host_of(url: str) -> str:
    """``host:port`` of ``url`` as error messages name an endpoint: no user or password."""
    return urlsplit(url).netloc.rpartition("@")[2]


def connection_error(
    exc: BaseException,
    endpoint: str,
    url: str,
    start: int | None = None,
    end: int | None = None,
    *,
    tls_hint: str,
) -> StoreError:
    """The typed error for a request that got no response from ``endpoint`` (host:port).

    A host name that does not resolve and a certificate that fails verification are
    :class:`EndpointError`: no retry can fix them, nor a header that cannot be sent (a
    :class:`StoreError`, not retried). A refused connection is retried briefly
    (a server restarting); anything else (a reset, a broken pipe) under the full policy.
    ``tls_hint`` says how this store is given another CA bundle.
    """
    causes = list(_causes(exc))
    for cause in causes:
        if isinstance(cause, HeaderError):  # never sent: sending it again cannot help
            return fail(StoreError, f"request not sent: {cause}", url, start, end)
        if isinstance(cause, ssl.SSLCertVerificationError):
            # aiohttp's wrapper is one too, without the reason OpenSSL gave.
            reasons = [getattr(c, "verify_message", None) for c in causes]
            reason = next((r for r in reasons if r), str(cause))
            detail = (
                f"the TLS certificate of {endpoint} failed verification ({reason}): use an"
                f" https endpoint with a trusted certificate, or {tls_hint}"
            )
            return fail(EndpointError, detail, url, start, end)
        if isinstance(cause, socket.gaierror) and cause.errno != socket.EAI_AGAIN:
            detail = (
                f"the host name of {endpoint} does not resolve ({cause.strerror}):"
                " check the endpoint's spelling"
            )
            return fail(EndpointError, detail, url, start, end)
        if isinstance(cause, ConnectionRefusedError):
            detail = f"connection refused by {endpoint}: is the server running on that port?"
            return refused(fail(StoreError, detail, url, start, end))
    detail = f"request failed: {type(exc).__name__}: {exc}"
    return fail(StoreError, detail, url, start, end, retryable=True)


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (the HTTP-date form is ignored)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


def expected_length(
    url: str,
    start: int,
    end: int,
    first: int,
    status: int,
    content_range: str | None,
    content_length: int | None,
) -> int:
    """Bytes the body must hold for a request of ``[first, end)`` (part of ``[start, end)``).

    Raises :class:`RangeNotSupportedError` for a server that ignored the range or answered
    another one, and :class:`ShortReadError` when the object ends before ``end``.
    """
    asked = f"bytes {first}-{end - 1}"
    if status == 200:
        if first == 0 and content_length in (None, end):
            return end
        raise fail(
            RangeNotSupportedError,
            f"the server ignored Range: it answered 200 with {content_length} bytes to a"
            f" request for {asked}",
            url,
            start,
            end,
        )
    match = _CONTENT_RANGE.match((content_range or "").strip())
    if status != 206 or match is None:
        raise fail(
            RangeNotSupportedError,
            f"asked {asked}, the server answered {status} with Content-Range {content_range!r}",
            url,
            start,
            end,
        )
    low, high, total = int(match.group(1)), int(match.group(2)), match.group(3)
    if low == first and high < end - 1 and total != "*" and int(total) == high + 1:
        raise fail(
            ShortReadError,
            f"the object has only {total} bytes, {end - int(total)} fewer than the range needs",
            url,
            start,
            end,
        )
    if low != first or high != end - 1:
        raise fail(
            RangeNotSupportedError,
            f"asked {asked}, the server sent bytes {low}-{high}",
            url,
            start,
            end,
        )
    if content_length is not None and content_length != end - first:
        raise fail(
            RangeNotSupportedError,
            f"Content-Range {content_range!r} with Content-Length {content_length}",
            url,
            start,
            end,
        )
    return end - first


@dataclass(frozen=True)
class TailAnswer:
    """What a suffix request (``Range: bytes=-N``) got: the object's last ``min(N, size)``
    bytes, or None when the server ignored or misread the range; the object's size when the
    answer told it; its ETag."""

    tail: bytearray | None
    size: int | None
    etag: str | None


async def receive_tail(
    read: Callable[[], Awaitable[bytes]],
    url: str,
    length: int,
    status: int,
    content_range: str | None,
    content_length: int | None,
    etag: str | None,
    idle_timeout: float,
) -> TailAnswer:
    """Read the answer to ``Range: bytes=-length`` (all of the tail or raise).

    A server may ignore the suffix range (a 200 with the whole object) or misread it (s3rver
    serves ``bytes=0-N``). An answer that holds the tail and at most ``2 * length`` bytes is
    read and cut to the tail; any other is left unread, with the size its headers tell.
    Raises :class:`RangeNotSupportedError` for an answer whose headers disagree.
    """
    if status == 200:
        if content_length is None:
            return TailAnswer(None, None, etag)
        low, high, size = 0, content_length - 1, content_length
    else:
        match = _CONTENT_RANGE.match((content_range or "").strip())
        if status != 206 or match is None or match.group(3) == "*":
            raise fail(
                RangeNotSupportedError,
                f"asked the last {length} bytes, the server answered {status} with"
                f" Content-Range {content_range!r}",
                url,
            )
        low, high, size = (int(match.group(i)) for i in (1, 2, 3))
        if content_length not in (None, high + 1 - low) or high >= size:
            raise fail(
                RangeNotSupportedError,
                f"Content-Range {content_range!r} with Content-Length {content_length}",
                url,
            )
    count = min(length, size)
    if low > size - count or high != size - 1 or high + 1 - low > 2 * length:
        return TailAnswer(None, size, etag)
    body = bytearray(high + 1 - low)
    await fill(read, memoryview(body), Progress(), len(body), idle_timeout, url, low, size)
    del body[: len(body) - count]
    return TailAnswer(body, size, etag)


async def tail_from(
    transport: ResumesRanges, url: str, length: int, answer: TailAnswer | None
) -> tuple[bytearray, ObjectInfo]:
    """The tail ``answer`` holds; else one ranged read (after a stat, unless the answer told
    the size) of ``transport`` (S3's, HTTP's: it resumes ranges and tells sizes and
    versions): one attempt each, the stack retries the whole."""
    if answer is not None and answer.tail is not None and answer.size is not None:
        return answer.tail, ObjectInfo(answer.size, answer.etag)
    if answer is None or answer.size is None:
        assert isinstance(transport, Versioned)
        info = await transport.stat(url)
    else:
        info = ObjectInfo(answer.size, answer.etag)
    count = max(0, min(length, info.size))
    tail = bytearray(count)
    if count:
        start, progress = info.size - count, Progress()
        await transport.read_range(
            url,
            start=start,
            end=info.size,
            buffer=memoryview(tail),
            progress=progress,
            version=info.version,
        )
        if progress.version not in (None, info.version):  # a weak ETag: not sent as If-Match
            raise changed(url, info.version or "?", progress.version)
        check_length(url, start, info.size, progress.got)
    return tail, info


def if_match(version: str | None) -> str | None:
    """The ``If-Match`` value for a pinned ``version``: a strong ETag (weak ones never match
    with If-Match, so the stack only compares them afterwards)."""
    return version if version is not None and not version.startswith("W/") else None


def changed(url: str, pinned: str, now: str | None) -> ShardChangedError:
    """The error for an object that no longer has its pinned version."""
    error = fail(
        ShardChangedError,
        f"the object changed since it was pinned: ETag {pinned} when first read,"
        f" {now or 'another version'} now",
        url,
    )
    assert isinstance(error, ShardChangedError)
    return error


async def paced(
    data: Buffer | bytes, deadline: asyncio.Timeout, wait: float, piece: int = 1 << 20
) -> AsyncIterator[memoryview]:
    """An upload's body in pieces of ``piece`` bytes, each one taken moving ``deadline`` to
    ``wait`` from now: an upload is bounded by its pauses, not its length, and its answer
    must follow its last byte within ``wait``."""
    loop = asyncio.get_running_loop()

    def move() -> None:
        # aiohttp sends the body from a task of its own, which may still be sending when an
        # answer came early (an error before the body's end) and the deadline is gone.
        with contextlib.suppress(RuntimeError):  # "Cannot change state of finished Timeout"
            deadline.reschedule(loop.time() + wait)

    view = memoryview(data).cast("B")
    for at in range(0, len(view), piece):
        move()
        yield view[at : at + piece]
    move()


async def run_all(reads: Iterable[Awaitable[Any]]) -> None:
    """Await every read; on the first failure cancel the others, wait for them, and raise it
    (unlike ``asyncio.gather``, which leaves them running against a buffer nobody wants)."""
    tasks = [asyncio.ensure_future(read) for read in reads]
    if not tasks:
        return
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        error = task.exception() if task in done and not task.cancelled() else None
        if error is not None:
            raise error


async def receive_range(
    response: Body,
    buffer: Buffer,
    progress: Progress,
    idle_timeout: float,
    url: str,
    start: int,
    end: int,
    first: int,
) -> None:
    """The body of a ranged GET from ``first`` on into ``buffer``: its length checked
    against the status and ``Content-Range``, read by :func:`fill` (done at its last byte
    when ``Content-Length`` frames it), the connection released when the range came whole,
    closed otherwise (a body left unread cannot be reused)."""
    try:
        expected = expected_length(
            url,
            start,
            end,
            first,
            response.status,
            response.headers.get("Content-Range"),
            response.content_length,
        )
        await fill(
            lambda: response.content.read(CHUNK),
            buffer,
            progress,
            expected,
            idle_timeout,
            url,
            start,
            end,
            framed=response.content_length == expected,
            read_into=response.read_into if isinstance(response, Response) else None,
        )
    finally:
        if progress.got < end - start:
            response.close()
        else:
            response.release()


async def fill(
    read: Callable[[], Awaitable[bytes]],
    buffer: Buffer,
    progress: Progress,
    expected: int,
    idle_timeout: float,
    url: str,
    start: int,
    end: int,
    framed: bool = False,
    read_into: Callable[[memoryview], Awaitable[int]] | None = None,
) -> None:
    """Read a body into ``buffer[progress.got:]`` until ``expected`` more bytes arrived.

    ``read()`` returns the next chunk, ``b""`` at the end (``framed``: a body whose length
    is known ends at its last byte, with no read of its end); ``read_into(view)``, where the
    body has one, copies the next bytes into ``view`` itself and says how many (0 at the
    end), with no piece made in between: the expected bytes are read so, any beyond them by
    ``read()``. A pause longer than
    ``idle_timeout`` is a :class:`StoreTimeoutError`; a body that ends early or breaks off is
    a retryable :class:`ShortReadError`; more bytes than expected, a
    :class:`RangeNotSupportedError`.
    """
    stop = progress.got + expected
    total = end - start
    loop = asyncio.get_running_loop()
    target = memoryview(buffer).cast("B") if read_into is not None else None
    try:
        # One deadline for the body, moved on at each chunk (cheaper than one per chunk).
        async with asyncio.timeout(idle_timeout) as deadline:
            while True:
                broke: BaseException | None = None
                landed = 0
                chunk = b""
                try:
                    if read_into is not None and target is not None and progress.got < stop:
                        landed = await read_into(target[progress.got : stop])
                    else:
                        chunk = await read()
                except (StoreError, TimeoutError):
                    raise
                except Exception as exc:  # aiohttp, botocore: the connection broke mid-body
                    broke = exc
                if broke is not None:
                    if progress.got == stop:
                        break  # every byte asked for arrived; only the end was lost
                    # Chained scrubbed (its text may quote the URL), outside the except.
                    raise fail(
                        ShortReadError,
                        f"body broke off after {progress.got} of {total} bytes"
                        f" ({type(broke).__name__})",
                        url,
                        start,
                        end,
                        retryable=True,
                    ) from stand_in(broke)
                if landed:
                    progress.got += landed
                    if framed and progress.got == stop:
                        break
                    deadline.reschedule(loop.time() + idle_timeout)
                    continue
                if not chunk:
                    break
                if progress.got + len(chunk) > stop:
                    raise fail(
                        RangeNotSupportedError,
                        f"the server sent more than the {expected} bytes asked for",
                        url,
                        start,
                        end,
                    )
                buffer[progress.got : progress.got + len(chunk)] = chunk
                progress.got += len(chunk)
                if framed and progress.got == stop:
                    break
                deadline.reschedule(loop.time() + idle_timeout)
    except TimeoutError as exc:
        if isinstance(exc, StoreError):
            raise
        raise fail(
            StoreTimeoutError,
            f"stalled: no bytes for {idle_timeout:g} s after {progress.got} of {total}",
            url,
            start,
            end,
        ) from exc
    if progress.got < stop:
        raise fail(
            ShortReadError,
            f"body ended after {progress.got} of {total} bytes",
            url,
            start,
            end,
            retryable=True,
        )


async def read_by_ranges(
    store: Store,
    urls: Sequence[str],
    which: npt.NDArray[np.int64],
    starts: npt.NDArray[np.int64],
    ends: npt.NDArray[np.int64],
    dest: npt.NDArray[np.uint8],
    dest_offsets: npt.NDArray[np.int64],
) -> None:
    """``Store.read_into`` through the plain protocol: one ``read_ranges`` call per object, run
    together; on the first failure the others are cancelled and awaited, never left running
    against a buffer nobody wants (or past the loop's end). A store that reads each range
    in slots of its own (``read_each``) takes the whole group in one call."""
    each = getattr(store, "read_each", None)
    if each is not None and await each(urls, which, starts, ends, dest, dest_offsets):
        return
    view = memoryview(dest)  # type: ignore[arg-type]
    by_object: dict[int, tuple[list[int], list[int], list[Buffer]]] = {}
    for index, start, end, at in zip(
        which.tolist(), starts.tolist(), ends.tolist(), dest_offsets.tolist(), strict=True
    ):
        entry = by_object.setdefault(index, ([], [], []))
        entry[0].append(start)
        entry[1].append(end)
        entry[2].append(view[at : at + end - start])
    await run_all(
        store.read_ranges(urls[index], starts=s, ends=e, buffers=b)
        for index, (s, e, b) in by_object.items()
    )
