"""Azure Blob Storage transport for ``az://``, ``abfs://`` and ``abfss://`` URLs: the Blob
service's REST API over aiohttp, one attempt per call, checked by ``ranged.py``.

Why not a client library: the reads must resume a broken body from its last byte, send the
pin as ``If-Match`` and compare the answer's ETag, time connect, first byte and idle
pauses apart, leave every retry to asyncbatch's :class:`~asyncbatch.stores._retry.RetryPolicy`
and keep ``Retry-After``; and each range costs little CPU. obstore (Rust's
``object_store``) keeps ``Retry-After`` and the raw status to itself and retries inside
unless told not to; azure-storage-blob's pipeline costs several times the CPU per request
of a signed aiohttp GET. So requests are built here, as the HTTP and S3 stores build theirs,
and signed by :mod:`~asyncbatch.stores._azure_auth` (Shared Key, SAS, or an Entra ID token
from azure-identity).

URLs: ``az://container/path`` (the account from ``storage_options``, a connection string or
``AZURE_STORAGE_ACCOUNT_NAME``), ``abfs[s]://container@account.dfs.core.windows.net/path``
(read through the account's Blob service, ``account.blob.core.windows.net``: the Data Lake
endpoint serves the same blobs). Listings name entries in the form the listed URL used.

The Blob service has no suffix ranges (``bytes=-N``; Azurite even answers one with a broken
header), so :meth:`AzureStore.read_tail` reads the last bytes with one ranged GET of an
object whose size this transport already knows (from a listing, a ``stat`` or an earlier
tail), and with a HEAD first otherwise. Listings tell sizes and ETags, so a Parquet prefix
opens with one GET per footer.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
from yarl import URL

from .._errors import (
    BucketNotFoundError,
    ConfigError,
    CredentialsError,
    NotFoundError,
    PermissionDeniedError,
    StoreError,
    StoreTimeoutError,
)
from ._azure_auth import API_VERSION, OPTION_NAMES, Account, AccountFinder, request_date
from ._base import Buffer, ObjectInfo, Progress
from ._http import TLS_HINT, client_session, send_request
from ._ranged import (
    REMOTE_COALESCE_GAP,
    TailAnswer,
    changed,
    connection_error,
    fail,
    host_of,
    if_match,
    parse_retry_after,
    receive_range,
    status_error,
    tail_from,
)
from ._retry import DEFAULT_POLICY, RetryPolicy, with_retries
from ._validate import check_options

#: Objects up to this size are written with one Put Blob; larger ones in blocks of
#: :data:`BLOCK_SIZE` (Put Block, then Put Block List).
PUT_LIMIT = 256 << 20
BLOCK_SIZE = 64 << 20
#: Bytes of an error body read at most (the service's are a few hundred).
_ERROR_BODY = 64 * 1024
#: Entries per List Blobs page (the service's maximum).
_PAGE = 5000

#: Container names: 3-63 lower-case letters, digits and single hyphens (``$root`` and the
#: other ``$`` containers too).
_CONTAINER = re.compile(r"(\$[a-z]+|[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9])$")
#: Error codes that mean the credentials were refused (not missing permission).
_REJECTED = {
    "AuthenticationFailed",
    "InvalidAuthenticationInfo",
    "NoAuthenticationInformation",
    "InvalidAuthenticationInfoHeader",
}
_CODE = re.compile(rb"<Code>([^<]*)</Code>")
_MESSAGE = re.compile(rb"<Message>([^<\n]*)")


@dataclass(frozen=True)
class BlobPath:
    """Where a URL points: the account, the container, the blob name (``""`` for the
    container itself), and the URL's own spelling up to the container (``az://c``)."""

    account: Account
    container: str
    blob: str
    prefix: str
    #: ``scheme://host[:port]`` of the Blob service.
    origin: str
    #: The path of the container (an emulator's has the account before it), URI-encoded.
    root: str
    #: The path of the blob, URI-encoded (as sent and as Shared Key signs it).
    blob_path: str

    def path(self, blob: str | None = None) -> str:
        """The request's path for ``blob`` (this URL's by default; ``""``: the container)."""
        if blob is None:
            return self.blob_path
        return self.root + (f"/{quote(blob, safe='/~')}" if blob else "")


