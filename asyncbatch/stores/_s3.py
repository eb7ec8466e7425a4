"""S3 transport: s3fs for credentials, endpoint, listing and writes; reads our own.

Sizes go straight to the aiobotocore client's ``head_object`` with botocore's retries off
and s3fs's ``_call_s3`` retries bypassed. Ranges go on the keep-alive connections of
:mod:`~asyncbatch.stores._wire` (over aiohttp behind a proxy), signed by
:mod:`~asyncbatch.stores._s3_signed` with the client's credentials and endpoint (a fraction of
the CPU per request of botocore's ``get_object``, still used where that module does not
apply, with one :class:`~asyncbatch._errors.SlowPathWarning` per reason). Every call is one
attempt, so the registry's stack (``stack.py``) and its
:class:`~asyncbatch.stores._retry.RetryPolicy` are the only retry layer (a persistent 503
costs exactly ``max_attempts`` GETs). It offers :class:`~asyncbatch.stores._base.ResumesRanges`:
the stack retries each range for its missing tail, pins each key at its first ETag and
passes the pin in, which this transport sends as ``IfMatch``; every response's ETag is
compared with the pin (a server or proxy may ignore ``IfMatch``) and its ``ContentRange``
with the range asked, before the body is read. botocore and aiohttp errors are mapped to
typed errors naming the key and range (a missing bucket: a
:class:`~asyncbatch._errors.BucketNotFoundError` naming it, with one cause; a session token
S3 refuses, even by a HEAD's bare 400: a :class:`~asyncbatch._errors.CredentialsError`
saying so); none escapes raw.
"""

from __future__ import annotations

import asyncio
import builtins
import inspect
import threading
import warnings
from collections.abc import Mapping
from functools import cache
from typing import Any

import aiohttp

from .._errors import (
    BucketNotFoundError,
    ConfigError,
    CredentialsError,
    NotFoundError,
    PermissionDeniedError,
    ShardChangedError,
    ShortReadError,
    SlowPathWarning,
    StoreError,
    StoreTimeoutError,
)
from ._base import Buffer, ObjectInfo, Progress
from ._fsspec_store import FsspecStore
from ._ranged import (
    CHUNK,
    TailAnswer,
    changed,
    connection_error,
    expected_length,
    fail,
    fill,
    if_match,
    parse_retry_after,
    receive_tail,
    status_error,
    tail_from,
)
from ._retry import DEFAULT_POLICY, RetryPolicy
from ._s3_signed import SignedGets, _Body, signed_gets
from ._validate import check_options

_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded"}
_NOT_FOUND = {"NoSuchKey", "NoSuchBucket", "NotFound", "NoSuchVersion"}
#: Codes of a session token S3 refused (with HTTP 400): expired, malformed, or one that
#: must be renewed before it can be used.
_BAD_TOKEN = {"ExpiredToken", "InvalidToken", "TokenRefreshRequired"}
_BAD_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", *_BAD_TOKEN}

_NO_CREDENTIALS = (
    "no AWS credentials found: pass storage_options key= and secret= (or profile=), set"
    " AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or anon=True for a public bucket"
)
_TLS_HINT = (
    "pass its CA bundle as storage_options client_kwargs={'verify': '/path/to/ca.pem'}"
    " (or set AWS_CA_BUNDLE)"
)


#: Reasons already warned of by :func:`slow_path` in this process.
_warned: set[str] = set()
_warned_lock = threading.Lock()


def slow_path(reason: str) -> None:
    """Warn, once per process and ``reason``, that S3 GETs go through botocore."""
    with _warned_lock:
        if reason in _warned:
            return
        _warned.add(reason)
    warnings.warn(
        f"S3 reads go through botocore's get_object, several times the CPU per request of"
        f" asyncbatch's own signed GETs, because of {reason}",
        SlowPathWarning,
        stacklevel=2,
    )


@cache
def storage_option_names() -> frozenset[str]:
    """The ``storage_options`` this store takes: s3fs's own, fsspec's listing cache ones,
    and aiobotocore's session ones (s3fs passes the rest there)."""
    from aiobotocore.session import AioSession
    from s3fs import S3FileSystem

    names = {"use_listings_cache", "listings_expiry_time", "max_paths"}
    for function in (S3FileSystem.__init__, AioSession.__init__):
        for parameter in inspect.signature(function).parameters.values():
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY):
                names.add(parameter.name)
    # The store sets these itself.
    return frozenset(names - {"self", "asynchronous", "loop"})


