"""Exceptions raised by asyncbatch.

Every error names what went wrong and where (URL, byte range, field and value) in its message,
because only the message survives a process boundary such as a DataLoader worker::

    AsyncBatchError
    ├── ConfigError(ValueError)            a bad argument, caught before any thread starts
    │   └── ResumeStateError               a state_dict this loader cannot honour
    ├── StoreError(OSError)                a read or write against a store failed
    │   ├── NotFoundError(FileNotFoundError)
    │   ├── ShortReadError(EOFError)       fewer bytes than the range asked for
    │   └── UnknownSchemeError             no store registered for a URL scheme
    ├── FormatError(ValueError)            bytes that do not decode as the format says
    │   └── ManifestError                  a manifest missing, malformed or disagreeing with data
    └── LoaderClosedError(RuntimeError)    the loader was used after close()
"""

from __future__ import annotations


class AsyncBatchError(Exception):
    """Base class of every asyncbatch error."""


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
        self.url = url
        self.start = start
        self.end = end

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0] if self.args else "", self.url, self.start, self.end))


class NotFoundError(StoreError, FileNotFoundError):
    """The object or file does not exist."""


class ShortReadError(StoreError, EOFError):
    """A read returned fewer bytes than the byte range asked for."""


class UnknownSchemeError(StoreError):
    """No store is registered for the URL's scheme."""


class FormatError(AsyncBatchError, ValueError):
    """Bytes that do not decode as their format says."""


class ManifestError(FormatError):
    """A manifest is missing, malformed, or disagrees with the data it describes."""


class LoaderClosedError(AsyncBatchError, RuntimeError):
    """The loader was used after ``close()``."""


def describe_range(url: str, start: int, end: int) -> str:
    """``url [start, end)`` as used in every read error message."""
    return f"{url} bytes [{start}, {end})"
