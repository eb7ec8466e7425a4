"""Azure Blob Storage: where an account's blobs are and how requests to them are signed.

Credentials are found as Azure's own tools find them, first match wins:

1. ``storage_options`` (adlfs's names): ``connection_string``; ``anon=True`` (public
   containers: nothing sent); ``account_key`` (Shared Key, signed here); ``sas_token``
   (appended to every URL); ``credential`` (an azure-identity credential, sync or async, or
   what azure-storage-blob also takes there: a key or SAS string, ``AzureNamedKeyCredential``,
   ``AzureSasCredential``);
   ``tenant_id`` + ``client_id`` + ``client_secret`` (a service principal).
2. The environment: ``AZURE_STORAGE_CONNECTION_STRING``; ``AZURE_STORAGE_KEY`` (or adlfs's
   ``AZURE_STORAGE_ACCOUNT_KEY``); ``AZURE_STORAGE_SAS_TOKEN``.
3. azure-identity's ``DefaultAzureCredential``: the service principal variables
   (``AZURE_TENANT_ID``, ``AZURE_CLIENT_ID``, ``AZURE_CLIENT_SECRET`` or a certificate),
   workload and managed identity, ``az login``, ``azd`` and PowerShell sessions.

The account comes from ``account_name``, a connection string, the URL
(``abfs://container@account.dfs.core.windows.net/path``) or ``AZURE_STORAGE_ACCOUNT_NAME``
(or the Azure CLI's ``AZURE_STORAGE_ACCOUNT``). ``endpoint`` (or a connection string's
``BlobEndpoint``) names another service, such as Azurite's
``http://127.0.0.1:10000/devstoreaccount1``; ``account_host`` (adlfs) another host.

Shared Key is the documented HMAC-SHA256 scheme ("Authorize with Shared Key", Azure
Storage REST docs), computed here per request in microseconds; Entra ID (OAuth) tokens are
fetched by azure-identity, kept until five minutes before they expire, and sent as
``Authorization: Bearer``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import inspect
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import formatdate
from typing import Any
from urllib.parse import urlsplit

from .._errors import ConfigError, CredentialsError, StoreTimeoutError

#: The Blob service REST version every request asks for (Put Blob up to 5000 MiB, bearer
#: tokens, ``x-ms-range``).
API_VERSION = "2023-11-03"
#: The scope of an Entra ID token for Azure Storage.
STORAGE_SCOPE = "https://storage.azure.com/.default"
#: Azurite's well-known development account and key (public, in Microsoft's docs).
DEV_ACCOUNT = "devstoreaccount1"
DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
DEV_ENDPOINT = "http://127.0.0.1:10000/devstoreaccount1"

#: The ``storage_options`` this store takes (adlfs's names, plus ``endpoint``).
OPTION_NAMES = frozenset(
    {
        "account_name",
        "account_key",
        "sas_token",
        "connection_string",
        "credential",
        "tenant_id",
        "client_id",
        "client_secret",
        "anon",
        "endpoint",
        "account_host",
    }
)

#: Headers Shared Key signs by position, in order (``Date`` is sent as ``x-ms-date``).
_SIGNED = (
    "Content-Encoding",
    "Content-Language",
    "Content-Length",
    "Content-MD5",
    "Content-Type",
    "Date",
    "If-Modified-Since",
    "If-Match",
    "If-None-Match",
    "If-Unmodified-Since",
    "Range",
)

NO_CREDENTIALS = (
    "no Azure credentials found: pass storage_options account_key=, sas_token= or"
    " connection_string= (or tenant_id=, client_id= and client_secret=), set"
    " AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_KEY, run `az login`, or pass anon=True"
    " for a public container"
)


def parse_connection_string(text: str) -> dict[str, str]:
    """The ``Key=Value;...`` fields of an Azure Storage connection string; raises
    :class:`ConfigError` for one that is not."""
    fields: dict[str, str] = {}
    for part in text.strip().strip(";").split(";"):
        name, equals, value = part.partition("=")
        if not equals or not name.strip():
            raise ConfigError(
                "connection_string is not an Azure Storage connection string"
                f" (Key=Value;... expected, got a part {part.split('=')[0][:20]!r}...)"
            )
        fields[name.strip()] = value.strip()
    if fields.get("UseDevelopmentStorage", "").lower() == "true":
        proxy = fields.get("DevelopmentStorageProxyUri")
        endpoint = f"{proxy.rstrip('/')}/{DEV_ACCOUNT}" if proxy else DEV_ENDPOINT
        fields = {"AccountName": DEV_ACCOUNT, "AccountKey": DEV_KEY, "BlobEndpoint": endpoint}
    return fields


class SharedKey:
    """Signs requests with an account key (``Authorization: SharedKey account:signature``)."""

    def __init__(self, account: str, key: str) -> None:
        try:
            self._key = base64.b64decode(key, validate=True)
        except ValueError as exc:
            raise ConfigError(
                f"account_key of Azure storage account {account!r} is not base64: copy it"
                " whole from the portal's Access keys, or `az storage account keys list`"
            ) from exc
        self.account = account

    def sign(
        self, method: str, path: str, query: Mapping[str, str], headers: dict[str, str]
    ) -> None:
        """Add ``Authorization`` to ``headers`` of a request for ``path`` (as sent: encoded)
        with ``query`` (decoded values, signed as they are: the service signs the values it
        decoded, so a value holding ``%41`` is signed as ``%41``, not unquoted again)."""
        lower = {name.lower(): value for name, value in headers.items()}
        if lower.get("content-length") == "0":
            del lower["content-length"]  # signed as empty since version 2015-02-21
        lines = [method]
        lines += [lower.get(name.lower(), "") for name in _SIGNED]
        lines += [
            f"{name}:{lower[name].strip()}" for name in sorted(lower) if name.startswith("x-ms-")
        ]
        resource = f"/{self.account}{path}"
        for name in sorted(query):
            resource += f"\n{name.lower()}:{query[name]}"
        lines.append(resource)
        digest = hmac.digest(self._key, "\n".join(lines).encode(), "sha256")
        headers["Authorization"] = f"SharedKey {self.account}:{base64.b64encode(digest).decode()}"


#: Tokens of the credentials this module made, by how they were made (``DefaultAzureCredential``
#: or one service principal), kept across stores: every loader and every opening makes a
#: store of its own, and asking ``az login`` or a metadata service again each time costs a
#: second or more.
_TOKENS: dict[tuple[str, ...], tuple[str, float]] = {}
#: The environment variables azure-identity's DefaultAzureCredential reads.
_IDENTITY_VARIABLES = (
    "AZURE_TENANT_ID",
    "AZURE_CLIENT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_CLIENT_CERTIFICATE_PATH",
    "AZURE_USERNAME",
    "AZURE_FEDERATED_TOKEN_FILE",
    "AZURE_AUTHORITY_HOST",
    "IDENTITY_ENDPOINT",
    "MSI_ENDPOINT",
)


class BearerToken:
    """Entra ID tokens from an azure-identity credential, renewed before they expire.

    ``shared``: the key under which tokens of a credential made here are kept for the
    process (None for one the user gave: its own cache lives as long as it does)."""

    #: Seconds before expiry a token is renewed.
    MARGIN = 300.0
    #: Seconds a credential may take to give a token (``DefaultAzureCredential`` tries
    #: several sources in turn: the environment, workload and managed identity, ``az``).
    TIMEOUT = 60.0

    def __init__(
        self, credential: Any, *, owned: bool, shared: tuple[str, ...] | None = None
    ) -> None:
        self._credential = credential
        self._owned = owned  # created here: closed here
        self._shared = shared
        self._token: str | None = None
        self._expires = 0.0
        self._lock: asyncio.Lock | None = None
        if shared is not None and shared in _TOKENS:
            self._token, self._expires = _TOKENS[shared]

    async def header(self) -> str:
        """``Bearer <token>``, fetched or renewed when needed."""
        if self._token is None or time.time() > self._expires - self.MARGIN:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                if self._token is None or time.time() > self._expires - self.MARGIN:
                    await self._renew()
                    if self._shared is not None and self._token is not None:
                        _TOKENS[self._shared] = (self._token, self._expires)
        return f"Bearer {self._token}"

    async def _renew(self) -> None:
        get_token = self._credential.get_token
        try:
            async with asyncio.timeout(self.TIMEOUT):
                if inspect.iscoroutinefunction(get_token):
                    token = await get_token(STORAGE_SCOPE)
                else:  # a sync credential: its HTTP calls must not block the loop
                    token = await asyncio.to_thread(get_token, STORAGE_SCOPE)
        except TimeoutError as exc:
            raise StoreTimeoutError(
                f"no token from the Azure credential within {self.TIMEOUT:g} s"
                f" ({type(self._credential).__name__})"
            ) from exc
        except Exception as exc:  # azure-identity's ClientAuthenticationError and kin
            said = " ".join(str(exc).split())
            if len(said) > 600:
                said = said[:600] + "..."
            raise CredentialsError(f"{NO_CREDENTIALS} (azure-identity: {said})") from exc
        self._token = token.token
        self._expires = float(token.expires_on)

    async def close(self) -> None:
        close = getattr(self._credential, "close", None)
        if self._owned and close is not None:
            done = close()
            if inspect.isawaitable(done):
                await done


@dataclass(frozen=True)
class Auth:
    """How requests are authorised: one of a Shared Key, a SAS token (query string), a
    bearer token, or nothing (``anon``)."""

    shared_key: SharedKey | None = None
    sas: str | None = None
    bearer: BearerToken | None = None


@dataclass(frozen=True)
class Account:
    """The account's name, where its Blob service is (``base``: scheme, host and, for an
    emulator, the account's path), and how to authorise requests to it."""

    name: str
    base: str
    auth: Auth