@cache
def _session_option_names() -> frozenset[str]:
    """Options that s3fs passes to the aiobotocore session it creates, and ``session``."""
    from aiobotocore.session import AioSession

    names = set(inspect.signature(AioSession.__init__).parameters) - {"self"}
    return frozenset(names | {"session"})


@cache
def _service_data() -> Any:
    """One botocore data loader for the process: it parses the S3 service model (0.3-1 s of
    JSON) once and keeps it, where every new session would parse it again, at every epoch."""
    from botocore.loaders import create_loader

    return create_loader()


def _new_session() -> Any:
    """An aiobotocore session of its own (sessions are not shared across threads), reading
    the service model from :func:`_service_data`."""
    from aiobotocore.session import AioSession

    session = AioSession()
    session.register_component("data_loader", _service_data())
    return session


class _Changed(Exception):
    """A 412 to an ``IfMatch``: turned into ShardChangedError once the new ETag is known."""


#: URLs whose split into bucket, key and version a store keeps.
SPLIT_CACHE = 4096


class S3Store(FsspecStore):
    """Transport for ``s3://`` (and ``s3a://``) URLs; ``storage_options`` go to s3fs."""

    #: GETs go through :mod:`~asyncbatch.stores._s3_signed` (signed here) where the
    #: client's configuration allows; False sends them through botocore's ``get_object``
    #: (benchmarks compare the two).
    sign_gets = True

    def __init__(
        self,
        protocol: str,
        storage_options: Mapping[str, Any],
        *,
        max_inflight: int = 64,
        retry: RetryPolicy = DEFAULT_POLICY,
    ) -> None:
        check_options("S3", storage_options, storage_option_names())
        options = dict(storage_options)
        config = dict(options.get("config_kwargs") or {})
        # aiobotocore pools 10 connections by default: as many as we keep in flight.
        config.setdefault("max_pool_connections", max_inflight)
        config.setdefault("connect_timeout", retry.connect_timeout)
        # A backstop: this store times headers and body pauses itself.
        config.setdefault("read_timeout", max(retry.first_byte_timeout, retry.idle_timeout))
        config["retries"] = {"total_max_attempts": 1, "mode": "standard"}
        options["config_kwargs"] = config
        super().__init__(protocol, options, max_inflight=max_inflight, retry=retry)
        #: Whether the store makes the aiobotocore session itself (when the filesystem is
        #: first needed: an epoch read from a node cache asks S3 nothing and makes none).
        self._own_session = not options.keys() & _session_option_names()
        #: False once the endpoint answered a suffix range with other bytes (s3rver).
        self._suffix_ranges = True
        #: The signed GET path; False once the client's configuration ruled it out.
        self._signed: SignedGets | bool | None = None
        #: URLs split into bucket, key and version (at most SPLIT_CACHE of them).
        self._split: dict[str, tuple[str, str, str | None]] = {}

    async def _create(self) -> Any:
        if self._own_session:
            self._options["session"] = _new_session()
        return await super()._create()

    async def _client(self) -> tuple[Any, asyncio.Semaphore, Any]:
        fs = await self._filesystem()
        assert self._limit is not None
        # s3fs makes a new client when it finds its client's sessions closed: the store
        # closes the one it used last.
        self._connection = client = await fs.set_session()
        return client, self._limit, fs

    def _error(
        self, exc: BaseException, endpoint: str, url: str, start: int | None, end: int | None
    ) -> BaseException:
        """The typed error for anything botocore or aiohttp raised."""
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectTimeoutError,
            NoCredentialsError,
            ParamValidationError,
            PartialCredentialsError,
        )

        if isinstance(exc, NoCredentialsError | PartialCredentialsError):
            return fail(CredentialsError, _NO_CREDENTIALS, url, start, end)
        if isinstance(exc, ParamValidationError):  # checked before sending
            if "Invalid bucket name" in str(exc):
                return self._bad_bucket(url)
            problem = " ".join(str(exc).split()).removeprefix("Parameter validation failed: ")
            return ConfigError(f"{problem}: {url}")
        if isinstance(exc, ClientError):
            meta = exc.response.get("ResponseMetadata", {})
            status = int(meta.get("HTTPStatusCode") or 0)
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if status == 412 or code == "PreconditionFailed":
                return _Changed()
            if code in _BAD_TOKEN:
                said = str(exc.response.get("Error", {}).get("Message") or "").strip()
                detail = (
                    f"{endpoint} rejected the session token ({code}{': ' + said if said else ''}):"
                    " renew the temporary credentials (a new STS session, `aws sso login`)"
                    " and pass them (storage_options token=, AWS_SESSION_TOKEN or the profile)"
                )
                return fail(CredentialsError, detail, url, start, end)
            if code in _BAD_CREDENTIALS:
                detail = (
                    f"{endpoint} rejected the credentials ({code}): check key, secret and profile"
                    " (and token)"
                )
                return fail(CredentialsError, detail, url, start, end)
            if code == "InvalidBucketName":
                return self._bad_bucket(url)
            if code == "NoSuchBucket":
                return fail(BucketNotFoundError, self._no_bucket(url), url, start, end)
            if code in _NOT_FOUND:
                status = 404
            elif code in _THROTTLED:
                status = 503
            retry_after = (meta.get("HTTPHeaders") or {}).get("retry-after")
            return status_error(
                status, code, url, start, end, retry_after=parse_retry_after(retry_after)
            )
        if isinstance(exc, ConnectTimeoutError):
            detail = f"no connection within {self.retry.connect_timeout:g} s"
            return fail(StoreTimeoutError, detail, url, start, end)
        if isinstance(exc, TimeoutError):  # botocore's read timeout is one too
            return fail(StoreTimeoutError, f"timed out: {exc}", url, start, end)
        if isinstance(exc, BotoCoreError | aiohttp.ClientError | OSError):
            return connection_error(exc, endpoint, url, start, end, tls_hint=_TLS_HINT)
        return fail(StoreError, f"request failed: {type(exc).__name__}: {exc}", url, start, end)

    def _bad_bucket(self, url: str) -> ConfigError:
        bucket = self._fs.split_path(url)[0] if self._fs is not None else "?"
        return ConfigError(
            f"invalid bucket name {bucket!r} in {url}: bucket names are 3 to 63 lower-case"
            " letters, digits, dots and hyphens"
        )

    def _no_bucket(self, url: str) -> str:
        bucket = self._fs.split_path(url)[0] if self._fs is not None else "?"
        return (
            f"the bucket {bucket!r} does not exist (NoSuchBucket): create it first (aws s3 mb"
            f" s3://{bucket}, or s3fs's mkdir), or check its name and the endpoint"
        )

    async def _explain_not_found(self, url: str, error: StoreError) -> None:
        """Raise a :class:`BucketNotFoundError` naming the bucket if ``url``'s bucket does
        not exist: a HEAD's 404 has no body, and s3fs's listings and writes bury the code.
        Its one cause is the bucket's own 404 (the object's, and the layers it crossed,
        would only repeat "not found" at length)."""
        from botocore.exceptions import ClientError

        client, _, fs = await self._client()
        try:
            async with asyncio.timeout(self.retry.connect_timeout + self.retry.first_byte_timeout):
                await client.head_bucket(Bucket=fs.split_path(url)[0])
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = exc.response.get("Error", {}).get("Code")
            if status == 404 or code in ("NoSuchBucket", "404", "NotFound"):
                start, end = error.start, error.end
                raise fail(BucketNotFoundError, self._no_bucket(url), url, start, end) from exc
        except Exception:  # noqa: BLE001, S110 - only explains an error being raised
            pass

    async def _explain_fsspec(self, url: str, error: StoreError) -> None:
        """Raise the typed error that s3fs's listings and writes turn into a plain
        ``PermissionError`` or ``OSError``: a :class:`CredentialsError` for a rejected key
        or session token (``ExpiredToken`` is a PermissionError there, ``InvalidToken`` an
        EINVAL), a :class:`BucketNotFoundError` for a missing bucket, any other S3 answer
        typed by its status and code (a 400 not retried)."""
        # Called outside the except that caught ``error``, as :meth:`_explain_head` is.
        found = _client_error(error)
        if found is not None:
            client, _, _ = await self._client()
            typed = self._error(found, client.meta.endpoint_url, url, error.start, error.end)
            # S3's own answer, typed as a GET's would be: a 400 (EINVAL to s3fs, which
            # reads as transient) is not retried, a 503 is.
            if isinstance(typed, StoreError | ConfigError):
                raise typed from found
        if isinstance(error, NotFoundError):
            await self._explain_not_found(url, error)

    async def list(self, url: str) -> builtins.list[str]:
        try:
            return await super().list(url)
        except StoreError as exc:
            error = exc
        await self._explain_fsspec(url, error)
        raise error

    async def list_info(self, url: str) -> builtins.list[tuple[str, ObjectInfo | None]]:
        try:
            return await super().list_info(url)
        except StoreError as exc:
            error = exc
        await self._explain_fsspec(url, error)
        raise error

    async def write(self, url: str, data: Buffer | bytes) -> None:
        try:
            await super().write(url, data)
            return
        except StoreError as exc:
            error = exc
        await self._explain_fsspec(url, error)
        raise error

    async def _call_client(
        self, method: str, url: str, start: int | None, end: int | None, **kwargs: Any
    ) -> Any:
        """``client.method(**kwargs)`` under the first-byte timeout; errors mapped."""
        signed = self._signed
        if method == "get_object" and isinstance(signed, SignedGets):
            # Signed here: no client asked for, so no check of its sessions (~25 us a GET).
            client, call = None, signed.get_object
        else:
            client, _, fs = await self._client()
            call = self._sender(fs, client, method)
        wait = self.retry.connect_timeout + self.retry.first_byte_timeout
        try:
            async with asyncio.timeout(wait):
                return await call(**kwargs)
        except TimeoutError as exc:
            detail = f"no response headers within {wait:g} s"
            raise fail(StoreTimeoutError, detail, url, start, end) from exc
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if client is None:
                client, _, _ = await self._client()
            error = self._error(exc, client.meta.endpoint_url, url, start, end)
            if isinstance(error, _Changed):
                now = await self._current_version(url)
                raise changed(url, kwargs.get("IfMatch") or "?", now) from exc
            raise error from exc

    def _sender(self, fs: Any, client: Any, method: str) -> Any:
        """``client.method``; for ``get_object``, the signed path's where the client's
        configuration allows it (:func:`~asyncbatch.stores._s3_signed.signed_gets`)."""
        if method != "get_object" or not self.sign_gets:
            return getattr(client, method)
        if self._signed is None:
            found = signed_gets(
                fs,
                client,
                max_inflight=self._max_inflight,
                connect_timeout=self.retry.connect_timeout,
                slow=slow_path,
            )
            if isinstance(found, str):
                slow_path(found)
            self._signed = found if isinstance(found, SignedGets) else False
        return (
            self._signed.get_object if isinstance(self._signed, SignedGets) else client.get_object
        )

    async def _current_version(self, url: str) -> str | None:
        """The key's ETag now (for error messages; None if it cannot tell)."""
        client, _, fs = await self._client()
        bucket, key, version = fs.split_path(url)
        try:
            async with asyncio.timeout(self.retry.first_byte_timeout):
                head = await client.head_object(Bucket=bucket, Key=key)
        except Exception:  # noqa: BLE001 - only decorates an error being raised
            return None
        etag = head.get("ETag")
        return str(etag) if etag else None

    def _where(self, fs: Any, url: str) -> dict[str, Any]:
        split = self._split.get(url)
        if split is None:  # s3fs's split_path costs ~10 us; a run asks again for each shard
            if len(self._split) >= SPLIT_CACHE:
                self._split.clear()
            split = self._split[url] = fs.split_path(url)
        bucket, key, version = split
        where = {"Bucket": bucket, "Key": key, **fs.req_kw}  # RequestPayer if requester_pays
        if version:
            where["VersionId"] = version
        return where

    async def stat(self, url: str) -> ObjectInfo:
        """Size and ETag from a HEAD."""
        _, limit, fs = await self._client()
        async with limit:
            try:
                head = await self._call_client(
                    "head_object", url, None, None, **self._where(fs, url)
                )
            except StoreError as exc:
                error = exc
            else:
                etag = head.get("ETag")
                return ObjectInfo(int(head["ContentLength"]), str(etag) if etag else None)
            await self._explain_head(fs, url, error)
        raise error

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        """The last ``min(length, size)`` bytes with the size and ETag, from one
        ``Range: bytes=-length`` GET. An empty object (416: it has no last bytes) costs a HEAD
        instead. An endpoint that misreads suffix ranges (s3rver) costs a ranged read after
        it (the answer's headers tell the size), and from then on this transport asks it for
        sizes and ranges."""
        answer = None
        if length > 0 and self._suffix_ranges:
            answer = await self._get_tail(url, length)
            if answer is not None and answer.tail is None:
                self._suffix_ranges = False
        return await tail_from(self, url, length, answer)

    async def _get_tail(self, url: str, length: int) -> TailAnswer | None:
        """One suffix GET; None for a 416."""
        _, limit, fs = await self._client()
        async with limit:
            try:
                where = self._where(fs, url)
                response = await self._call_client(
                    "get_object", url, None, None, Range=f"bytes=-{length}", **where
                )
            except ShortReadError:  # 416
                return None
            body = response["Body"]
            try:
                etag = response.get("ETag")
                self._check_version_id(url, where.get("VersionId"), response.get("VersionId"))
                return await receive_tail(
                    lambda: body.read(CHUNK),
                    url,
                    length,
                    int(response["ResponseMetadata"]["HTTPStatusCode"]),
                    response.get("ContentRange"),
                    response.get("ContentLength"),
                    str(etag) if etag else None,
                    self.retry.idle_timeout,
                )
            finally:
                body.close()

    async def _explain_head(self, fs: Any, url: str, error: StoreError) -> None:
        """Raise what a HEAD's error means, where its answer had no body to say. Called
        outside the ``except`` that caught ``error``: the explanation chains its own cause
        only, not the HEAD's error and its causes too."""
        if isinstance(error, CredentialsError):
            return
        if isinstance(error, PermissionDeniedError):
            await self._explain_forbidden(fs, url)
        elif isinstance(error, NotFoundError):
            await self._explain_not_found(url, error)
        elif _bare_bad_request(error.__cause__):
            await self._explain_bad_request(fs, url, error)

    async def _explain_forbidden(self, fs: Any, url: str) -> None:
        """Raise the GET's error for a key whose HEAD was refused, if it is a
        :class:`CredentialsError`: a HEAD's 403 has no body, so it cannot tell a rejected
        key (``InvalidAccessKeyId``, ``SignatureDoesNotMatch``) from missing permission."""
        try:
            response = await self._call_client(
                "get_object", url, None, None, Range="bytes=0-0", **self._where(fs, url)
            )
        except CredentialsError:
            raise
        except StoreError:
            return
        response["Body"].close()  # allowed after all: the HEAD's own error stands

    async def _explain_bad_request(self, fs: Any, url: str, error: StoreError) -> None:
        """Raise why a HEAD was answered 400, if a GET of one byte tells: S3 answers 400,
        without a body for a HEAD, to an expired or invalid session token (``ExpiredToken``,
        ``InvalidToken``, ``TokenRefreshRequired``) and to a malformed request. When the GET
        has no body either and a session token signs the requests, a
        :class:`CredentialsError` naming the token; else the HEAD's error stands."""
        try:
            response = await self._call_client(
                "get_object", url, None, None, Range="bytes=0-0", **self._where(fs, url)
            )
        except CredentialsError:
            raise
        except StoreError as exc:
            if _status(exc.__cause__) != 400:
                return
            if not _bare_bad_request(exc.__cause__):
                raise  # the same refusal, with its reason
            if not await self._session_token(fs):
                return
            client, _, _ = await self._client()
            detail = (
                f"{client.meta.endpoint_url} refused the request with HTTP 400 and no reason;"
                " with a session token that is most often one that has expired or is not"
                " valid (ExpiredToken, InvalidToken): renew the temporary credentials (a new"
                " STS session, `aws sso login`) and pass them (storage_options token=,"
                " AWS_SESSION_TOKEN or the profile)"
            )
            raise fail(CredentialsError, detail, url) from error.__cause__
        response["Body"].close()  # the GET was answered: the HEAD's own error stands

    async def _session_token(self, fs: Any) -> bool:
        """Whether a session token signs this store's requests (given to s3fs, or in the
        credentials the session found: ``AWS_SESSION_TOKEN``, SSO, an assumed role)."""
        client_kwargs = dict(fs.client_kwargs or {})
        if client_kwargs.get("aws_session_token", fs.token):
            return True
        if client_kwargs.get("aws_access_key_id", fs.key) is not None or fs.anon:
            return False  # a key given without a token, or nothing signed
        try:
            async with asyncio.timeout(self.retry.first_byte_timeout):
                credentials = await fs.session.get_credentials()  # found once, kept
                frozen = None if credentials is None else credentials.get_frozen_credentials()
                if inspect.isawaitable(frozen):
                    frozen = await frozen
        except Exception:  # noqa: BLE001 - only explains an error being raised
            return False
        return bool(getattr(frozen, "token", None))

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
        """One GET of the range's missing tail ``[start + progress.got, end)``."""
        fs = self._fs if self._fs is not None else await self._filesystem()
        limit = self._limit
        assert limit is not None
        async with limit:
            await self._get(fs, url, start, end, buffer, progress, version)

    async def _get(
        self,
        fs: Any,
        url: str,
        start: int,
        end: int,
        buffer: Buffer,
        progress: Progress,
        version: str | None,
    ) -> None:
        """One GET of ``[start + progress.got, end)`` into the buffer, ``IfMatch`` ``version``."""
        first = start + progress.got
        kwargs = self._where(fs, url)
        kwargs["Range"] = f"bytes={first}-{end - 1}"
        condition = if_match(version)
        if condition is not None:
            kwargs["IfMatch"] = condition
        response = await self._call_client("get_object", url, start, end, **kwargs)
        body = response["Body"]
        try:
            etag = response.get("ETag")
            # A server or proxy that ignores If-Match answers from another version: its
            # bytes must not join those of the pinned one (nor be read at all).
            if version is not None and etag and etag != version:
                raise changed(url, version, str(etag))
            self._check_version_id(url, kwargs.get("VersionId"), response.get("VersionId"))
            progress.version = str(etag) if etag else None
            expected = expected_length(
                url,
                start,
                end,
                first,
                int(response["ResponseMetadata"]["HTTPStatusCode"]),
                response.get("ContentRange"),
                response.get("ContentLength"),
            )
            await fill(
                lambda: body.read(CHUNK),
                buffer,
                progress,
                expected,
                self.retry.idle_timeout,
                url,
                start,
                end,
                read_into=body.reader() if isinstance(body, _Body) else None,
            )
        finally:
            body.close()

    @staticmethod
    def _check_version_id(url: str, asked: str | None, answered: str | None) -> None:
        """Raise :class:`ShardChangedError` for an answer from another version than the
        ``versionId`` the URL pins."""
        if asked is not None and answered is not None and answered != asked:
            detail = f"asked for version {asked}, the answer is from version {answered}"
            raise fail(ShardChangedError, detail, url)

    async def close(self) -> None:
        signed, self._signed = self._signed, None
        try:
            if isinstance(signed, SignedGets):
                await signed.close()
        finally:  # the client too, whatever became of the GETs' session
            await super().close()


