"""S3 GETs signed here (SigV4) instead of by botocore, sent on keep-alive connections of
:mod:`~asyncbatch.stores._wire` (over aiohttp through a proxy).

botocore spends about 3.5 ms of CPU per request on signing, event hooks and parsing, which
bounds a store on a 2-core machine to a few hundred requests per second. :class:`SignedGets`
sends the S3 store's GETs (ranges and tails) itself: one request with the headers
SigV4 needs, computed with a cached signing key (a hash and one HMAC per request).
:meth:`SignedGets.get_object` takes ``get_object``'s keyword arguments and returns the part of
botocore's response the store reads; error answers become the ``ClientError`` botocore would
raise, so the store maps both paths' errors with one function.

Only public interfaces of botocore, aiobotocore and s3fs are used, so that both paths agree:

* credentials: as aiobotocore's ``create_client`` picks them for the client s3fs made: the
  key, secret and token given to s3fs (or in its ``client_kwargs``), else the session's
  ``get_credentials()`` (environment, profile, config files, SSO, container and instance
  metadata, ``credential_process``). They are frozen again for every request, so refreshing
  ones renew when they expire; ``anon=True`` (``UNSIGNED``) sends no signature;
* each bucket's URL and signing region: what the client's own ``get_object`` would use
  (endpoint, addressing style, region, FIPS, dual-stack, access points), seen once per
  bucket from a request that botocore builds but never sends: a ``before-sign`` event
  handler (botocore's documented extension point) reads it and stops it;
* TLS: ``verify`` from ``client_kwargs``, else the session's ``ca_bundle``
  (``AWS_CA_BUNDLE``, the config file), else ``REQUESTS_CA_BUNDLE``, else botocore's bundle;
* proxies: the client config's ``proxies``, else the environment's (``HTTPS_PROXY``,
  ``NO_PROXY``), as botocore chooses them.

What this module does not handle goes through botocore's ``get_object`` (several times the CPU
per request), and the store warns once with
:class:`~asyncbatch._errors.SlowPathWarning` naming the reason: a ``signature_version`` other
than SigV4 or ``UNSIGNED``, a client certificate, ``proxies_config``, a bucket whose endpoint
rules ask for another signature (S3 Express, SigV4a, S3 on Outposts, Object Lambda) or extra
headers, and a bucket that answers with a redirect (another region than the client's).
Event handlers registered on the botocore session do not see these GETs.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import os
import re
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from functools import lru_cache
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
from yarl import URL

from ._http import client_session
from ._wire import ConnectTimeout, Pool, Response

#: SHA-256 of the empty body: every GET's payload hash.
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: Error codes botocore follows to another region (its S3RegionRedirector).
_REDIRECTS = {"PermanentRedirect", "AuthorizationHeaderMalformed", "TemporaryRedirect"}
_CODE = re.compile(rb"<Code>([^<]*)</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]*)</Message>")
#: Bytes of an error body read at most (S3's are a few hundred).
_ERROR_BODY = 64 * 1024
#: A bucket not yet resolved (:meth:`SignedGets._bucket`).
_UNKNOWN: Any = object()


@lru_cache(maxsize=16)
def _signing_key(secret: str, day: str, region: str) -> bytes:
    """SigV4's derived key for one day and region (four HMACs, so cached)."""
    key = ("AWS4" + secret).encode()
    for part in (day, region, "s3", "aws4_request"):
        key = hmac.digest(key, part.encode(), "sha256")
    return key


