"""S3 GETs over aiohttp, signed here (SigV4) instead of by botocore.

botocore spends about 3.5 ms of CPU per request on signing, event hooks and parsing, which
bounds a store on a 2-core machine to a few hundred requests per second. :class:`SignedGets`
sends the S3 store's GETs (ranges and tails) itself: one aiohttp request with the headers
SigV4 needs, computed with a cached signing key (a hash and one HMAC per request).
:meth:`SignedGets.get_object` takes ``get_object``'s keyword arguments and returns the part of
botocore's response the store reads; error answers become the ``ClientError`` botocore would
raise, so the store maps both paths' errors with one function.

Everything else comes from the aiobotocore client s3fs made, so both paths agree:

* credentials: frozen again for every request (refreshing ones renew when they expire),
  with the session token sent as ``X-Amz-Security-Token``; ``anon=True`` (``UNSIGNED``)
  sends no signature;
* each bucket's URL and signing region: resolved once per bucket by the client's endpoint
  rules (``_resolve_endpoint_ruleset``, as its ``get_object`` does), which apply its endpoint,
  addressing style (path-style for an IP ``endpoint_url``, virtual-hosted on AWS), region,
  FIPS and dual-stack settings;
* TLS: the client's ``verify`` (a CA bundle, or off) and its default CA bundle.

:func:`signed_gets` returns None (the store keeps botocore's ``get_object``) for what this
module does not handle: a ``signature_version`` other than SigV4 or ``UNSIGNED``, a proxy
(configured or from the environment), a client certificate. An access point ARN, a bucket
whose endpoint rules ask for another signature (S3 Express, SigV4a, S3 on Outposts) or extra
headers, and a bucket that answers with a redirect (another region), go through botocore
from then on.
Event handlers registered on the botocore session do not see these GETs.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import re
import ssl
import time
from collections.abc import Mapping
from functools import lru_cache
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp
from yarl import URL

#: SHA-256 of the empty body: every GET's payload hash.
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: Error codes botocore follows to another region (its S3RegionRedirector).
_REDIRECTS = {"PermanentRedirect", "AuthorizationHeaderMalformed", "TemporaryRedirect"}
_CODE = re.compile(rb"<Code>([^<]*)</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]*)</Message>")
#: Bytes of an error body read at most (S3's are a few hundred).
_ERROR_BODY = 64 * 1024


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
    signature = hmac.new(_signing_key(secret_key, day, region), to_sign.encode(), "sha256")
    headers["Authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed_names},"
        f" Signature={signature.hexdigest()}"
    )


class _Bucket:
    """Where a bucket's objects are and how to sign for them; ``None`` fields: unsigned."""

    __slots__ = ("base", "host", "path", "region")

    def __init__(self, base: str, host: str, path: str, region: str | None) -> None:
        self.base = base  # scheme://host/[bucket/]: the URL before the key
        self.host = host
        self.path = path  # the URL path before the key (URI-encoded)
        self.region = region


class _Body:
    """The body of a signed GET, read as botocore's ``StreamingBody`` is."""

    __slots__ = ("_response",)

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response

    async def read(self, size: int) -> bytes:
        return await self._response.content.read(size)

    def close(self) -> None:
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()  # a body left unread: its connection cannot be reused