def _status(exc: BaseException | None) -> int | None:
    """The HTTP status of botocore's ``ClientError`` (None for another exception)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status else None


def _bare_bad_request(exc: BaseException | None) -> bool:
    """Whether ``exc`` is botocore's error for a 400 without a body to name its code (a
    HEAD's: botocore then makes the status the code)."""
    if _status(exc) != 400:
        return False
    code = getattr(exc, "response", {}).get("Error", {}).get("Code")
    return code in (None, "", "400", "BadRequest")


def _client_error(error: BaseException) -> Any | None:
    """The botocore ``ClientError`` among ``error``'s causes, if there is one (s3fs chains
    it to the ``OSError`` it makes of it)."""
    from botocore.exceptions import ClientError

    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, ClientError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def s3_store(
    scheme: str,
    storage_options: Mapping[str, Any],
    *,
    max_inflight: int,
    retry: RetryPolicy = DEFAULT_POLICY,
) -> S3Store:
    """Registry factory: an :class:`S3Store` (needs ``pip install 'asyncbatch[s3]'``)."""
    try:
        import s3fs  # noqa: F401
    except ImportError as exc:
        msg = f"the {scheme!r} store needs a package: {exc}; pip install 'asyncbatch[s3]'"
        raise ConfigError(msg) from exc
    return S3Store(scheme, storage_options, max_inflight=max_inflight, retry=retry)