class AccountFinder:
    """Finds each account's endpoint and credentials from ``storage_options`` and the
    environment (see the module docstring); made once per store."""

    def __init__(self, options: Mapping[str, Any], environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        self._options = dict(options)
        given = self._options
        connection = given.get("connection_string")
        credential_options = {"account_key", "sas_token", "credential", "client_secret", "anon"}
        chosen = {name for name in credential_options if given.get(name) not in (None, False)}
        if connection is None and not chosen:
            connection = env.get("AZURE_STORAGE_CONNECTION_STRING") or None
        self._connection = parse_connection_string(connection) if connection else {}
        fields = self._connection
        endpoint = given.get("endpoint") or fields.get("BlobEndpoint")
        if endpoint is not None:
            parts = urlsplit(str(endpoint))
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(
                    f"endpoint {endpoint!r} is not an http(s) URL: give the Blob service's"
                    f" URL, such as {DEV_ENDPOINT} for Azurite"
                )
        self.endpoint = None if endpoint is None else str(endpoint).rstrip("/")
        host = given.get("account_host")
        self._host = None if host is None else str(host)
        self._suffix = fields.get("EndpointSuffix", "core.windows.net")
        self._protocol = fields.get("DefaultEndpointsProtocol", "https")
        self._default_name = (
            given.get("account_name")
            or fields.get("AccountName")
            or self._name_in_endpoint()
            or env.get("AZURE_STORAGE_ACCOUNT_NAME")
            or env.get("AZURE_STORAGE_ACCOUNT")
            or None
        )
        self._env = env
        self._accounts: dict[str, Account] = {}
        self._bearer: BearerToken | None = None
        self._anon = bool(given.get("anon", False))
        if "anon" in given and not isinstance(given["anon"], bool):
            raise ConfigError(f"storage_options anon= must be True or False, got {given['anon']!r}")

    def _name_in_endpoint(self) -> str | None:
        """The account an emulator's endpoint names in its path (``/devstoreaccount1``)."""
        if self.endpoint is None:
            return None
        path = urlsplit(self.endpoint).path.strip("/")
        return path.split("/")[0] or None

    @property
    def default_name(self) -> str | None:
        """The account of URLs that name none (``az://container/path``)."""
        return None if self._default_name is None else str(self._default_name)

    def account(self, name: str | None, host: str | None = None) -> Account:
        """The account ``name`` (the default one if None), its Blob service at ``host`` if
        the URL named one (``account.dfs.core.windows.net`` is read at ``account.blob...``)."""
        name = name or self.default_name
        if not name:
            raise ConfigError(
                "no Azure storage account given: pass storage_options account_name= (or a"
                " connection_string=), set AZURE_STORAGE_ACCOUNT_NAME, or name it in the URL:"
                " abfs://container@account.dfs.core.windows.net/path"
            )
        key = f"{name}@{host or ''}"
        found = self._accounts.get(key)
        if found is None:
            found = Account(name, self._base(name, host), self._auth(name))
            self._accounts[key] = found
        return found

    def _base(self, name: str, host: str | None) -> str:
        if self.endpoint is not None:
            return self.endpoint
        if host is not None:
            labels = host.split(".")
            if len(labels) > 2 and labels[1] == "dfs":  # Data Lake's host: same account
                labels[1] = "blob"
            return f"https://{'.'.join(labels)}"
        if self._host is not None:
            return self._host if "://" in self._host else f"https://{self._host}"
        return f"{self._protocol}://{name}.blob.{self._suffix}"

    def _auth(self, name: str) -> Auth:
        given, fields, env = self._options, self._connection, self._env
        if self._anon:
            return Auth()
        key = given.get("account_key") or fields.get("AccountKey")
        sas = given.get("sas_token") or fields.get("SharedAccessSignature")
        credential: Any = given.get("credential")
        # What azure-storage-blob takes as credential= besides a token credential: a key or
        # SAS string, AzureNamedKeyCredential (.named_key), AzureSasCredential (.signature).
        if isinstance(credential, str):
            key, sas = (None, credential) if "sig=" in credential else (credential, None)
        elif hasattr(credential, "named_key"):
            key = credential.named_key[1]
        elif hasattr(credential, "signature"):
            sas = credential.signature
        explicit = {"credential", "client_secret", "tenant_id", "client_id"} & given.keys()
        if key is None and sas is None and not explicit:
            key = env.get("AZURE_STORAGE_KEY") or env.get("AZURE_STORAGE_ACCOUNT_KEY") or None
            sas = env.get("AZURE_STORAGE_SAS_TOKEN") or None
        if key is not None:
            return Auth(shared_key=SharedKey(name, str(key)))
        if sas is not None:
            return Auth(sas=str(sas).lstrip("?"))
        return Auth(bearer=self._token_source())

    def _token_source(self) -> BearerToken:
        """One bearer token source for the store: the credential given, a service
        principal's, or ``DefaultAzureCredential``."""
        if self._bearer is not None:
            return self._bearer
        given = self._options
        if given.get("credential") is not None:
            self._bearer = BearerToken(given["credential"], owned=False)
            return self._bearer
        try:
            from azure.identity import aio
        except ImportError as exc:
            raise CredentialsError(
                f"{NO_CREDENTIALS}; Entra ID (az login, service principals, managed identity)"
                f" needs azure-identity: pip install 'asyncbatch[azure]' ({exc})"
            ) from exc
        parts = [given.get(name) for name in ("tenant_id", "client_id", "client_secret")]
        if any(parts):
            if not all(parts):
                missing = [
                    name
                    for name, value in zip(
                        ("tenant_id", "client_id", "client_secret"), parts, strict=True
                    )
                    if not value
                ]
                raise ConfigError(
                    "a service principal needs storage_options tenant_id=, client_id= and"
                    f" client_secret=: {', '.join(missing)} missing"
                )
            credential: Any = aio.ClientSecretCredential(*map(str, parts))
            digest = hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()
            shared: tuple[str, ...] = ("service principal", digest)
        else:
            credential = aio.DefaultAzureCredential()
            # Keyed by what DefaultAzureCredential reads first: other variables, other tokens.
            found = "\0".join(os.environ.get(name, "") for name in _IDENTITY_VARIABLES)
            shared = ("default", hashlib.sha256(found.encode()).hexdigest())
        self._bearer = BearerToken(credential, owned=True, shared=shared)
        return self._bearer

    async def close(self) -> None:
        bearer, self._bearer = self._bearer, None
        if bearer is not None:
            await bearer.close()


def request_date() -> str:
    """``x-ms-date``: now, as RFC 1123 (cached per second: one string per request costs)."""
    now = int(time.time())
    if _DATE[0] != now:
        _DATE[:] = [now, formatdate(now, usegmt=True)]
    return str(_DATE[1])


_DATE: list[Any] = [0, ""]
