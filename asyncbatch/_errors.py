"""Exceptions raised by asyncbatch.

Every error names what went wrong and where (URL, byte range, field and value) in its message,
and never a secret: every error and warning scrubs its message when built (``_redact.redact``:
a URL's password, signed or SAS query values, secret-named options, private keys), and
``url`` is kept scrubbed alike; another library's exception is chained as a scrubbed stand-in.
Pickled, an error keeps every attribute (``url``, ``start``, ``end``, ``attempts``,
``retry_after``); one raised in a ``LoaderDataset``'s DataLoader worker reaches the caller
whole (torch alone would rebuild it from its type and message)::

    AsyncBatchError
    ├── ConfigError(ValueError)            a bad argument, URL or storage option; no retry can help
    │   └── ResumeStateError               a state_dict this loader cannot honour
    ├── StoreError(OSError)                a read or write against a store failed
    │   ├── NotFoundError(FileNotFoundError)          404, no such key or file
    │   │   └── BucketNotFoundError        the bucket itself does not exist (names it)
    │   ├── PermissionDeniedError(PermissionError)    403, EACCES
    │   │   └── CredentialsError           401, no credentials, or a key the store rejects
    │   ├── EndpointError(ConnectionError)            host name unresolvable, TLS not trusted
    │   ├── ThrottledError                 429, 503 SlowDown (retried; carries Retry-After)
    │   ├── StoreTimeoutError(TimeoutError)           no connection, first byte or progress in time
    │   ├── RetriesExhaustedError          every attempt failed; lists them, chains the last
    │   ├── ShortReadError(EOFError)       fewer bytes than the range asked for
    │   ├── RangeNotSupportedError         the server ignored or refused a byte range
    │   ├── ShardChangedError              the object changed since it was pinned at open
    │   ├── ChecksumError                  bytes that do not match their recorded checksum
    │   └── UnknownSchemeError             no store registered for a URL scheme
    ├── FormatError(ValueError)            bytes that do not decode as the format says
    │   ├── ManifestError                  a manifest missing, malformed or disagreeing with data
    │   ├── DecodeError                    decode=: a sample's field that does not decode
    │   └── RecordError                    prepare: an input record that cannot be used
    ├── LoaderClosedError(RuntimeError)    the loader was used after close()
    └── TransformError                     the loader's transform= raised; chains it

    CacheWarning(UserWarning)              the node-local cache failed; reads go on without it
    SlowPathWarning(UserWarning)           a store's configuration rules out its fast path

Retried by the stores' retry policy: ThrottledError, StoreTimeoutError, ShortReadError from a
broken body, and 5xx or connection errors (refused connections only briefly); never
NotFoundError, PermissionDeniedError (CredentialsError), EndpointError, RangeNotSupportedError,
ShardChangedError, ChecksumError, a ConfigError or a FormatError.
"""

from __future__ import annotations

from ._redact import Scrubbed, redact


class AsyncBatchError(Scrubbed):
    """Base class of every asyncbatch error (its message scrubbed of secrets when built)."""


class ConfigError(AsyncBatchError, ValueError):
    """An argument is invalid; the message names the argument and its value."""


class ResumeStateError(ConfigError):
    """A saved state does not match this loader (other dataset, batch size, ...)."""


class StoreError(AsyncBatchError, OSError):
    """A store operation failed; the message names the URL and, for reads, the byte range."""

    def __init__(
        self, message: str, url: str = "", start: int | None = None, end: int | None = None
    ):
        super().__init__(message)
        self.url = redact(url)
        self.start = start
        self.end = end

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[object, ...]:
        # The instance dict carries what stores attach after construction (``attempts``,
        # ``retry_after``, ``detail``, ...); BaseException.__setstate__ restores it.
        args = (self.args[0] if self.args else "", self.url, self.start, self.end)
        return (type(self), args, self.__dict__)


class NotFoundError(StoreError, FileNotFoundError):
    """The object or file does not exist."""


class BucketNotFoundError(NotFoundError):
    """The bucket (or container) the URL names does not exist; the message names it."""


class PermissionDeniedError(StoreError, PermissionError):
    """The store refused access (HTTP 403, EACCES)."""


