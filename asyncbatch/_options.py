"""The loaders' options, typed once and checked once.

:class:`~asyncbatch.Loader`, :class:`~asyncbatch.AsyncLoader` and
:class:`~asyncbatch.LoaderDataset` all take ``(dataset, **options)``:

- :class:`LoaderOptions` types the keyword arguments for a type checker (PEP 692:
  ``**options: Unpack[LoaderOptions]``), so a misspelt or mistyped one is flagged at the call;
- :class:`LoaderConfig` holds them with their defaults, checked and normalised when it is
  built (a ConfigError naming the argument), and frozen. A loader keeps one
  (``loader.config``); its pickle and its DataLoader workers carry it; its ``state_dict()``
  settings are read from it.

A new option is one line in each class, its checks in ``LoaderConfig.__post_init__`` and its
entry in ``Loader``'s "Args:" docs (tests/test_options.py and tests/test_signatures.py check
that the three agree). :func:`takes_options` gives each public ``__init__`` a
``__signature__`` listing every option with its default, for ``help()`` and
``inspect.signature``; the API reference gets the same from scripts/griffe_options.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable, Mapping
from typing import Any, Required, TypedDict, TypeVar

import numpy.typing as npt
import torch

from ._checks import DEFAULT_VERIFY, Verify, check_level
from ._decode import (
    Decode,
    OnError,
    SampleTransform,
    check_decode,
    check_on_error,
    check_sample_transform,
)
from ._defaults import MAX_INFLIGHT
from ._device import device_of
from ._errors import ConfigError
from ._redact import redact, redact_options
from ._transform import Transform, check_transform
from .sampling._order import TAILS, Shuffle, Tail, normalize_shuffle
from .stores._disk_cache import DiskCache
from .stores._retry import RetryPolicy

#: With ``shuffle="block"`` and ``window=None``: blocks shuffled together.
DEFAULT_WINDOW = 8


class LoaderOptions(TypedDict, total=False):
    """The keyword arguments of the loaders and their types (documented in ``Loader``)."""

    batch_size: Required[int]
    seq_len: int | None
    shuffle: Shuffle
    seed: int
    prefetch: int | None
    max_inflight: int
    next_token: bool
    dtype: npt.DTypeLike | torch.dtype | None
    drop_last: bool
    tail: Tail
    block_size: int | None
    window: int | None
    infinite: bool
    rank: int | None
    world_size: int | None
    coalesce_gap: int | None
    storage_options: Mapping[str, Any] | None
    retry: RetryPolicy | None
    format_options: Mapping[str, Any] | None
    verify: Verify
    cache: DiskCache | str | os.PathLike[str] | None
    transform: Transform | None
    device: torch.device | str | None
    decode: Decode | None
    sample_transform: SampleTransform | None
    on_error: OnError
    decode_threads: int | None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LoaderConfig:
    """A loader's options with their defaults, checked and normalised, frozen.

    Built by the loaders from their keyword arguments (``LoaderConfig(**options)`` checks
    them the same way); a bad value is a ConfigError naming it. Normalised: ``shuffle`` is
    its name (``True`` is ``"global"``); ``window`` is 8 with ``shuffle="block"`` and None
    given; ``cache`` a ``DiskCache`` or None; ``device`` a ``torch.device`` or None (the
    CPU); the mappings are plain dicts; the flags bools. ``rank`` and ``world_size`` stay
    as given (checked): the loader asks ``torch.distributed`` for what is None when it is
    built. Its repr hides the values of ``storage_options`` but those of a few harmless
    names (endpoint, region, ``anon``, ...): they may be credentials.
    """

    batch_size: int
    seq_len: int | None = None
    shuffle: Shuffle = True
    seed: int = 0
    prefetch: int | None = None
    max_inflight: int = MAX_INFLIGHT
    next_token: bool = False
    dtype: npt.DTypeLike | torch.dtype | None = None
    drop_last: bool = True
    tail: Tail = "drop"
    block_size: int | None = None
    window: int | None = None
    infinite: bool = False
    rank: int | None = None
    world_size: int | None = None
    coalesce_gap: int | None = None
    storage_options: Mapping[str, Any] | None = None
    retry: RetryPolicy | None = None
    format_options: Mapping[str, Any] | None = None
    verify: Verify = DEFAULT_VERIFY
    cache: DiskCache | str | os.PathLike[str] | None = None
    transform: Transform | None = None
    device: torch.device | str | None = None
    decode: Decode | None = None
    sample_transform: SampleTransform | None = None
    on_error: OnError = "raise"
    decode_threads: int | None = None

    def __post_init__(self) -> None:
        positive("batch_size", self.batch_size)
        if self.seq_len is not None:
            positive("seq_len", self.seq_len)
        if self.prefetch is not None:
            positive("prefetch", self.prefetch)
        positive("max_inflight", self.max_inflight)
        check_ranks(self.rank, self.world_size)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        gap = self.coalesce_gap
        if gap is not None and (isinstance(gap, bool) or not isinstance(gap, int) or gap < 0):
            raise ConfigError(f"coalesce_gap must be a non-negative integer, got {gap!r}")
        shuffle = normalize_shuffle(self.shuffle)
        if self.tail not in TAILS:
            raise ConfigError(f"tail={self.tail!r}: expected one of {TAILS}")
        if shuffle != "block" and (self.block_size is not None or self.window is not None):
            raise ConfigError(
                f"block_size and window apply to shuffle='block', not shuffle={shuffle!r}"
            )
        if self.block_size is not None:
            positive("block_size", self.block_size)
        window = None if self.window is None else positive("window", self.window)
        decode = check_decode(self.decode)
        on_error = check_on_error(self.on_error)
        sample_transform = check_sample_transform(self.sample_transform)
        if self.decode_threads is not None:
            positive("decode_threads", self.decode_threads)
        if decode is None:
            for name, unset in (
                ("sample_transform", None),
                ("on_error", "raise"),
                ("decode_threads", None),
            ):
                if getattr(self, name) != unset:
                    raise ConfigError(f"{name} applies to decode=, which is not given")
        if self.retry is not None and not isinstance(self.retry, RetryPolicy):
            raise ConfigError(f"retry must be an asyncbatch.RetryPolicy, got {self.retry!r}")
        normalised = {
            "shuffle": shuffle,
            "window": DEFAULT_WINDOW if shuffle == "block" and window is None else window,
            "next_token": bool(self.next_token),
            "drop_last": bool(self.drop_last),
            "infinite": bool(self.infinite),
            "storage_options": dict(self.storage_options or {}),
            "format_options": dict(self.format_options or {}),
            "verify": check_level(self.verify),
            "cache": DiskCache.of(self.cache),
            "transform": check_transform(self.transform),
            "device": device_of(self.device),
            "decode": decode,
            "sample_transform": sample_transform,
            "on_error": on_error,
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)  # frozen: set once, here

    def __repr__(self) -> str:
        # Storage options hold credentials: every value is hidden but a few harmless ones
        # (_redact.SHOWN_OPTIONS: endpoint, region, anon, ...), and the text is scrubbed.
        shown = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "storage_options" and isinstance(value, Mapping):
                value = redact_options(value)
            shown.append(f"{field.name}={value!r}")
        return redact(f"LoaderConfig({', '.join(shown)})")

    @classmethod
    def of(cls, owner: str, options: Mapping[str, Any]) -> LoaderConfig:
        """The config of ``options`` given to ``owner``'s ``__init__``: a name it does not
        take is the TypeError Python raises for a plain signature, naming ``owner``."""
        check_names(owner, options)
        return cls(**options)


#: The option names, in the order of the signatures.
NAMES: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(LoaderConfig))


def check_names(owner: str, options: Mapping[str, Any]) -> None:
    """A TypeError (Python's own words) for a name that is no option, or no batch_size."""
    for name in options:
        if name not in NAMES:
            raise TypeError(f"{owner}.__init__() got an unexpected keyword argument {name!r}")
    if "batch_size" not in options:
        raise TypeError(
            f"{owner}.__init__() missing 1 required keyword-only argument: 'batch_size'"
        )


def positive(name: str, value: Any) -> int:
    """``value`` if it is a positive integer (not a bool), else a ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_ranks(rank: Any, world_size: Any) -> None:
    """A ConfigError for a rank or world size that does not fit: both None (from
    ``torch.distributed``), a world size alone (only 1: rank 0), or a rank in
    ``[0, world_size)``."""
    if rank is None and world_size is None:
        return
    if world_size is None:
        raise ConfigError(f"rank={rank!r} was given without world_size")
    world_size = positive("world_size", world_size)
    if rank is None:
        if world_size != 1:
            raise ConfigError(f"world_size={world_size} was given without rank")
        return
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError(f"rank must be an integer in [0, {world_size}), got {rank!r}")


def option_parameters() -> list[inspect.Parameter]:
    """Every option as a keyword-only parameter: its annotation (as written, a string) and
    default from :class:`LoaderConfig`."""
    return [
        inspect.Parameter(
            field.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=inspect.Parameter.empty
            if field.default is dataclasses.MISSING
            else field.default,
            annotation=field.type,
        )
        for field in dataclasses.fields(LoaderConfig)
    ]


F = TypeVar("F", bound=Callable[..., Any])


def takes_options(function: F) -> F:
    """``function`` (an ``__init__(self, dataset, **options)``) with a ``__signature__``
    that lists every option in place of ``**options``, for ``help()`` and ``inspect``."""
    signature = inspect.signature(function)
    kept = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    function.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[*kept, *option_parameters()]
    )
    return function