def sign_v4(
    headers: dict[str, str],
    *,
    host: str,
    path: str,
    query: str,
    access_key: str,
    secret_key: str,
    token: str | None,
    region: str,
    now: float | None = None,
) -> None:
    """Add SigV4 ``Authorization``, ``x-amz-date``, ``x-amz-content-sha256`` (and the
    session token) to ``headers`` of a GET of ``path`` (URI-encoded) with ``query``
    (canonical: sorted and encoded). Signs ``host`` and every ``x-amz-*`` header (S3
    refuses unsigned ones); other headers (``Range``, ``If-Match``) need no signature."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    headers["x-amz-date"] = stamp
    headers["x-amz-content-sha256"] = _EMPTY_SHA256
    if token:
        headers["x-amz-security-token"] = token
    signed = {"host": host}
    for name, value in headers.items():
        lower = name.lower()
        if lower.startswith("x-amz-"):
            signed[lower] = value.strip()
    names = sorted(signed)
    signed_names = ";".join(names)
    canonical = "GET\n{}\n{}\n{}\n\n{}\n{}".format(
        path,
        query,
        "\n".join(f"{name}:{signed[name]}" for name in names),
        signed_names,
        _EMPTY_SHA256,
    )
    day = stamp[:8]
    scope = f"{day}/{region}/s3/aws4_request"
    digest = hashlib.sha256(canonical.encode()).hexdigest()
    to_sign = f"AWS4-HMAC-SHA256\n{stamp}\n{scope}\n{digest}"
    signature = hmac.digest(_signing_key(secret_key, day, region), to_sign.encode(), "sha256")
    headers["Authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed_names},"
        f" Signature={signature.hex()}"
    )


class _Bucket:
    """Where a bucket's objects are and how to sign for them; ``None`` fields: unsigned."""

    __slots__ = ("base", "host", "path", "pool", "proxy", "region")

    def __init__(
        self,
        base: str,
        host: str,
        path: str,
        region: str | None,
        proxy: str | None,
        pool: Pool | None,
    ) -> None:
        self.base = base  # scheme://host/[bucket/]: the URL before the key
        self.host = host
        self.path = path  # the URL path before the key (URI-encoded)
        self.region = region
        self.proxy = proxy  # the proxy's URL, as botocore chooses it
        self.pool = pool  # the endpoint's connections (None: through the proxy, by aiohttp)


class _Body:
    """The body of a signed GET, read as botocore's ``StreamingBody`` is."""

    __slots__ = ("_response",)

    def __init__(self, response: aiohttp.ClientResponse | Response) -> None:
        self._response = response

    async def read(self, size: int) -> bytes:
        """The next piece of the body as it arrived (``size`` is not a bound: a piece never
        runs past the body's end): aiohttp's ``read(size)`` would join the pieces into a new
        copy of up to ``size`` bytes, which the store then copies into its buffer again."""
        return await self._response.content.readany()

    def reader(self) -> Callable[[memoryview], Awaitable[int]] | None:
        """``read_into`` where the body is on this module's connections (its pieces copied
        straight into the caller's buffer); None through aiohttp."""
        response = self._response
        return response.read_into if isinstance(response, Response) else None

    def close(self) -> None:
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()  # a body left unread: its connection cannot be reused


class _Seen(Exception):  # noqa: N818 - not an error: how a request was going to be sent
    """Raised by :meth:`SignedGets._resolve`'s ``before-sign`` handler with what botocore
    was about to sign, so the request is never sent."""

    def __init__(
        self, url: str, headers: Mapping[str, str], version: Any, name: str, region: str | None
    ) -> None:
        super().__init__(url)
        self.url = url
        self.headers = headers
        self.signature_version = version
        self.signing_name = name
        self.region = region


#: Headers botocore adds to a GetObject that a signed GET may leave out: S3's checksums of
#: the whole object (asyncbatch checks its own), the SDK's user agent and invocation ids.
_OPTIONAL_HEADERS = {
    "x-amz-checksum-mode",
    "user-agent",
    "amz-sdk-invocation-id",
    "amz-sdk-request",
}