class CredentialsError(PermissionDeniedError):
    """No credentials were found, or the store rejected them (invalid key, bad signature,
    HTTP 401)."""


class EndpointError(StoreError, ConnectionError):
    """The endpoint cannot be reached as configured: its host name does not resolve, or its
    TLS certificate fails verification."""


class ThrottledError(StoreError):
    """The store asked us to slow down (HTTP 429, 503 SlowDown); ``retry_after`` in seconds."""

    retry_after: float | None = None


class StoreTimeoutError(StoreError, TimeoutError):
    """No connection, no first byte, or no progress within its timeout."""


class RetriesExhaustedError(StoreError):
    """Every attempt of a retried operation failed; the message lists them, the last is the
    cause."""


class RangeNotSupportedError(StoreError):
    """The server ignored a ``Range`` header (whole object sent) or answered another range."""


class ShardChangedError(StoreError):
    """An object changed (ETag, version, inode, size or mtime) after it was pinned."""


class ChecksumError(StoreError):
    """Bytes read do not match the checksum the manifest records for them."""


class ShortReadError(StoreError, EOFError):
    """A read returned fewer bytes than the byte range asked for."""


class UnknownSchemeError(StoreError):
    """No store is registered for the URL's scheme."""


class FormatError(AsyncBatchError, ValueError):
    """Bytes that do not decode as their format says."""


class ManifestError(FormatError):
    """A manifest is missing, malformed, or disagrees with the data it describes."""


class DecodeError(FormatError):
    """A sample's field does not decode (``decode=``): ``url`` is its shard, ``key`` the
    sample's ``__key__`` (an int: its global index, where the samples have no key),
    ``field`` the field's name; the decoder's exception is the ``__cause__``."""

    def __init__(self, message: str, url: str = "", key: str | int = "", field: str = ""):
        super().__init__(message)
        self.url = redact(url)
        self.key = key
        self.field = field

    def __reduce__(self) -> tuple[object, ...]:
        # Raised in DataLoader workers: every attribute must survive pickling.
        return (
            type(self),
            (self.args[0] if self.args else "", self.url, self.key, self.field),
            self.__dict__,
        )


class RecordError(FormatError):
    """``prepare`` met an input record it cannot use (malformed JSON, a missing or non-string
    text field, invalid UTF-8, a file without the column, an unreadable file). ``url`` is the
    input file, ``location`` the line, row or byte offset, ``unit`` the unit of work."""

    def __init__(self, message: str, url: str = "", location: str = "", unit: int | None = None):
        super().__init__(message)
        self.url = redact(url)
        self.location = location
        self.unit = unit

    def __reduce__(self) -> tuple[object, ...]:
        # Raised in worker processes and Ray tasks: every attribute must survive pickling.
        return (
            type(self),
            (self.args[0] if self.args else "", self.url, self.location, self.unit),
            self.__dict__,
        )


class LoaderClosedError(AsyncBatchError, RuntimeError):
    """The loader was used after ``close()``."""


class TransformError(AsyncBatchError):
    """The loader's ``transform=`` raised on batch ``batch`` of epoch ``epoch``; the
    exception it raised is the ``__cause__`` (in this process; a DataLoader worker's error
    keeps only the message, which includes the cause's traceback)."""

    def __init__(self, message: str, epoch: int | None = None, batch: int | None = None):
        super().__init__(message)
        self.epoch = epoch
        self.batch = batch

    def __reduce__(self) -> tuple[object, ...]:
        # As StoreError's: the instance dict carries whatever was attached later.
        return (
            type(self),
            (self.args[0] if self.args else "", self.epoch, self.batch),
            self.__dict__,
        )


def describe_range(url: str, start: int, end: int) -> str:
    """``url [start, end)`` as used in every read error message."""
    return f"{url} bytes [{start}, {end})"


class CacheWarning(Scrubbed, UserWarning):
    """The node-local cache could not be used (full, unwritable, deleted, or an object
    without a version); reads go on from the store. Warned once per cache and cause."""


class SlowPathWarning(Scrubbed, UserWarning):
    """A store's configuration rules out its fast path, so it reads the slow way (the S3
    store's GETs through botocore's ``get_object``: several times the CPU per request). The
    message names the reason; warned once per process and reason."""
