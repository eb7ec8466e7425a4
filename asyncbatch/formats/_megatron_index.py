"""Pages of Megatron ``.idx`` files, fetched by range as batches need them and cached.

A *sequence page* is ``index_page`` consecutive sequences: their lengths (int32) and pointers
(int64), two ranges of the ``.idx``, 12 bytes a sequence. A *document page* (``unit=
"document"``) is ``index_page + 1`` document indices (8 bytes each), plus the sequence pages
of the sequences they name. A page is checked when it arrives against the summary read at
open (:mod:`asyncbatch.formats._megatron`): lengths not negative, each pointer where the
sequence before it ends, the first and the last where the summary says; a page that
disagrees is a :class:`~asyncbatch.FormatError` naming the ``.idx``, the page and its bytes.

Pages are kept in a cache of at most ``index_cache_bytes`` (least recently used dropped
first, never those a batch is using: a :class:`~._fetch_cache.FetchCache`), so within that
bound no page is fetched twice; concurrent batches that need one page share one fetch.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .._errors import ConfigError, FormatError, NotFoundError
from .._layout import ReadPlan
from ._base import Read, Step
from ._fetch_cache import FetchCache
from ._megatron import DOCUMENT_PAGES, SEQUENCE_PAGES, IndexLayout

if TYPE_CHECKING:
    from .._dataset import Dataset

Int64Array = npt.NDArray[np.int64]

#: Bytes of pages one source keeps (``format_options={"index_cache_bytes": ...}``).
DEFAULT_INDEX_CACHE_BYTES = 64 * 2**20
SEQUENCE, DOCUMENT = "sequence", "document"
#: Pages by (kind, page number): each one's local element offsets.
PageTable = dict[tuple[str, int], Int64Array]


class _Pages:
    """The pages of one kind (sequences or documents) of datasets numbered one after
    another: page ``g`` is page ``local[g]`` of dataset ``dataset[g]``."""

    def __init__(self, layouts: Sequence[IndexLayout], summaries: Sequence[Int64Array]) -> None:
        counts = np.array([s.size - 1 for s in summaries], dtype=np.int64)
        self.base = np.cumsum(counts) - counts  # first page of each dataset
        self.dataset = np.repeat(np.arange(len(layouts)), counts)
        self.local = np.arange(int(counts.sum()), dtype=np.int64) - self.base[self.dataset]
        totals = np.array([int(s[-1]) for s in summaries], dtype=np.int64)
        #: Element of the joined stream where each dataset starts.
        self.element_base = np.cumsum(totals) - totals
        #: Element where each page's first entry starts, in the joined stream.
        self.start = np.concatenate(
            [s[:-1] + b for s, b in zip(summaries, self.element_base.tolist(), strict=True)]
            + [np.zeros(0, dtype=np.int64)]
        )
        self.summaries = list(summaries)


class MegatronIndex:
    """Entry offsets (sequences, or documents with ``unit="document"``) of Megatron datasets
    numbered one after another, fetched by page. The ``.idx`` files follow the source's
    shards in its ``shard_urls``, from ``first_file`` on."""

    def __init__(
        self,
        datasets: Sequence[Dataset],
        first_file: int,
        budget: int = DEFAULT_INDEX_CACHE_BYTES,
    ) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ConfigError(
                f"format_options index_cache_bytes must be a number of bytes, got {budget!r}"
            )
        units = {d.manifest.metadata["unit"] for d in datasets}
        if len(units) != 1:
            named = ", ".join(f"{d.url} ({d.manifest.metadata['unit']})" for d in datasets)
            raise ConfigError(
                f"a mixture of Megatron datasets must open them all with one unit, got {named}"
            )
        self.unit: str = units.pop()
        self.layouts = [IndexLayout.of(d) for d in datasets]
        self.first_file = first_file
        self.index_urls = [layout.url for layout in self.layouts]
        self.index_dataset = list(range(len(datasets)))
        #: What the engine checks of each ``.idx`` (its size; there is no checksum).
        self.described_files: Mapping[str, tuple[int, int | None]] = {
            layout.url: (int(d.manifest.metadata["index_bytes"]), None)
            for layout, d in zip(self.layouts, datasets, strict=True)
        }
        self.sequences = _Pages(self.layouts, [d.arrays[SEQUENCE_PAGES] for d in datasets])
        if self.unit == DOCUMENT:
            self.pages = _Pages(self.layouts, [d.arrays[DOCUMENT_PAGES] for d in datasets])
            counts = [layout.entries - 1 for layout in self.layouts]
        else:
            self.pages = self.sequences
            counts = [layout.sequences for layout in self.layouts]
        #: Entries (samples) of each dataset, and the first's number.
        self.entries = np.array(counts, dtype=np.int64)
        self.entry_ends = np.cumsum(self.entries)
        self.entry_base = self.entry_ends - self.entries
        self.budget = budget
        #: Pages by (kind, page); pickled into a worker process, it leaves its pages behind.
        self._cache: FetchCache[tuple[str, int], Int64Array] = FetchCache(budget)

    @property
    def cached_bytes(self) -> int:
        """Bytes of pages held now (at most the budget, but for the pages batches use)."""
        return self._cache.cached_bytes

    # --- which pages ---------------------------------------------------------------------

    def _entry_pages(self, ids: Int64Array) -> tuple[Int64Array, Int64Array, Int64Array]:
        """Of global entries ``ids``: their dataset, page (of :attr:`pages`) and place in it."""
        k = np.searchsorted(self.entry_ends, ids, side="right").astype(np.int64)
        local = ids - self.entry_base[k]
        sizes = np.array([layout.page for layout in self.layouts], dtype=np.int64)[k]
        page: Int64Array = self.pages.base[k] + np.floor_divide(local, sizes)
        at: Int64Array = local % sizes
        return k, page, at

    def pages_of_windows(self, starts: Int64Array, width: int) -> Int64Array:
        """The pages holding the entries windows of ``width`` elements at ``starts`` (of the
        joined stream) need: the last starting at or before each window's start, through
        the last starting inside it; ascending."""
        page_start = self.pages.start
        first = np.searchsorted(page_start, starts, side="right") - 1
        last = np.searchsorted(page_start, starts + max(0, width - 1), side="right") - 1
        count = last - first + 1
        step = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
        return np.unique(np.repeat(first, count) + step).astype(np.int64)

    # --- what they hold ------------------------------------------------------------------

    def spans(self, ids: Int64Array) -> Generator[Step, Any, tuple[Int64Array, Int64Array]]:
        """Element start and end (in the joined stream) of entries ``ids``."""
        k, page, at = self._entry_pages(ids)
        table = yield from self.load(self.pages, np.unique(page))
        starts = np.empty(ids.size, dtype=np.int64)
        ends = np.empty(ids.size, dtype=np.int64)
        order = np.argsort(page, kind="stable")
        cuts = np.flatnonzero(np.diff(page[order])) + 1
        for picked in np.split(order, cuts) if ids.size else []:  # one pass per page
            g = int(page[picked[0]])
            offsets = table[g] + self.pages.element_base[k[picked[0]]]
            starts[picked] = offsets[at[picked]]
            ends[picked] = offsets[at[picked] + 1]
        return starts, ends

    def window_offsets(
        self, pages: Int64Array, table: Mapping[int, Int64Array]
    ) -> tuple[Int64Array, Int64Array]:
        """Offsets (joined stream) of the entries of ``pages`` (ascending), and the global
        number of each, as :func:`~asyncbatch.formats._documents.boundaries` takes them: a
        page's end joins them where the next page is not among them."""
        parts: list[Int64Array] = []
        numbers: list[Int64Array] = []
        listed = set(pages.tolist())
        for g in pages.tolist():
            k = int(self.pages.dataset[g])
            first = int(self.entry_base[k] + self.pages.local[g] * self.layouts[k].page)
            offsets = table[g] + self.pages.element_base[k]
            keep = offsets.size if g + 1 not in listed else offsets.size - 1
            parts.append(offsets[:keep])
            numbers.append(np.arange(first, first + keep, dtype=np.int64))
        if not parts:
            return np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64)
        return np.concatenate(parts), np.concatenate(numbers)

    # --- fetching ------------------------------------------------------------------------

    def load(
        self, pages: _Pages, wanted: Int64Array
    ) -> Generator[Step, Any, dict[int, Int64Array]]:
        """The local element offsets of pages ``wanted`` (unique) of ``pages``: an entry each,
        then the page's end; those not cached are fetched, a fetch another batch started is
        waited for, not repeated."""
        kind = SEQUENCE if pages is self.sequences else DOCUMENT
        fetch = self._sequence_pages if kind == SEQUENCE else self._document_pages

        def fetch_keys(keys: list[tuple[str, int]]) -> Generator[Step, Any, PageTable]:
            got = yield from fetch([g for _, g in keys])
            return {(kind, g): offsets for g, offsets in got.items()}

        got = yield from self._cache.obtain([(kind, g) for g in wanted.tolist()], fetch_keys)
        return {g: offsets for (_, g), offsets in got.items()}

    def _read(
        self, dataset: Int64Array, starts: Int64Array, ends: Int64Array
    ) -> Generator[Step, Any, npt.NDArray[np.uint8]]:
        """Bytes ``[starts[r], ends[r])`` of the ``.idx`` of ``dataset[r]``, packed in order."""
        sizes = ends - starts
        none = np.zeros(0, dtype=np.int64)
        plan = ReadPlan(
            dataset + self.first_file, starts, ends, np.cumsum(sizes) - sizes,
            none, none, none, none, int(sizes.sum()),
        )  # fmt: skip
        try:
            buffer: npt.NDArray[np.uint8] = yield Read(plan)
        except NotFoundError as exc:
            raise FormatError(f"{exc.url}: a Megatron index opened before is missing") from exc
        return buffer

    def _sequence_pages(self, pages: list[int]) -> Generator[Step, Any, dict[int, Int64Array]]:
        """Fetch and check sequence pages: lengths and pointers, two ranges each."""
        chosen = np.array(pages, dtype=np.int64)
        k = self.sequences.dataset[chosen]
        local = self.sequences.local[chosen]
        size = np.array([self.layouts[i].page for i in k.tolist()], dtype=np.int64)
        total = np.array([self.layouts[i].sequences for i in k.tolist()], dtype=np.int64)
        first = local * size
        count = np.minimum(size, total - first)
        lengths_at = np.array([self.layouts[i].lengths_at for i in k.tolist()], dtype=np.int64)
        pointers_at = lengths_at + 4 * total
        starts = np.stack([lengths_at + 4 * first, pointers_at + 8 * first], axis=1).reshape(-1)
        ends = starts + np.stack([4 * count, 8 * count], axis=1).reshape(-1)
        buffer = yield from self._read(np.repeat(k, 2), starts, ends)
        got: dict[int, Int64Array] = {}
        at = 0
        for r, g in enumerate(pages):
            n = int(count[r])
            lengths = buffer[at : at + 4 * n].view("<i4").astype(np.int64)
            pointers = buffer[at + 4 * n : at + 12 * n].view("<i8").astype(np.int64)
            at += 12 * n
            got[g] = self._check_sequences(
                int(k[r]), int(local[r]), int(first[r]), lengths, pointers
            )
        return got

    def _check_sequences(
        self, k: int, page: int, first: int, lengths: Int64Array, pointers: Int64Array
    ) -> Int64Array:
        """The page's local element offsets (its end last), once its lengths and pointers
        agree with each other and with the summary."""
        layout = self.layouts[k]
        itemsize = layout.dtype.itemsize
        summary = self.sequences.summaries[k]
        n = lengths.size
        where = (
            f"{layout.url}: page {page} of sequences {first}..{first + n - 1}, bytes"
            f" [{layout.lengths_at + 4 * first}, {layout.lengths_at + 4 * (first + n)}) and"
            f" [{layout.pointers_at + 8 * first}, {layout.pointers_at + 8 * (first + n)})"
        )
        if (lengths < 0).any():
            bad = int(np.flatnonzero(lengths < 0)[0])
            raise FormatError(f"{where}: sequence {first + bad} has length {lengths[bad]}")
        ends = int(summary[page]) * itemsize + np.cumsum(lengths * itemsize)
        expected = np.concatenate([[int(summary[page]) * itemsize], ends[:-1]])
        wrong = np.flatnonzero(pointers != expected)
        if wrong.size:
            bad = int(wrong[0])
            raise FormatError(
                f"{where}: sequence {first + bad} points at byte {pointers[bad]} of the .bin,"
                f" expected {expected[bad]} (sequence pointers must follow the sequence"
                " lengths)"
            )
        end = int(summary[page + 1]) * itemsize
        if int(ends[-1]) != end:
            raise FormatError(
                f"{where}: its sequences end at byte {int(ends[-1])} of the .bin, but the next"
                f" {'page starts' if page + 2 < summary.size else 'the index says they end'}"
                f" at byte {end} (a length that disagrees with the .bin's layout)"
            )
        offsets: Int64Array = np.append(expected, end) // itemsize
        return offsets

    def _document_pages(self, pages: list[int]) -> Generator[Step, Any, dict[int, Int64Array]]:
        """Fetch and check document pages: their document indices (one range each), then
        the sequence pages those name."""
        chosen = np.array(pages, dtype=np.int64)
        k = self.pages.dataset[chosen]
        local = self.pages.local[chosen]
        size = np.array([self.layouts[i].page for i in k.tolist()], dtype=np.int64)
        documents = np.array([self.layouts[i].entries - 1 for i in k.tolist()], dtype=np.int64)
        first = local * size
        count = np.minimum(size, documents - first)
        base = np.array([self.layouts[i].documents_at for i in k.tolist()], dtype=np.int64)
        starts = base + 8 * first
        buffer = yield from self._read(k, starts, starts + 8 * (count + 1))
        indices: list[Int64Array] = []
        at = 0
        for r in range(len(pages)):
            n = int(count[r]) + 1
            indices.append(buffer[at : at + 8 * n].view("<i8").astype(np.int64))
            at += 8 * n
            layout = self.layouts[int(k[r])]
            values = indices[-1]
            bad = (values < 0) | (values > layout.sequences) | (np.diff(values, prepend=0) < 0)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise FormatError(
                    f"{layout.url}: page {int(local[r])} of document indices, bytes"
                    f" [{int(starts[r])}, {int(starts[r]) + 8 * n}): entry {int(first[r]) + i}"
                    f" is {values[i]}, out of order in the {layout.sequences} sequences"
                )
        # The sequence pages holding those sequences' offsets (sequence S: the last page's end).
        where: list[tuple[Int64Array, Int64Array]] = []
        for r, values in enumerate(indices):
            kr = int(k[r])
            layout = self.layouts[kr]
            last = max(0, self.sequences.summaries[kr].size - 2)
            page = np.minimum(values // layout.page, last)
            where.append((self.sequences.base[kr] + page, values - page * layout.page))
        wanted = np.unique(
            np.concatenate(
                [
                    w[0]
                    for w, kr in zip(where, k.tolist(), strict=True)
                    if self.layouts[kr].sequences
                ]
                + [np.zeros(0, dtype=np.int64)]
            )
        )
        table = yield from self.load(self.sequences, wanted)
        got: dict[int, Int64Array] = {}
        for r, g in enumerate(pages):
            kr, page_of, at_in = int(k[r]), *where[r]
            offsets = np.empty(page_of.size, dtype=np.int64)
            if self.layouts[kr].sequences == 0:
                offsets[:] = 0
            else:
                for p in np.unique(page_of).tolist():
                    picked = page_of == p
                    offsets[picked] = table[p][at_in[picked]]
            summary = self.pages.summaries[kr]
            number = int(local[r])
            if offsets[0] != summary[number] or offsets[-1] != summary[number + 1]:
                n = offsets.size
                raise FormatError(
                    f"{self.layouts[kr].url}: page {number} of document indices, bytes"
                    f" [{int(starts[r])}, {int(starts[r]) + 8 * n}): its documents span elements"
                    f" {offsets[0]}..{offsets[-1]}, the index's summary says"
                    f" {summary[number]}..{summary[number + 1]}"
                )
            got[g] = offsets
        return got