class SignedGets:
    """``get_object`` for one aiobotocore S3 client, sent on up to ``max_inflight``
    connections per endpoint (:mod:`~asyncbatch.stores._wire`; aiohttp's behind a proxy);
    created with :func:`signed_gets`, closed with :meth:`close`.
    ``slow(reason)`` is called when a bucket's GETs must go through botocore."""

    def __init__(
        self,
        client: Any,
        credentials: Callable[[], Awaitable[Any]],
        *,
        max_inflight: int,
        connect_timeout: float,
        verify: Any,
        proxies: Mapping[str, str],
        slow: Callable[[str], None],
    ) -> None:
        from botocore import UNSIGNED
        from botocore.httpsession import ProxyConfiguration

        self._client = client
        self._find_credentials = credentials
        self._credentials: Any = None
        self._max_inflight = max_inflight
        self._connect_timeout = connect_timeout
        self._verify = verify
        self._proxies = ProxyConfiguration(proxies=dict(proxies))
        self._slow = slow
        self._unsigned = client.meta.config.signature_version is UNSIGNED
        self._buckets: dict[str, _Bucket | None] = {}
        self._resolving = asyncio.Lock()
        self._session: aiohttp.ClientSession | None = None
        self._pools: dict[str, Pool] = {}
        self._closed = False

    def _tls(self) -> ssl.SSLContext:
        if self._verify is False:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            return context
        from botocore.httpsession import get_cert_path

        return ssl.create_default_context(cafile=get_cert_path(self._verify))

    def _pool(self, origin: str) -> Pool:
        """The connections to ``origin`` (``scheme://host[:port]``)."""
        pool = self._pools.get(origin)
        if pool is None:
            tls = self._tls() if origin.startswith("https:") else None
            pool = self._pools[origin] = Pool(
                origin, keep=self._max_inflight, connect_timeout=self._connect_timeout, tls=tls
            )
        return pool

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            if self._closed:  # a GET that outlived the store: no session left behind
                raise RuntimeError("this S3 store is closed")
            tls: ssl.SSLContext | bool = False if self._verify is False else self._tls()
            self._session = client_session(self._max_inflight, self._connect_timeout, tls=tls)
        return self._session

    async def _bucket(self, bucket: str) -> _Bucket | None:
        """Where ``bucket`` is and its signing region (None: botocore must send its GETs)."""
        if bucket in self._buckets:
            return self._buckets[bucket]
        from botocore.handlers import validate_bucket_name

        # The check botocore makes before sending (a ParamValidationError: a ConfigError).
        validate_bucket_name({"Bucket": bucket})
        async with self._resolving:  # the first GETs of a run arrive together: resolve once
            if bucket in self._buckets:
                return self._buckets[bucket]
            found = await self._resolve(bucket)
            where: _Bucket | None = None
            if isinstance(found, str):
                self._slow(f"bucket {bucket!r}: {found}")
            else:
                where = found
            self._buckets[bucket] = where
        return where

    async def _resolve(self, bucket: str) -> _Bucket | str:
        """How the client's ``get_object`` would send a GET of ``bucket``: a request built by
        botocore and stopped by a ``before-sign`` handler before it is signed or sent; or
        why this module cannot send it."""
        marker = f"asyncbatch-resolve-{uuid.uuid4().hex}"

        def seen(
            request: Any,
            signature_version: Any = None,
            signing_name: str = "s3",
            region_name: str | None = None,
            **_: Any,
        ) -> None:
            if marker not in request.url:
                return  # another call of the same client
            signing = request.context.get("signing") or {}
            if signing.get("request_credentials") or signing.get("identity_cache") is not None:
                signature_version = "session credentials of its own"  # S3 Express
            raise _Seen(
                request.url,
                request.headers,
                signature_version,
                signing.get("signing_name") or signing_name,
                signing.get("region") or region_name,
            )

        events = self._client.meta.events
        event = "before-sign.s3.GetObject"
        events.register_first(event, seen, unique_id=marker)
        try:
            await self._client.get_object(Bucket=bucket, Key=marker)
        except _Seen as request:
            return self._where(request, marker)
        finally:
            events.unregister(event, unique_id=marker)
        return "botocore answered a GetObject without signing it"

    def _where(self, request: _Seen, marker: str) -> _Bucket | str:
        """The :class:`_Bucket` of a request botocore was about to sign, or why not."""
        from botocore import UNSIGNED

        version = request.signature_version
        sigv4 = version in ("s3v4", "v4") and request.signing_name == "s3"
        if version is not UNSIGNED and not sigv4:
            return (
                f"its endpoint rules ask for signature {version!r} for {request.signing_name!r},"
                " not SigV4 for 's3'"
            )
        names = (name.lower() for name in request.headers)
        extra = sorted(name for name in names if name not in _OPTIONAL_HEADERS)
        if extra:
            return f"its endpoint rules add headers {', '.join(extra)}"
        url = request.url.split("?", 1)[0]
        if not url.endswith("/" + marker):
            return f"botocore sends its GETs to {request.url!r}, not to a URL ending in the key"
        parts = urlsplit(url.removesuffix(marker))
        host = parts.netloc
        default_port = {"http": ":80", "https": ":443"}.get(parts.scheme)
        if default_port:
            host = host.removesuffix(default_port)
        base = f"{parts.scheme}://{parts.netloc}{parts.path}"
        region = None if version is UNSIGNED else (request.region or "us-east-1")
        proxy = self._proxies.proxy_url_for(base)
        pool = None if proxy else self._pool(f"{parts.scheme}://{parts.netloc}")
        return _Bucket(base, host, parts.path, region, proxy, pool)

    async def get_object(
        self,
        *,
        Bucket: str,  # noqa: N803 - botocore's parameter names
        Key: str,  # noqa: N803
        VersionId: str | None = None,  # noqa: N803
        Range: str | None = None,  # noqa: N803
        IfMatch: str | None = None,  # noqa: N803
        RequestPayer: str | None = None,  # noqa: N803
    ) -> dict[str, Any]:
        """The GET botocore's ``get_object`` would send; returns the fields of its response
        the store reads (``Body``, ``ETag``, ``VersionId``, ``ContentRange``,
        ``ContentLength``, ``ResponseMetadata``). An error status raises botocore's
        ``ClientError``; a connect timeout, its ``ConnectTimeoutError``; other aiohttp and
        OS errors pass unchanged."""
        where = self._buckets.get(Bucket, _UNKNOWN)
        if where is _UNKNOWN:  # the first GET of a bucket (no coroutine for the others)
            where = await self._bucket(Bucket)
        if where is None:
            kwargs = {"Bucket": Bucket, "Key": Key, "VersionId": VersionId, "Range": Range}
            kwargs |= {"IfMatch": IfMatch, "RequestPayer": RequestPayer}
            given = {name: value for name, value in kwargs.items() if value is not None}
            return await self._client.get_object(**given)  # type: ignore[no-any-return]
        headers: dict[str, str] = {}
        if Range is not None:
            headers["Range"] = Range
        if IfMatch is not None:
            headers["If-Match"] = IfMatch
        if RequestPayer is not None:
            headers["x-amz-request-payer"] = RequestPayer
        key = quote(Key, safe="/~")  # as botocore encodes it
        query = "" if VersionId is None else f"versionId={quote(VersionId, safe='-_.~')}"
        if where.region is not None:
            await self._sign(headers, where, where.path + key, query)
        url = where.base + key + (f"?{query}" if query else "")
        response: aiohttp.ClientResponse | Response
        try:
            if where.pool is not None:
                response = await where.pool.request("GET", url, headers)
            else:
                response = await self._http().get(
                    URL(url, encoded=True),
                    headers=headers,
                    allow_redirects=False,
                    proxy=where.proxy,
                )
        except (aiohttp.ConnectionTimeoutError, ConnectTimeout) as exc:
            from botocore.exceptions import ConnectTimeoutError

            raise ConnectTimeoutError(endpoint_url=where.base) from exc
        if response.status >= 300:
            error, code = await _client_error(response)
            if code in _REDIRECTS:
                region = response.headers.get("x-amz-bucket-region") or "another region"
                self._slow(
                    f"bucket {Bucket!r} answered {code} (it is in {region}, the client signs for"
                    f" {where.region}): set client_kwargs={{'region_name': ...}}"
                )
                self._buckets[Bucket] = None  # botocore knows how to follow it
                return await self.get_object(
                    Bucket=Bucket,
                    Key=Key,
                    VersionId=VersionId,
                    Range=Range,
                    IfMatch=IfMatch,
                    RequestPayer=RequestPayer,
                )
            raise error
        length = response.headers.get("Content-Length")
        return {
            "Body": _Body(response),
            "ETag": response.headers.get("ETag"),
            "VersionId": response.headers.get("x-amz-version-id"),
            "ContentRange": response.headers.get("Content-Range"),
            "ContentLength": int(length) if length is not None and length.isdigit() else None,
            "ResponseMetadata": {"HTTPStatusCode": response.status},
        }

    async def _sign(self, headers: dict[str, str], where: _Bucket, path: str, query: str) -> None:
        assert where.region is not None
        if self._credentials is None:
            self._credentials = await self._find_credentials()
            if self._credentials is None:
                raise _no_credentials()
        frozen = self._credentials.get_frozen_credentials()
        # aiobotocore's is a coroutine (a refresh may await); botocore's, a tuple. Not
        # ``inspect.isawaitable``: its ABC check costs more than the rest of a GET's signing.
        if inspect.iscoroutine(frozen):
            frozen = await frozen
        if not frozen.access_key or not frozen.secret_key:
            raise _no_credentials()
        sign_v4(
            headers,
            host=where.host,
            path=path,
            query=query,
            access_key=frozen.access_key,
            secret_key=frozen.secret_key,
            token=frozen.token,
            region=where.region,
        )

    async def close(self) -> None:
        session, self._session = self._session, None
        pools, self._closed = list(self._pools.values()), True
        for pool in pools:
            await pool.close()
        if session is not None:
            await session.close()


