"""Credentials of the GCS store, found as Google's own tools find them (google-auth).

``token`` (a storage option, as gcsfs spells it) says where they come from:

* ``None`` (the default): Application Default Credentials, ``google.auth.default()``: the
  key file named by ``GOOGLE_APPLICATION_CREDENTIALS`` (a service account, an authorized
  user, workload identity federation), then ``gcloud auth application-default login``'s file,
  then the metadata server of a GCE VM, GKE pod or Cloud Run service. With
  ``STORAGE_EMULATOR_HOST`` set, no credentials (as Google's client libraries do there);
* ``"google_default"``: Application Default Credentials even with an emulator;
* ``"cloud"``: the metadata server only;
* ``"anon"``: no credentials (a public bucket, an emulator);
* a path to a JSON file of any kind google-auth loads, or that JSON as a ``dict``;
* a ``google.auth.credentials.Credentials`` object.

A token is fetched (or refreshed, before it expires) in a worker thread, one refresh at a
time in the process, each of google-auth's HTTP requests bounded by the store's
connect and first-byte timeouts; credentials are loaded once per process (and per key file,
``token=`` dict, or values of the variables that say where default ones are).
Token requests are google-auth's own, with its own few retries of a token endpoint's
transient errors (the storage requests themselves are retried by the store's stack alone).
Failures are typed: no credentials found or a token refused is a
:class:`~asyncbatch._errors.CredentialsError` naming the fix; a token endpoint that cannot
be reached, a retryable :class:`~asyncbatch._errors.StoreError`.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._errors import ConfigError, CredentialsError, StoreError
from .._redact import stand_in
from ._ranged import fail

#: OAuth scopes by gcsfs's ``access`` names.
SCOPES = {
    "read_only": "https://www.googleapis.com/auth/devstorage.read_only",
    "read_write": "https://www.googleapis.com/auth/devstorage.read_write",
    "full_control": "https://www.googleapis.com/auth/devstorage.full_control",
}

TOKEN_KINDS = ("anon", "google_default", "cloud")

_NO_CREDENTIALS = (
    "no Google credentials found ({reason}): set GOOGLE_APPLICATION_CREDENTIALS to a key file,"
    " run `gcloud auth application-default login`, run on Google Cloud (metadata server), pass"
    " storage_options token= (a key file, a dict or a Credentials object), or token='anon'"
    " for a public bucket"
)

#: Environment variables that say where default credentials are.
_WHERE = ("GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG", "GCE_METADATA_HOST")
#: Credentials by where they come from and their scope, shared by the process's stores.
_found: dict[tuple[object, ...], Any] = {}
_found_lock = threading.Lock()
#: One token refresh at a time in the process (one an hour per credentials object).
_refresh_lock = threading.Lock()


def check_token(token: object) -> None:
    """Refuse a ``token`` option of no known form at once (a missing key file too). A
    string that is no file is quoted only if it looks like a path: it may be a key's JSON
    or an access token, which no message may show."""
    if token is None or isinstance(token, dict) or token in TOKEN_KINDS:
        return
    if isinstance(token, str | os.PathLike):
        path = Path(token).expanduser()
        if not path.is_file():
            raise ConfigError(f"storage_options {_not_a_file(str(token))}")
        return
    try:
        from google.auth.credentials import Credentials
    except ImportError:  # the store's factory says which extra to install
        return
    if not isinstance(token, Credentials):
        raise ConfigError(
            f"storage_options token= must be a key file's path, a dict, a google.auth"
            f" Credentials object or one of {', '.join(TOKEN_KINDS)}; got"
            f" {type(token).__name__}"
        )


def _not_a_file(token: str) -> str:
    """What is wrong with a ``token`` string that names no file, without showing a secret:
    a path is quoted (``name='....json'`` passes the errors' scrubbing), a key's JSON or
    an access token is not."""
    kinds = ", ".join(TOKEN_KINDS)
    if token.lstrip().startswith("{"):
        return (
            "token= looks like a key's JSON (a service account's or a user's), not the path"
            " of its file: pass it parsed, as a dict (json.loads of the text), or the path"
        )
    if token.startswith(("/", "~", ".")) or token.endswith(".json") or os.sep in token:
        shown = f"token={token!r}" if token.endswith(".json") else f"token= {token!r}"
        return f"{shown} is not a file, nor one of {kinds}: give the path of a JSON key file"
    return (
        f"token= is a string of {len(token)} characters (not shown: it may be a secret) that"
        f" is neither a file nor one of {kinds}: give the path of a JSON key file, a dict or"
        " a google.auth Credentials object (an OAuth access token goes in"
        " google.oauth2.credentials.Credentials(token))"
    )


def _from_info(info: object, scopes: list[str], what: str) -> Any:
    """Credentials from a key file's JSON: a service account's key, or an authorized user's
    (``gcloud auth application-default login``); other kinds through
    ``GOOGLE_APPLICATION_CREDENTIALS`` or a Credentials object."""
    kind = info.get("type") if isinstance(info, dict) else None
    try:
        if kind == "service_account":
            from google.oauth2 import service_account

            account: Any = service_account.Credentials  # untyped classmethods
            return account.from_service_account_info(info, scopes=scopes)
        if kind == "authorized_user":
            from google.oauth2 import credentials

            user: Any = credentials.Credentials
            return user.from_authorized_user_info(info, scopes=scopes)
    except (ValueError, KeyError) as exc:
        # Said by google-auth or cryptography about the key: chained scrubbed, from here.
        error = ConfigError(f"{what} is not a valid {kind} key: {type(exc).__name__}: {exc}")
        cause = stand_in(exc)
    else:
        error = ConfigError(
            f"{what} holds credentials of type {kind!r}: token= takes service_account and"
            " authorized_user keys; for other kinds set GOOGLE_APPLICATION_CREDENTIALS to the"
            " file or pass a google.auth Credentials object"
        )
        cause = None
    raise error from cause


def _timed_request(timeout: float) -> Any:
    """google-auth's ``requests`` transport with every request bounded by ``timeout``."""
    from google.auth.transport.requests import Request

    class TimedRequest(Request):
        def __call__(self, url: str, method: str = "GET", *args: Any, **kwargs: Any) -> Any:
            kwargs["timeout"] = min(float(kwargs.get("timeout") or timeout), timeout)
            call: Any = super().__call__  # untyped
            return call(url, method, *args, **kwargs)

    return TimedRequest()


class GcsCredentials:
    """The ``Authorization`` header of every request of one store (none when anonymous)."""

    def __init__(self, token: object, *, access: str, emulator: bool, timeout: float) -> None:
        check_token(token)
        if token is None:
            token = "anon" if emulator else "google_default"
        self._token = token
        self._scope = SCOPES[access]
        self._timeout = timeout
        self._credentials: Any = None
        self.anonymous = token == "anon"

    def _load(self) -> Any:
        """The google-auth credentials (blocking: run in a thread), shared by every store of
        the process that names the same ones, so that each new store (each loader, each
        opening) reuses their token."""
        from google.auth import exceptions

        token = self._token
        if not isinstance(token, str | os.PathLike | Mapping):
            return token  # a Credentials object: the caller's own
        key: tuple[object, ...]
        if isinstance(token, Mapping):
            key = ("info", json.dumps(token, sort_keys=True, default=str))
        elif token in ("google_default", "cloud"):
            # Looked up again when the variables that say where they are change.
            key = (token, *map(os.environ.get, _WHERE))
        else:
            path = Path(token).expanduser()
            key = ("file", str(path), path.stat().st_mtime_ns if path.exists() else None)
        key = (*key, self._scope)
        with _found_lock:
            if key not in _found:
                try:
                    _found[key] = self._find(token)
                except exceptions.DefaultCredentialsError as exc:
                    reason = " ".join(str(exc).split())
                    raise CredentialsError(_NO_CREDENTIALS.format(reason=reason)) from exc
            return _found[key]

    def _find(self, token: str | os.PathLike[str] | Mapping[str, Any]) -> Any:
        scopes = [self._scope]
        if isinstance(token, Mapping):
            return _from_info(dict(token), scopes, "the token= dict")
        if token == "cloud":
            from google.auth import compute_engine

            metadata: Any = compute_engine.Credentials
            return metadata(scopes=scopes)
        if token == "google_default":
            import google.auth

            return google.auth.default(scopes=scopes, request=_timed_request(self._timeout))[0]
        path = Path(token).expanduser()
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"the key file {str(path)!r} is not JSON ({exc})") from exc
        return _from_info(info, scopes, f"the key file {str(path)!r}")

    def _refresh(self, credentials: Any) -> None:
        """Fetch a new token unless another thread just did (blocking)."""
        with _refresh_lock:
            if not credentials.valid:
                credentials.refresh(_timed_request(self._timeout))

    def ready(self) -> dict[str, str] | None:
        """The headers while the token is valid (no await on the path of every request);
        None when :meth:`headers` must fetch one."""
        if self.anonymous:
            return {}
        credentials = self._credentials
        if credentials is None or not credentials.valid:
            return None
        headers: dict[str, str] = {}
        credentials.apply(headers)
        return headers

    async def headers(self, url: str) -> dict[str, str]:
        """``Authorization`` (and a quota project's header), fetching a token if needed."""
        if self.anonymous:
            return {}
        from google.auth import exceptions

        # google-auth's errors may quote what it sent or got: each is chained as a scrubbed
        # stand-in, raised after the except clause so that it is not the context either.
        error: StoreError
        try:
            if self._credentials is None:
                self._credentials = await asyncio.to_thread(self._load)
            credentials = self._credentials
            if not credentials.valid:
                await asyncio.to_thread(self._refresh, credentials)
        except CredentialsError as exc:
            error, cause = CredentialsError(f"{exc}: {url}", url), stand_in(exc.__cause__)
        except exceptions.RefreshError as exc:
            detail = f"the token request failed: {' '.join(str(exc).split())}"
            if getattr(exc, "retryable", False):
                error = fail(StoreError, detail, url, retryable=True)
            else:
                error = fail(CredentialsError, f"{detail}; check the credentials", url)
            cause = stand_in(exc)
        except exceptions.TransportError as exc:
            detail = f"no token: the token endpoint failed ({exc})"
            error, cause = fail(StoreError, detail, url, retryable=True), stand_in(exc)
        except exceptions.GoogleAuthError as exc:
            detail = f"the credentials cannot be used ({' '.join(str(exc).split())})"
            error, cause = fail(CredentialsError, detail, url), stand_in(exc)
        else:
            headers: dict[str, str] = {}
            credentials.apply(headers)
            return headers
        raise error from cause
