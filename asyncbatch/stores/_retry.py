"""One retry policy for every remote store: bounded attempts, full jitter, a deadline.

A store runs each operation (one byte range, one HEAD) as a series of *attempts* through
:func:`with_retries`. An attempt fails with a typed :class:`~asyncbatch._errors.StoreError`;
:func:`is_retryable` decides whether another attempt may help: throttling (429, 503
SlowDown), timeouts, 5xx, refused or reset connections and broken bodies are retried; 403,
404, 412 (the object changed), 416, a server ignoring ``Range``, misconfiguration (no
credentials, a host name that does not resolve, an untrusted certificate, a bad URL or
option) and format errors are not. Refused connections are retried only briefly
(``refused_deadline``): a server restarting comes back within seconds, a wrong endpoint
never does. When every attempt failed, :class:`~asyncbatch._errors.RetriesExhaustedError`
lists them (a cause shared by all of them once) and chains the last. An attempt may keep
state across calls (the bytes of a range already received), so a broken body re-requests
only its missing tail.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import TypeVar

from .._errors import (
    ConfigError,
    RetriesExhaustedError,
    StoreError,
    StoreTimeoutError,
    ThrottledError,
)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How stores retry and time out their requests.

    ``max_attempts`` bounds the requests per operation (a persistent 503 costs exactly that
    many). Before attempt ``n + 1`` a store sleeps a random time in
    ``[0, min(max_delay, base_delay * 2**(n - 1))]`` (full jitter), or at least a server's
    ``Retry-After`` (even beyond ``max_delay``). No attempt starts after ``deadline`` seconds
    from the first; a running one is bounded by the timeouts, not the deadline.
    ``connect_timeout`` bounds opening a connection; the response headers must follow within
    ``first_byte_timeout`` more; ``idle_timeout`` bounds any pause while the body arrives,
    so a slow transfer that keeps moving never times out and a stalled one always does.
    While every attempt so far had its connection refused, no attempt starts after
    ``refused_deadline`` seconds from the first.
    """

    max_attempts: int = 10
    base_delay: float = 0.1
    max_delay: float = 20.0
    deadline: float = 300.0
    connect_timeout: float = 10.0
    first_byte_timeout: float = 30.0
    idle_timeout: float = 30.0
    refused_deadline: float = 3.0

    def __post_init__(self) -> None:
        attempts = self.max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ConfigError(f"RetryPolicy.max_attempts must be an integer >= 1, got {attempts!r}")
        for field in fields(self):
            if field.name == "max_attempts":
                continue
            value = getattr(self, field.name)
            positive = field.name != "base_delay"  # base_delay=0: retry at once
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
                or (positive and value == 0)
            ):
                bound = "> 0" if positive else ">= 0"
                raise ConfigError(
                    f"RetryPolicy.{field.name} must be a finite number {bound}, got {value!r}"
                )
        if self.max_delay < self.base_delay:
            raise ConfigError(
                f"RetryPolicy.max_delay ({self.max_delay!r}) must be >= base_delay"
                f" ({self.base_delay!r})"
            )

    def backoff(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to sleep after failed attempt number ``attempt`` (counted from 1)."""
        ceiling = min(self.max_delay, self.base_delay * 2.0 ** min(attempt - 1, 60))
        delay = random.uniform(0.0, ceiling)
        if retry_after is not None:  # the server knows best; the deadline still bounds it
            delay = max(delay, retry_after)
        return delay


#: The policy stores use when given none.
DEFAULT_POLICY = RetryPolicy()


def transient(error: StoreError) -> StoreError:
    """Mark ``error`` as worth another attempt (a 5xx, a reset, a broken body); returns it."""
    error.retryable = True  # type: ignore[attr-defined]
    return error


def refused(error: StoreError) -> StoreError:
    """Mark ``error`` as a refused connection: retried, within ``refused_deadline``."""
    error.refused = True  # type: ignore[attr-defined]
    return transient(error)


def is_retryable(error: BaseException) -> bool:
    """Whether another attempt may succeed where ``error`` failed."""
    if not isinstance(error, StoreError):
        return False  # a bug or a format error: retrying cannot help
    marked = getattr(error, "retryable", None)
    if marked is not None:
        return bool(marked)
    return isinstance(error, ThrottledError | StoreTimeoutError)


def describe_attempt(error: BaseException) -> str:
    """A short account of one failed attempt: the store's ``detail`` or the message."""
    detail = getattr(error, "detail", None)
    return str(detail) if detail else f"{type(error).__name__}: {error}"


async def with_retries(
    policy: RetryPolicy,
    attempt: Callable[[], Awaitable[T]],
    *,
    what: str,
    url: str,
    start: int | None = None,
    end: int | None = None,
) -> T:
    """Await ``attempt()`` until it succeeds, fails for good, or the policy is spent.

    ``what`` names the operation in the final error (``"read of URL bytes [a, b)"``).
    Errors that are not retryable propagate unchanged, whatever attempt raised them.
    """
    began = time.monotonic()
    failures: list[str] = []
    all_refused = True
    number = 0
    while True:
        number += 1
        try:
            return await attempt()
        except StoreError as exc:
            if not is_retryable(exc):
                raise
            failures.append(describe_attempt(exc))
            all_refused = all_refused and getattr(exc, "refused", False)
            last: StoreError = exc
        retry_after = getattr(last, "retry_after", None)
        delay = policy.backoff(number, retry_after)
        spent = time.monotonic() + delay - began
        tries = f"{number} attempt{'s' if number > 1 else ''}"
        if number >= policy.max_attempts:
            why = tries
        elif spent > policy.deadline:
            why = f"the {policy.deadline:g} s deadline ({tries})"
        elif all_refused and spent > policy.refused_deadline:
            why = f"{tries} (refused connections are retried for {policy.refused_deadline:g} s)"
        else:
            await asyncio.sleep(delay)
            continue
        error = RetriesExhaustedError(
            f"{what} failed after {why}{_summary(failures)}", url, start, end
        )
        error.attempts = failures  # type: ignore[attr-defined]
        raise error from last


def _summary(failures: list[str]) -> str:
    """The failures for a message: one cause said once when every attempt shared it."""
    if len(set(failures)) == 1:
        return f": {failures[0]}" if len(failures) == 1 else f", each: {failures[0]}"
    return ": " + "; ".join(f"#{i} {text}" for i, text in enumerate(failures, 1))