def _no_credentials() -> Exception:
    from botocore.exceptions import NoCredentialsError

    error: Exception = NoCredentialsError()
    return error


async def _client_error(response: aiohttp.ClientResponse | Response) -> tuple[Exception, str]:
    """botocore's ``ClientError`` for an error answer, and its code: the XML ``<Code>`` and
    ``<Message>``, or the status as the code when there is no body (as botocore parses it)."""
    from botocore.exceptions import ClientError

    try:
        async with asyncio.timeout(5):
            body = await response.content.read(_ERROR_BODY)
    except (aiohttp.ClientError, OSError, TimeoutError):
        body = b""
    finally:
        response.close()
    found = _CODE.search(body)
    message = _MESSAGE.search(body)
    code = found.group(1).decode() if found else str(response.status)
    headers = {name.lower(): value for name, value in response.headers.items()}
    answer: Mapping[str, Any] = {
        "Error": {
            "Code": code,
            "Message": message.group(1).decode() if message else (response.reason or ""),
        },
        "ResponseMetadata": {"HTTPStatusCode": response.status, "HTTPHeaders": headers},
    }
    error: Exception = ClientError(answer, "GetObject")
    return error, code


def signed_gets(
    fs: Any,
    client: Any,
    *,
    max_inflight: int,
    connect_timeout: float,
    slow: Callable[[str], None],
) -> SignedGets | str:
    """A :class:`SignedGets` for ``client``, the aiobotocore client of the s3fs filesystem
    ``fs``; or, when the client's configuration needs botocore, the reason why."""
    from botocore import UNSIGNED
    from botocore.utils import get_environ_proxies

    config = client.meta.config
    version = config.signature_version
    if version not in (None, "s3v4", "v4", UNSIGNED):
        return f"signature_version={version!r} (signed here: SigV4 and UNSIGNED)"
    if config.client_cert:
        return "a client certificate (client_cert)"
    if any((config.proxies_config or {}).values()):
        return f"proxies_config={config.proxies_config!r}"
    client_kwargs = dict(fs.client_kwargs or {})
    verify = client_kwargs.get("verify")
    if verify is None:
        verify = fs.session.get_config_variable("ca_bundle")
    if verify is None:
        verify = os.environ.get("REQUESTS_CA_BUNDLE", True)
    proxies = config.proxies or get_environ_proxies(client.meta.endpoint_url)
    key = client_kwargs.get("aws_access_key_id", fs.key)
    secret = client_kwargs.get("aws_secret_access_key", fs.secret)
    token = client_kwargs.get("aws_session_token", fs.token)

    async def credentials() -> Any:
        """The credentials aiobotocore's ``create_client`` gave the client."""
        if key is not None and secret is not None:
            from botocore.credentials import Credentials

            return Credentials(key, secret, token)
        return await fs.session.get_credentials()

    return SignedGets(
        client,
        credentials,
        max_inflight=max_inflight,
        connect_timeout=connect_timeout,
        verify=verify,
        proxies=proxies,
        slow=slow,
    )