class SignedGets:
    """``get_object`` for one aiobotocore S3 client, sent over a pool of ``max_inflight``
    aiohttp connections; created with :func:`signed_gets`, closed with :meth:`close`."""

    def __init__(
        self, client: Any, *, max_inflight: int, connect_timeout: float, verify: Any
    ) -> None:
        from botocore import UNSIGNED

        self._client = client
        self._max_inflight = max_inflight
        self._connect_timeout = connect_timeout
        self._verify = verify
        self._unsigned = client.meta.config.signature_version is UNSIGNED
        self._buckets: dict[str, _Bucket | None] = {}
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            tls: ssl.SSLContext | bool = False
            if self._verify is not False:
                from botocore.httpsession import get_cert_path

                tls = ssl.create_default_context(cafile=get_cert_path(self._verify))
            connector = aiohttp.TCPConnector(limit=self._max_inflight, limit_per_host=0, ssl=tls)
            self._session = aiohttp.ClientSession(
                connector=connector,
                # The connect phase only; the store times headers and body itself.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout),
                auto_decompress=False,
                headers={"Accept-Encoding": "identity"},
            )
        return self._session

    async def _bucket(self, bucket: str) -> _Bucket | None:
        """Where ``bucket`` is and its signing region, as botocore's endpoint rules resolve
        them for a GetObject (None: botocore must send its GETs)."""
        if bucket in self._buckets:
            return self._buckets[bucket]
        from botocore.handlers import validate_bucket_name

        # The check botocore makes before sending (a ParamValidationError: a ConfigError).
        validate_bucket_name({"Bucket": bucket})
        where: _Bucket | None = None
        client = self._client
        context: dict[str, Any] = {}
        try:
            operation = client.meta.service_model.operation_model("GetObject")
            endpoint, headers, _ = await client._resolve_endpoint_ruleset(
                operation, {"Bucket": bucket, "Key": "k"}, context
            )
        except Exception:  # noqa: BLE001 - an invalid bucket name, another botocore, ...:
            endpoint, headers = None, None  # botocore's get_object raises its own error or copes
        signing = context.get("signing", {})
        region = signing.get("region") or client.meta.region_name or "us-east-1"
        wanted = "none" if self._unsigned else "v4"
        if (
            endpoint
            and not headers
            and not bucket.startswith("arn:")  # access points: botocore's
            and context.get("auth_type") in (None, wanted)
            and signing.get("signing_name", "s3") == "s3"
        ):
            parts = urlsplit(endpoint)
            host = parts.netloc
            default_port = {"http": ":80", "https": ":443"}.get(parts.scheme)
            if default_port:
                host = host.removesuffix(default_port)
            path = parts.path.rstrip("/") + "/"
            base = f"{parts.scheme}://{parts.netloc}{path}"
            where = _Bucket(base, host, path, None if self._unsigned else region)
        self._buckets[bucket] = where
        return where

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
        the store reads (``Body``, ``ETag``, ``ContentRange``, ``ContentLength``,
        ``ResponseMetadata``). An error status raises botocore's ``ClientError``; a connect
        timeout, its ``ConnectTimeoutError``; other aiohttp and OS errors pass unchanged."""
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
        url = URL(where.base + key + (f"?{query}" if query else ""), encoded=True)
        try:
            response = await self._http().get(url, headers=headers, allow_redirects=False)
        except aiohttp.ConnectionTimeoutError as exc:
            from botocore.exceptions import ConnectTimeoutError

            raise ConnectTimeoutError(endpoint_url=where.base) from exc
        if response.status >= 300:
            error, code = await _client_error(response)
            if code in _REDIRECTS:
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
            "ContentRange": response.headers.get("Content-Range"),
            "ContentLength": int(length) if length is not None and length.isdigit() else None,
            "ResponseMetadata": {"HTTPStatusCode": response.status},
        }

    async def _sign(self, headers: dict[str, str], where: _Bucket, path: str, query: str) -> None:
        from botocore.exceptions import NoCredentialsError

        assert where.region is not None
        credentials = self._client._request_signer._credentials  # what botocore signs with
        if credentials is None:
            raise NoCredentialsError()
        frozen = credentials.get_frozen_credentials()
        if inspect.isawaitable(frozen):  # aiobotocore's: a refresh may await
            frozen = await frozen
        if not frozen.access_key or not frozen.secret_key:
            raise NoCredentialsError()
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
        if session is not None:
            await session.close()


async def _client_error(response: aiohttp.ClientResponse) -> tuple[Exception, str]:
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


def signed_gets(client: Any, *, max_inflight: int, connect_timeout: float) -> SignedGets | None:
    """A :class:`SignedGets` for ``client``, or None when its configuration needs botocore
    (see the module's docstring)."""
    from botocore import UNSIGNED

    config = client.meta.config
    # Private parts of botocore this path reads: another botocore without them keeps its GETs.
    signer = getattr(client, "_request_signer", None)
    if not hasattr(signer, "_credentials") or not hasattr(client, "_resolve_endpoint_ruleset"):
        return None
    if getattr(config, "signature_version", None) not in (None, "s3v4", "v4", UNSIGNED):
        return None
    if getattr(config, "proxies", None) or getattr(config, "client_cert", None):
        return None
    http_session = getattr(client._endpoint, "http_session", None)
    proxies = getattr(http_session, "_proxy_config", None)
    if proxies is None or proxies.proxy_url_for(client.meta.endpoint_url):
        return None  # a proxy from the environment (HTTPS_PROXY), or an unknown session
    verify = getattr(http_session, "_verify", True)
    return SignedGets(
        client, max_inflight=max_inflight, connect_timeout=connect_timeout, verify=verify
    )
