"""What a format gives the engine: a :class:`Source`, and how datasets of it are opened.

A source is pure: it turns sample ids into what to read, and bytes into fields; it never
calls the engine back. Its :meth:`Source.fetch` returns a generator of *steps* (sans I/O):
each step it yields says what the engine should do next — :class:`Read` a plan,
:class:`OffLoop` some work that touches every byte, :class:`Wait` for a fetch another group
started, or several of these at once (a tuple) — and the engine sends back what came of it
(the bytes read, the work's result). What the generator returns are the fields. The engine
does every read and every hop to a thread.

Most formats are a :class:`PlannedSource`: one read per group of batches, then a decode
(the engine carries these out directly, without a generator). A format whose later reads
depend on earlier bytes (metadata streams: tokens, then the metadata index, then the
metadata) writes its own ``fetch`` and yields as many reads as it needs.

Sources are built per loader from the datasets' ``manifest.format`` by the factory
registered for it (:mod:`asyncbatch.formats._registry`); datasets without a manifest are
opened by the registered :class:`Opener` of their layout.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

import numpy as np
import numpy.typing as npt

from .._dataset import natural_key as natural_key
from .._layout import ReadPlan, WindowPlan
from .._schema import FieldSchema

if TYPE_CHECKING:
    from .._dataset import Dataset
    from ..stores._base import Conversion, Store

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Read:
    """A step: carry out ``plan``. The engine sends back the ``plan.nbytes`` bytes it
    describes, packed in order, or with ``convert`` (stored dtype, output dtype) its elements
    as the output dtype, converted while they are copied where the store can."""

    plan: ReadPlan | WindowPlan
    convert: Conversion | None = None


@dataclass(frozen=True, slots=True)
class OffLoop:
    """A step: call ``work()`` off the event loop, in the engine's decode thread (inline
    when the source says it :class:`Converts` nothing); the engine sends back its result.
    For work that touches every byte (numpy and pyarrow drop the GIL)."""

    work: Callable[[], Any]


@dataclass(frozen=True, slots=True)
class Wait:
    """A step: wait until every future of ``futures`` is done; the engine sends back None.

    The futures (:class:`concurrent.futures.Future`, which belong to no event loop) are
    settled by the source itself, in the fetch of another group: a shard index that group
    is reading, say, shared rather than read twice. Waiting never cancels them. A fetch that
    settles futures settles them however it ends (cancelled: ``future.cancel()``), or its
    waiters would wait forever."""

    futures: tuple[Future[Any], ...]


#: What a fetch yields: a :class:`Read`, an :class:`OffLoop`, a :class:`Wait`, a generator
#: of steps (a fetch of its own, run beside its siblings; its result is what it returns), or
#: a tuple of steps, run concurrently (the result: the list of theirs, in order; on the
#: first failure the others are cancelled and that failure is thrown into the fetch).
Step: TypeAlias = "Read | OffLoop | Wait | Generator[Step, Any, Any] | tuple[Step, ...]"
#: A source's :meth:`Source.fetch`: steps out, their results in, the fields returned. An
#: error of a step (a read's :class:`~asyncbatch._errors.NotFoundError`, a cancellation) is
#: thrown into the generator where it yielded that step.
Fetch: TypeAlias = Generator[Step, Any, dict[str, Any]]


@runtime_checkable
class Source(Protocol):
    """Samples of one or several datasets (a mixture) of one format."""

    datasets: Sequence[Dataset]
    #: Every shard of every dataset, in order; plans name shards by index into this.
    shard_urls: Sequence[str]
    #: The dataset (so the store) each shard belongs to.
    shard_dataset: Int64Array
    #: Samples of each dataset; ids of dataset d start at the sum of those before it.
    sizes: Int64Array
    num_samples: int
    schema: dict[str, FieldSchema]
    #: Bytes one sample occupies in a batch, on average (sizes the prefetch and the groups).
    sample_bytes: int

    def fetch(self, ids: Int64Array, gap: int) -> Fetch:
        """The steps that bring the fields of samples ``ids``, in order (each value is sliced
        per batch along axis 0); ``gap``: the store's request cost in bytes, for merging."""
        ...


@runtime_checkable
class Converts(Protocol):
    """Optional: whether decoding touches every byte (then it runs in the engine's decode
    thread; numpy and pyarrow drop the GIL). A source without it gets the thread."""

    converts: bool


@runtime_checkable
class SuggestsBlocks(Protocol):
    """Optional: the block of ``shuffle="block"`` that suits the layout (an LLMBATCH slot, a
    Parquet row group); None where it has no view. ``block_size=`` overrides it."""

    default_block_size: int | None


