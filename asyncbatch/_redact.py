"""Secrets kept out of what asyncbatch writes: error messages, warnings, reprs, chains.

Credentials travel in URLs (``user:password@host``; presigned S3 and GCS URLs'
``X-Amz-Credential``, ``X-Amz-Signature``, ``X-Amz-Security-Token``, ``X-Goog-Signature``;
Azure SAS ``sig=``), in storage options, and in the texts of other libraries' exceptions,
which quote the URL they failed on. What is hidden becomes ``***``; what says where (scheme,
host, port, path, and query parameters such as ``se=`` and ``sp=``) stays.

- :func:`redact` scrubs a text. Every asyncbatch error and warning passes its message
  through it when built (they are :class:`Scrubbed`), so no message carries a secret,
  whoever wrote it.
- :func:`redact_options` is storage options as a repr may show them: every value hidden but
  those of a few harmless names (:data:`SHOWN_OPTIONS`).
- :func:`stand_in` is what to chain in place of another library's exception: its type,
  errno and scrubbed text, its own chain scrubbed alike. It must be raised outside the
  ``except`` block, or Python chains the original as ``__context__`` all the same.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

HIDDEN = "***"

#: Storage options whose values a repr shows (scrubbed all the same: an endpoint URL may
#: carry a password); every other value is hidden.
SHOWN_OPTIONS = frozenset(
    {
        "access",
        "account_name",
        "anon",
        "endpoint",
        "endpoint_url",
        "profile",
        "project",
        "region",
        "region_name",
        "requester_pays",
        "use_ssl",
    }
)

#: A name whose last word (split at ``-``, ``_``, ``.``) is one of these holds a secret:
#: ``sig``, ``X-Amz-Signature``, ``X-Amz-Security-Token``, ``sas_token``, ``account_key``,
#: ``client_secret``, ``private_key`` (not ``X-Amz-SignedHeaders`` nor ``tokenizer``).
_SECRET_WORDS = frozenset(
    {
        "auth",
        "authorization",
        "credential",
        "credentials",
        "key",
        "passwd",
        "password",
        "pwd",
        "sas",
        "secret",
        "session",
        "sig",
        "signature",
        "token",
    }
)
#: Values of secret-named parameters that are no secret (with quoted key files' paths):
#: flags (``next_token=True``), the GCS ``token`` kinds, placeholders (``Key=Value``).
_PLAIN_VALUES = frozenset({"true", "false", "none", "anon", "google_default", "cloud", "value"})
#: Schemes whose userinfo without a password is still a credential (``https://TOKEN@host``);
#: elsewhere it names something (``abfs://container@account...``).
_USER_IS_SECRET = frozenset({"http", "https", "ws", "wss", "ftp", "ftps"})

_PRIVATE_KEY = re.compile(
    r"-----BEGIN ([A-Z ]*)PRIVATE KEY-----(?:.*?-----END [A-Z ]*PRIVATE KEY-----|[^'\"]*)",
    re.DOTALL,
)
_USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*)://([^/\s'\"<>?#]*)@")
#: ``name=value`` (a query parameter, an option in a message, ``Credential=`` of an
#: Authorization header), the value bare or quoted.
_ASSIGNED = re.compile(
    r"(?<![\w.-])([\w.-]+)=(?:(['\"])(.*?)\2|([^&\s'\"<>#,;)\]:][^&\s'\"<>#,;)\]]*))",
)
#: ``'name': 'value'`` in a dict's repr or JSON.
_QUOTED_PAIR = re.compile(r"(['\"])([\w.-]+)\1(\s*:\s*)(b?)(['\"])(.*?)(?<!\\)\5")
_SCHEME_TOKEN = re.compile(r"\b(Bearer|Basic|SharedKey|SharedKeyLite)\s+[^\s'\",]+")


def is_secret_name(name: str) -> bool:
    """Whether a parameter or option called ``name`` holds a secret (by its last word)."""
    return re.split(r"[-_.]", name.lower())[-1] in _SECRET_WORDS


def _plain(value: str, quoted: bool) -> bool:
    """Whether a secret-named parameter's ``value`` is plainly none: a flag, a GCS token
    kind, a placeholder, or, quoted, a key file's path (``token='/keys/reader.json'``; not
    the end of a URL, ``sig=...%3D/manifest.json``)."""
    if value.lower() in _PLAIN_VALUES:
        return True
    return quoted and value.endswith(".json") and not any(c in value for c in "%&?=")


def _userinfo(match: re.Match[str]) -> str:
    scheme, userinfo = match.group(1), match.group(2)
    if ":" in userinfo:
        user = userinfo.split(":", 1)[0]
        return f"{scheme}://{user}:{HIDDEN}@"
    if scheme.lower() in _USER_IS_SECRET:
        return f"{scheme}://{HIDDEN}@"
    return match.group(0)


def _assigned(match: re.Match[str]) -> str:
    name, quote = match.group(1), match.group(2)
    value = match.group(3) if quote else match.group(4)
    if not is_secret_name(name) or _plain(value, bool(quote)):
        return match.group(0)
    return f"{name}={quote}{HIDDEN}{quote}" if quote else f"{name}={HIDDEN}"


def _quoted_pair(match: re.Match[str]) -> str:
    quote, name, between, prefix, value_quote = match.group(1, 2, 3, 4, 5)
    if not is_secret_name(name) or _plain(match.group(6), quoted=True):
        return match.group(0)
    return f"{quote}{name}{quote}{between}{prefix}{value_quote}{HIDDEN}{value_quote}"


def redact(text: str) -> str:
    """``text`` with every credential it holds hidden: a URL's password (or, for http(s),
    a user name without one), the values of secret-named query parameters and options
    (``sig=``, ``X-Amz-Signature=``, ``token=``, ``'secret': ...``), an ``Authorization``
    scheme's credentials (``Bearer ...``) and PEM private keys. Idempotent."""
    if not text:
        return text
    text = _PRIVATE_KEY.sub(rf"\1PRIVATE KEY {HIDDEN}", text)
    text = _USERINFO.sub(_userinfo, text)
    text = _ASSIGNED.sub(_assigned, text)
    text = _QUOTED_PAIR.sub(_quoted_pair, text)
    return _SCHEME_TOKEN.sub(rf"\1 {HIDDEN}", text)