class AzureStore:
    """Transport for ``az://``, ``abfs://`` and ``abfss://`` URLs (Azure Blob Storage).

    ``storage_options``: ``account_name``, ``account_key``, ``sas_token``,
    ``connection_string``, ``credential``, ``tenant_id``, ``client_id``, ``client_secret``,
    ``anon`` (adlfs's names), ``endpoint`` (e.g. Azurite's), ``account_host``; see
    :mod:`~asyncbatch.stores._azure_auth` for where credentials are found without them.
    """

    coalesce_gap = REMOTE_COALESCE_GAP

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None = None,
        *,
        max_inflight: int = 64,
        retry: RetryPolicy = DEFAULT_POLICY,
    ) -> None:
        options = dict(storage_options or {})
        check_options("Azure", options, OPTION_NAMES)
        self._accounts = AccountFinder(options)
        self.max_inflight = max_inflight
        self.retry = retry
        self._session: aiohttp.ClientSession | None = None
        self._limit: asyncio.Semaphore | None = None
        self._paths: dict[str, BlobPath] = {}
        #: Size and ETag of the objects this transport has seen (listed, stat'ed, written
        #: over is forgotten): a tail of one of them is one ranged GET.
        self._known: dict[str, ObjectInfo] = {}

    # -- URLs ---------------------------------------------------------------------------

    def where(self, url: str) -> BlobPath:
        """The account, container and blob of ``url``; :class:`ConfigError` for a URL that
        names no container, or an invalid one."""
        found = self._paths.get(url)
        if found is not None:
            return found
        scheme, sep, rest = url.partition("://")
        authority, _, blob = (rest if sep else url).partition("/")
        container, at, host = authority.partition("@")
        if not container:
            raise ConfigError(f"{url}: an Azure URL names a container: az://container/path")
        if not _CONTAINER.match(container):
            raise ConfigError(
                f"invalid container name {container!r} in {url}: container names are 3 to 63"
                " lower-case letters, digits and single hyphens, starting and ending with a"
                " letter or digit"
            )
        account = self._accounts.account(host.split(".")[0] if at else None, host if at else None)
        base = urlsplit(account.base)
        root = f"{base.path.rstrip('/')}/{container}"
        blob_path = root + (f"/{quote(blob, safe='/~')}" if blob else "")
        origin = f"{base.scheme}://{base.netloc}"
        found = BlobPath(
            account, container, blob, f"{scheme}://{authority}", origin, root, blob_path
        )
        if len(self._paths) < 100_000:
            self._paths[url] = found
        return found

    # -- requests -----------------------------------------------------------------------

    def _client(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        if self._session is None or self._limit is None:
            self._session = client_session(
                self.max_inflight,
                self.retry.connect_timeout,
                # Shared Key signs Content-Type: none is added behind its back.
                skip_auto_headers=("Content-Type",),
                trust_env=True,  # HTTPS_PROXY and NO_PROXY, as Azure's own tools honour them
            )
            self._limit = asyncio.Semaphore(self.max_inflight)
        return self._session, self._limit

    async def _request(
        self,
        method: str,
        url: str,
        where: BlobPath,
        *,
        headers: dict[str, str] | None = None,
        query: dict[str, str] | None = None,
        data: Buffer | bytes | None = None,
        blob: str | None = None,
        start: int | None = None,
        end: int | None = None,
    ) -> aiohttp.ClientResponse:
        """Send a signed request and wait for its headers; error statuses raised typed."""
        session, _ = self._client()
        headers = dict(headers or {})
        headers["x-ms-date"] = request_date()
        headers["x-ms-version"] = API_VERSION
        if data is not None:
            headers["Content-Length"] = str(len(data))
            headers["Content-Type"] = "application/octet-stream"
        query = dict(query or {})
        path = where.path(blob)
        auth = where.account.auth
        if auth.shared_key is not None:
            auth.shared_key.sign(method, path, query, headers)
        elif auth.bearer is not None:
            headers["Authorization"] = await auth.bearer.header()
        text = "&".join(f"{name}={quote(value, safe='')}" for name, value in query.items())
        if auth.sas is not None:
            text = f"{text}&{auth.sas}" if text else auth.sas
        target = URL(f"{where.origin}{path}{'?' + text if text else ''}", encoded=True)
        response = await send_request(
            session,
            method,
            target,
            headers,
            self.retry,
            lambda exc: self._connection_error(exc, where, url, start, end),
            url,
            start,
            end,
            data,
        )
        if response.status >= 300:
            raise await self._status_error(response, method, where, url, headers, start, end)
        return response

    def _connection_error(
        self, exc: BaseException, where: BlobPath, url: str, start: int | None, end: int | None
    ) -> StoreError:
        endpoint = host_of(where.account.base)
        error = connection_error(exc, endpoint, url, start, end, tls_hint=TLS_HINT)
        if "does not resolve" in str(error):
            detail = (
                f"the Blob service of storage account {where.account.name!r} ({endpoint}) does"
                " not resolve: check the account name (or the endpoint)"
            )
            return fail(type(error), detail, url, start, end)
        return error

    async def _status_error(
        self,
        response: aiohttp.ClientResponse,
        method: str,
        where: BlobPath,
        url: str,
        sent: Mapping[str, str],
        start: int | None,
        end: int | None,
    ) -> BaseException:
        """The typed error for an error answer (its body read and the connection released)."""
        status, reason = response.status, response.reason or ""
        code = response.headers.get("x-ms-error-code", "")
        retry_after = parse_retry_after(response.headers.get("Retry-After"))
        body = b""
        try:
            if method != "HEAD":
                async with asyncio.timeout(5):
                    body = await response.content.read(_ERROR_BODY)
        except (aiohttp.ClientError, OSError, TimeoutError):
            pass
        finally:
            response.close()
        found = _CODE.search(body)
        code = code or (found.group(1).decode(errors="replace") if found else "")
        said = _MESSAGE.search(body)
        message = said.group(1).decode(errors="replace").strip() if said else ""
        account, container = where.account, where.container
        if status == 412:
            return changed(url, sent.get("If-Match") or "?", await self._current_version(url))
        if code == "ContainerNotFound":
            detail = (
                f"the container {container!r} does not exist in storage account"
                f" {account.name!r} (HTTP 404 ContainerNotFound)"
            )
            return fail(BucketNotFoundError, detail, url, start, end)
        if code == "ResourceNotFound":
            detail = (
                f"no storage account {account.name!r} at {account.base} (HTTP 404"
                " ResourceNotFound), or a private container read without credentials"
            )
            return fail(NotFoundError, detail, url, start, end)
        if (
            code in _REJECTED
            or status == 401
            or (code == "AuthorizationFailure" and "authenticate" in message)
        ):
            detail = (
                f"{host_of(account.base)} rejected the credentials"
                f" (HTTP {status} {code}{': ' + message if message else ''}): check"
                f" {self._credentials_hint(where)}"
            )
            return fail(CredentialsError, detail, url, start, end)
        if status == 403:
            if method == "HEAD" and not message:  # no body: a GET says why
                explained = await self._explain_forbidden(where, url)
                if explained is not None:
                    return explained
            detail = (
                f"permission denied (HTTP 403 {code or reason}{': ' + message if message else ''})"
            )
            return fail(PermissionDeniedError, detail, url, start, end)
        return status_error(status, code or reason, url, start, end, retry_after=retry_after)

    def _credentials_hint(self, where: BlobPath) -> str:
        auth = where.account.auth
        if auth.shared_key is not None:
            return f"the account key of {where.account.name!r} (account_key, AZURE_STORAGE_KEY)"
        if auth.sas is not None:
            return "the SAS token (sas_token, AZURE_STORAGE_SAS_TOKEN): its expiry and permissions"
        if auth.bearer is not None:
            return (
                "the Entra ID identity (az login, AZURE_CLIENT_ID...) and its role on the account"
            )
        return "whether the container allows anonymous reads (anon=True sends no credentials)"

    async def _explain_forbidden(self, where: BlobPath, url: str) -> StoreError | None:
        """The error of a one-byte GET of an object whose HEAD was refused without a body,
        if it is a :class:`CredentialsError` (else None: the HEAD's error stands)."""
        try:
            response = await self._request("GET", url, where, headers={"Range": "bytes=0-0"})
        except CredentialsError as exc:
            return exc
        except StoreError:
            return None
        response.close()
        return None

    async def _current_version(self, url: str) -> str | None:
        """The ETag the service reports now (for error messages; None if it cannot tell)."""
        try:
            response = await self._request("HEAD", url, self.where(url))
        except Exception:  # noqa: BLE001 - only decorates an error being raised
            return None
        response.release()
        return response.headers.get("ETag")

    # -- reads --------------------------------------------------------------------------

    async def stat(self, url: str) -> ObjectInfo:
        """Size and ETag from a HEAD (Get Blob Properties)."""
        where = self.where(url)
        _, limit = self._client()
        async with limit:
            response = await self._request("HEAD", url, where)
            response.release()
        length = response.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise fail(StoreError, "size unknown: the service sent no Content-Length", url)
        info = ObjectInfo(int(length), response.headers.get("ETag") or None)
        self._remember(url, info)
        return info

    def _remember(self, url: str, info: ObjectInfo) -> None:
        if len(self._known) >= 1_000_000:
            self._known.clear()
        self._known[url] = info

    async def read_tail(self, url: str, length: int) -> tuple[bytes | bytearray, ObjectInfo]:
        """The last ``min(length, size)`` bytes with the size and ETag: one ranged GET of an
        object this transport has listed or stat'ed (its ETag sent as ``If-Match``), a HEAD
        and the GET otherwise (the Blob service has no suffix ranges)."""
        known = self._known.get(url)
        answer = None if known is None else TailAnswer(None, known.size, known.version)
        tail, info = await tail_from(self, url, length, answer)
        self._remember(url, info)
        return tail, info

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
        where = self.where(url)
        _, limit = self._client()
        first = start + progress.got
        headers = {"Range": f"bytes={first}-{end - 1}"}
        condition = if_match(version)
        if condition is not None:
            headers["If-Match"] = condition
        async with limit:
            response = await self._request("GET", url, where, headers=headers, start=start, end=end)
            progress.version = response.headers.get("ETag") or None
            await receive_range(
                response, buffer, progress, self.retry.idle_timeout, url, start, end, first
            )

    # -- listing ------------------------------------------------------------------------

    async def list(self, url: str) -> builtins.list[str]:
        """URLs of the blobs and folders directly under the prefix ``url``, sorted."""
        return [name for name, _ in await self.list_info(url)]

    async def list_info(self, url: str) -> builtins.list[tuple[str, ObjectInfo | None]]:
        """The entries directly under the prefix ``url`` with each blob's size and ETag
        (None for a folder), sorted; one List Blobs request per 5000 entries. A prefix with
        nothing under it is :class:`NotFoundError` (the container's root is just empty)."""
        where = self.where(url)
        prefix = where.blob.rstrip("/") + "/" if where.blob.strip("/") else ""
        found: dict[str, ObjectInfo | None] = {}
        folders: set[str] = set()
        marker = ""
        _, limit = self._client()
        while True:
            query = {"restype": "container", "comp": "list", "delimiter": "/"}
            query |= {"maxresults": str(_PAGE), "prefix": prefix}
            if marker:
                query["marker"] = marker
            async with limit:
                response = await self._request("GET", url, where, query=query, blob="")
                try:
                    async with asyncio.timeout(self.retry.idle_timeout):
                        body = await response.read()
                except TimeoutError as exc:
                    detail = (
                        f"stalled: a listing page did not arrive in {self.retry.idle_timeout:g} s"
                    )
                    raise fail(StoreTimeoutError, detail, url) from exc
                except (aiohttp.ClientError, OSError) as exc:
                    detail = f"a listing page broke off ({type(exc).__name__})"
                    raise fail(StoreError, detail, url, retryable=True) from exc
                finally:
                    response.release()
            try:
                root = ElementTree.fromstring(body)
            except ElementTree.ParseError as exc:
                raise fail(StoreError, f"the listing is not XML ({exc})", url) from exc
            for blob in root.iter("Blob"):
                name = blob.findtext("Name") or ""
                size = blob.findtext("Properties/Content-Length")
                etag = blob.findtext("Properties/Etag") or None
                if etag is not None and not etag.startswith(('"', "W/")):
                    etag = f'"{etag}"'  # quoted as in the headers of GETs
                entry = f"{where.prefix}/{name}"
                info = ObjectInfo(int(size), etag) if size and size.isdigit() else None
                found[entry] = info
                if info is not None:
                    self._remember(entry, info)
            for prefixed in root.iter("BlobPrefix"):
                folders.add(f"{where.prefix}/{(prefixed.findtext('Name') or '').rstrip('/')}")
            marker = root.findtext("NextMarker") or ""
            if not marker:
                break
        for folder in folders:  # a Data Lake folder is also an empty blob of its name
            found[folder] = None
        if not found and prefix:
            raise fail(NotFoundError, "nothing under this prefix", url)
        return sorted(found.items(), key=lambda item: item[0])

    # -- writes -------------------------------------------------------------------------

    async def write(self, url: str, data: Buffer | bytes) -> None:
        """Write ``data`` as the block blob at ``url`` (one Put Blob; blocks past
        :data:`PUT_LIMIT`), creating the container if it does not exist. Each request is
        retried under the policy (a Put replaces the whole blob: repeating it is safe)."""
        where = self.where(url)
        if not where.blob or where.blob.endswith("/"):
            raise ConfigError(f"{url}: a blob is written at a URL naming one, not a folder")
        self._known.pop(url, None)
        view = memoryview(data).cast("B")
        try:
            await self._write_blob(url, where, view)
        except NotFoundError as exc:
            if "ContainerNotFound" not in str(exc):
                raise
            await self._retried(lambda: self._create_container(url, where), f"create of {url}", url)
            await self._write_blob(url, where, view)

    async def _write_blob(self, url: str, where: BlobPath, data: memoryview) -> None:
        if len(data) <= PUT_LIMIT:
            headers = {"x-ms-blob-type": "BlockBlob"}
            await self._retried(
                lambda: self._put(url, where, data, headers), f"write of {url}", url
            )
            return
        ids = []
        for number, at in enumerate(range(0, len(data), BLOCK_SIZE)):
            block = base64.b64encode(f"{number:08d}".encode()).decode()
            ids.append(block)
            piece = data[at : at + BLOCK_SIZE]
            query = {"comp": "block", "blockid": block}
            await self._retried(
                lambda q=query, p=piece: self._put(url, where, p, {}, q),
                f"write of block {number} of {url}",
                url,
            )
        listing = "".join(f"<Latest>{block}</Latest>" for block in ids)
        body = f'<?xml version="1.0" encoding="utf-8"?><BlockList>{listing}</BlockList>'.encode()
        await self._retried(
            lambda: self._put(url, where, body, {}, {"comp": "blocklist"}), f"write of {url}", url
        )

    async def _retried(self, call: Any, what: str, url: str) -> None:
        await with_retries(self.retry, call, what=what, url=url)

    async def _put(
        self,
        url: str,
        where: BlobPath,
        data: Buffer | bytes,
        headers: dict[str, str],
        query: dict[str, str] | None = None,
    ) -> None:
        _, limit = self._client()
        async with limit:
            response = await self._request(
                "PUT", url, where, headers=headers, query=query, data=data
            )
            response.release()

    async def _create_container(self, url: str, where: BlobPath) -> None:
        _, limit = self._client()
        async with limit:
            try:
                response = await self._request(
                    "PUT", url, where, query={"restype": "container"}, blob="", data=b""
                )
            except StoreError as exc:
                if "ContainerAlreadyExists" in str(exc):  # made by another writer meanwhile
                    return
                raise
            response.release()

    async def close(self) -> None:
        session, self._session = self._session, None
        try:
            if session is not None:
                await session.close()
        finally:
            await self._accounts.close()


def azure_store(
    scheme: str,
    storage_options: Mapping[str, Any],
    *,
    max_inflight: int,
    retry: RetryPolicy = DEFAULT_POLICY,
) -> AzureStore:
    """Registry factory: an :class:`AzureStore` (needs ``pip install 'asyncbatch[azure]'``)."""
    return AzureStore(storage_options, max_inflight=max_inflight, retry=retry)