@runtime_checkable
class AlignedBlocks(Protocol):
    """Optional: the blocks are the format's read units (Parquet row groups), so block edges
    stay on them every epoch."""

    aligned_blocks: bool


@runtime_checkable
class StoredAsBatches(Protocol):
    """Optional: data stored as pre-built batches (LLMBATCH); ``shuffle="batch"`` keeps slots
    of ``slot_rows`` records whole (None: these datasets have no single slot size)."""

    slot_rows: int | None


@runtime_checkable
class ReadsScattered(Protocol):
    """A source that reads otherwise when a batch's samples are scattered over the whole
    dataset (an exact shuffle) than when they come in runs: the loader sets ``scattered``."""

    scattered: bool


@runtime_checkable
class ReadsRowsAlone(Protocol):
    """Optional: a group that uses fewer than 1 in ``reads_rows_alone`` of the samples of
    the blocks it touches reads its samples without the rest of those blocks (an Arrow
    record batch's rows, by their byte ranges); 0: never. A block-shuffle run whose windows
    hold more batches than that starts with its first batch alone, so that the first batch
    waits only for its own reads, not its window's."""

    reads_rows_alone: int


@runtime_checkable
class DescribesFiles(Protocol):
    """Optional: what the manifests record of files the plans name beyond the shards (a
    documents dataset's per-shard indexes): ``{url: (bytes, checksum or None)}``. The engine
    checks them as it checks shards (their size, their checksum with ``verify="full"``)."""

    described_files: Mapping[str, tuple[int, int | None]]


class PlannedSource:
    """A source whose samples come from one read and one decode.

    The engine carries out these two steps itself (as :meth:`fetch` says, with no generator
    in between) unless a subclass overrides :meth:`fetch`.
    """

    #: Whether decoding touches every byte (then it runs off the loop; numpy drops the GIL).
    converts: bool = False
    #: (stored dtype, output dtype) the read converts the elements between as it copies
    #: them, so that :meth:`decode` gets them converted; None: the bytes as stored.
    convert: Conversion | None = None

    def plan(self, ids: Int64Array, gap: int) -> ReadPlan:
        """The reads that bring the bytes of samples ``ids``, packed in order."""
        raise NotImplementedError

    def reads(self, ids: Int64Array, gap: int) -> ReadPlan | WindowPlan:
        """What the engine reads for samples ``ids``: :meth:`plan`, or windows a local store
        copies itself (planned only for another store)."""
        return self.plan(ids, gap)

    def decode(self, buffer: npt.NDArray[np.uint8], ids: Int64Array) -> dict[str, Any]:
        """Fields of samples ``ids`` from the bytes :meth:`reads` described."""
        raise NotImplementedError

    def fetch(self, ids: Int64Array, gap: int) -> Fetch:
        """:meth:`reads`, converted as :attr:`convert` says, then :meth:`decode` (off the
        loop when it :attr:`converts`)."""
        buffer = yield Read(self.reads(ids, gap), self.convert)
        if self.converts:
            fields: dict[str, Any] = yield OffLoop(lambda: self.decode(buffer, ids))
            return fields
        return self.decode(buffer, ids)


class SourceFactory(Protocol):
    def __call__(
        self,
        datasets: Sequence[Dataset],
        *,
        seq_len: int | None,
        next_token: bool,
        dtype: Any,
        **options: Any,
    ) -> Source: ...


@dataclass(frozen=True)
class Opener:
    """Opens datasets of one on-disk layout that has no asyncbatch manifest.

    ``claims(url)`` decides from the URL alone (a ``.batch`` or ``.npy`` suffix); ``probe``,
    when given, looks at the store (a ``.idx`` beside the URL) and is tried only when no
    opener claims the URL and there is no manifest. ``open`` reads headers and index arrays,
    never the data.
    """

    name: str
    #: ``open(url, store, storage_options, options)``: ``options`` are ``open_dataset``'s
    #: ``options=`` (e.g. the dtype of raw token files); unknown keys are a ConfigError.
    open: Callable[[str, Store, Mapping[str, Any], Mapping[str, Any]], Awaitable[Dataset]]
    claims: Callable[[str], bool] = lambda url: False
    probe: Callable[[str, Store], Awaitable[bool]] | None = None
    #: What ``probe`` looks for, for the error when nothing is found ("a Megatron .idx").
    probes_for: str = ""
    #: ``open_many(urls, store, storage_options, options)``: a dataset of the files ``urls``
    #: in that order (``open_dataset([url, ...])``: over HTTP, which cannot list); None: a
    #: list is refused.
    open_many: (
        Callable[[Sequence[str], Store, Mapping[str, Any], Mapping[str, Any]], Awaitable[Dataset]]
        | None
    ) = None