def redact_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` as a repr may show them: the values of :data:`SHOWN_OPTIONS` (scrubbed
    by :func:`redact` if text), nested mappings likewise, every other value hidden."""
    shown: dict[str, Any] = {}
    for name, value in options.items():
        if isinstance(value, Mapping):
            shown[name] = redact_options(value)
        elif name in SHOWN_OPTIONS and (value is None or isinstance(value, bool | int | float)):
            shown[name] = value
        elif name in SHOWN_OPTIONS and isinstance(value, str):
            shown[name] = redact(value)
        else:
            shown[name] = HIDDEN
    return shown


class Scrubbed(Exception):
    """An exception or warning whose message (each text argument) passes through
    :func:`redact` when it is built: the base of every asyncbatch error and warning."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(redact(arg) if isinstance(arg, str) else arg for arg in args))


class RedactedError(Scrubbed):
    """Another library's exception as chained by asyncbatch: ``kind`` its type's full name,
    ``errno`` its errno (or None), the message its text scrubbed by :func:`redact`."""

    def __init__(self, message: str, kind: str = "", errno: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.errno = errno

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0] if self.args else "", self.kind, self.errno))


def stand_in(exc: BaseException | None, _depth: int = 0) -> BaseException | None:
    """What to chain in place of ``exc``: asyncbatch's own errors themselves (their
    messages are scrubbed already: :class:`Scrubbed`), any other a :class:`RedactedError`
    naming its type and errno with its text scrubbed, holding its traceback, and its cause
    or context replaced the same way."""
    if exc is None or isinstance(exc, Scrubbed):
        return exc
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
    errno = getattr(exc, "errno", None)
    text = redact(str(exc))
    replaced = RedactedError(f"{kind}: {text}" if text else kind, kind, errno)
    replaced.__traceback__ = exc.__traceback__
    if _depth < 8:  # a chain's length is unbounded in principle; its story is not
        if exc.__cause__ is not None:
            replaced.__cause__ = stand_in(exc.__cause__, _depth + 1)
        elif not exc.__suppress_context__:
            replaced.__context__ = stand_in(exc.__context__, _depth + 1)
    return replaced
