"""The cost of a run before it starts: requests, bytes, time and dollars, without reading data.

:func:`plan` opens the dataset (its manifest, footers, index metadata: what ``open_dataset``
reads) and builds, for a few ranks, exactly what a :class:`~asyncbatch.Loader` of those
options builds (its source, its order, its engine's groups), then asks the source for each
group's reads, as the engine does, and counts them as the read counts of
:meth:`~asyncbatch.Loader.statistics` do: one request per byte range. No byte of the data is
read.

Sampling (so that 10^12 tokens over 1024 ranks plan in seconds): when all groups of all
ranks together hold more than ``max_ids`` sample ids, only ``ranks`` ranks are costed (evenly
spread, the first and the last among them) and, in each, the groups of each size are costed
in full up to ``groups`` of them, else a random sample of ``groups`` of them (fixed seed).
A rank's total is each size's mean times its number of groups; ranks not costed get the mean
of those costed. Every order gives each rank a statistically alike share (positions
``q % W``, or whole windows of blocks), so the error is sampling error: the bound printed is
three standard errors (groups within a rank, with the finite population correction, and
ranks across the world), about 99.7% coverage for the normal approximation. Costing every
group of every rank gives a bound of 0.

Index bytes: a Megatron ``.idx`` by sequence is counted exactly (its summary, read at
open, says which pages each group needs). Documents with per-shard indexes are estimated:
which page holds a window depends on the documents' lengths, known only from the index
itself, so a window's page is computed as if a shard's documents were of equal length; the
rest is the source's own walk over the rank's groups (a top level or whole index the first
time a group touches its shard, then the pages no group fetched before, neighbours in one
range). Sampled, the distinct pages of the rank's windows are those of the sampled groups
scaled to all its windows, saturating as pages are met again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ._dataset import Dataset
from ._engine import Engine
from ._errors import ConfigError
from ._layout import ReadPlan, WindowPlan
from ._loader import _LoaderBase
from ._mixture import Mixture
from ._open import open_dataset
from ._options import LoaderConfig
from ._portal import run_sync
from .formats._base import PlannedSource, Source
from .formats._documents import DocumentSamples, PackedDocuments
from .formats._documents_index import (
    INDEX_DTYPE,
    TOP_ENTRY_BYTES,
    DocumentIndex,
)
from .formats._megatron_index import SEQUENCE
from .formats._megatron_source import MegatronWindows
from .formats._parquet import ParquetRows
from .stores._disk_cache import DiskCache
from .stores._registry import open_store, scheme_of

Int64Array = npt.NDArray[np.int64]

#: S3 Standard list prices (us-east-1): GET requests per 1,000, data transfer out to the
#: internet per GB (first 10 TB a month). Transfer to EC2 in the same region costs nothing.
S3_GET_PER_1000 = 0.0004
S3_EGRESS_PER_GB = 0.09
#: Sample ids costed in full before plan samples ranks and groups.
MAX_IDS = 2**24
#: Ranks and groups of each size costed when sampling.
SAMPLED_RANKS = 8
SAMPLED_GROUPS = 48
#: Standard errors the error bound spans.
Z = 3.0


@dataclasses.dataclass(frozen=True, slots=True)
class RankCost:
    """What one rank reads in one epoch (``estimated``: extrapolated from sampled groups)."""

    rank: int
    batches: int
    requests: float
    bytes_fetched: float
    bytes_delivered: float
    index_requests: float
    index_bytes: float
    #: Three standard errors of ``requests`` and ``bytes_fetched`` (0 when every group was
    #: costed).
    requests_error: float
    bytes_error: float
    #: Per costed group, in epoch order: its last batch + 1, its requests and bytes fetched.
    curve: tuple[tuple[int, float, float], ...]

    @property
    def amplification(self) -> float:
        """Bytes fetched (the index's included) per byte delivered."""
        fetched = self.bytes_fetched + self.index_bytes
        return fetched / self.bytes_delivered if self.bytes_delivered else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """What :func:`plan` found: per costed rank, totals over the world and the epochs, the
    epoch time and the dollars. ``str(plan)`` is the report ``asyncbatch plan`` prints."""

    url: str
    world_size: int
    batch_size: int
    seq_len: int | None
    shuffle: str
    epochs: int
    ranks: tuple[RankCost, ...]
    sampled: bool
    latency: float
    bandwidth: float
    max_inflight: int
    get_per_1000: float
    egress_per_gb: float
    index_note: str

    def _total(self, name: str) -> float:
        mean = float(sum(getattr(r, name) for r in self.ranks)) / len(self.ranks)
        return mean * self.world_size * self.epochs

    @property
    def requests(self) -> float:
        """Requests of every rank over every epoch (the index's included)."""
        return self._total("requests") + self._total("index_requests")

    @property
    def bytes_fetched(self) -> float:
        """Bytes fetched by every rank over every epoch (the index's included)."""
        return self._total("bytes_fetched") + self._total("index_bytes")

    @property
    def bytes_delivered(self) -> float:
        return self._total("bytes_delivered")

    @property
    def index_bytes(self) -> float:
        return self._total("index_bytes")

    @property
    def amplification(self) -> float:
        return self.bytes_fetched / self.bytes_delivered if self.bytes_delivered else 0.0

    @property
    def relative_error(self) -> float:
        """The bound on the relative error of the world's requests and bytes (0: exact)."""
        if not self.sampled:
            return 0.0
        spread = 0.0
        for name in ("requests", "bytes_fetched"):
            values = np.array([getattr(r, name) for r in self.ranks], dtype=np.float64)
            errors = np.array(
                [r.requests_error if name == "requests" else r.bytes_error for r in self.ranks]
            )
            mean = float(values.mean()) or 1.0
            within = float(np.sqrt((errors**2).sum())) / len(values)
            across = (
                Z * float(values.std(ddof=1)) / math.sqrt(len(values)) if len(values) > 1 else 0
            )
            left = 1 - len(values) / self.world_size
            spread = max(spread, (within + across * math.sqrt(max(0.0, left))) / mean)
        return spread

    def rank_seconds(self, rank: RankCost) -> float:
        """One epoch of ``rank``: its requests at ``max_inflight`` in flight, each a
        ``latency`` round trip, or its bytes at ``bandwidth``, whichever takes longer."""
        requests = rank.requests + rank.index_requests
        nbytes = rank.bytes_fetched + rank.index_bytes
        return max(requests * self.latency / self.max_inflight, nbytes / self.bandwidth)

    @property
    def epoch_seconds(self) -> float:
        """The slowest costed rank's epoch (ranks step together)."""
        return max(self.rank_seconds(r) for r in self.ranks)

    @property
    def dollars_get(self) -> float:
        return self.requests / 1000 * self.get_per_1000

    @property
    def dollars_egress(self) -> float:
        return self.bytes_fetched / 1e9 * self.egress_per_gb

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def lines(self) -> list[str]:
        """The report, line by line."""
        err = self.relative_error
        how = (
            f"estimated from {len(self.ranks)} ranks' sampled groups, error bound"
            f" +/-{err:.2%} on the data reads (3 standard errors)"
            if self.sampled
            else "exact: every group of every rank costed"
        )
        shown = self.ranks if len(self.ranks) <= 16 else self.ranks[:8] + self.ranks[-8:]
        out = [
            f"plan for {self.url}",
            f"  world_size={self.world_size} batch_size={self.batch_size}"
            f" seq_len={self.seq_len} shuffle={self.shuffle!r} epochs={self.epochs}",
            f"  {how}",
            "",
            "  per rank, one epoch:",
            f"  {'rank':>6} {'batches':>9} {'requests':>14} {'fetched':>12}"
            f" {'delivered':>12} {'ampl.':>6} {'index':>10}",
        ]
        for r in shown:
            out.append(
                f"  {r.rank:>6} {r.batches:>9,} {r.requests + r.index_requests:>14,.0f}"
                f" {_size(r.bytes_fetched + r.index_bytes):>12}"
                f" {_size(r.bytes_delivered):>12} {r.amplification:>6.3f}"
                f" {_size(r.index_bytes):>10}"
            )
        if len(self.ranks) < self.world_size:
            out.append(f"  (other ranks: the mean of these {len(self.ranks)})")
        out += [
            "",
            f"  total, {self.world_size} ranks x {self.epochs} epoch(s):",
            f"    requests         {self.requests:,.0f}",
            f"    bytes fetched    {_size(self.bytes_fetched)} ({self.bytes_fetched:,.0f} B)",
            f"    bytes delivered  {_size(self.bytes_delivered)}",
            f"    amplification    {self.amplification:.3f}",
            f"    index bytes      {_size(self.index_bytes)}{self.index_note}",
            "",
            f"  epoch time at {self.latency * 1e3:g} ms a request, {self.max_inflight} in"
            f" flight, {self.bandwidth * 8 / 1e9:g} Gbit/s a rank:"
            f" {_duration(self.epoch_seconds)}"
            f" (all epochs {_duration(self.epoch_seconds * self.epochs)})",
            f"  dollars at ${self.get_per_1000:g} per 1,000 GETs and ${self.egress_per_gb:g}"
            f" per GB out: GETs ${self.dollars_get:,.2f} + egress ${self.dollars_egress:,.2f}"
            f" = ${self.dollars_get + self.dollars_egress:,.2f}",
        ]
        if (self.get_per_1000, self.egress_per_gb) == (S3_GET_PER_1000, S3_EGRESS_PER_GB):
            out.append(
                "  (S3 Standard list prices, us-east-1: GET $0.0004 per 1,000, transfer out"
                " to the internet $0.09/GB; to EC2 in the same region $0)"
            )
        return out

    def plot(self, path: str) -> None:
        """Requests and bytes fetched per costed rank over the epoch, cumulative, as a PNG
        (matplotlib, Agg)."""
        try:
            import matplotlib
        except ImportError as exc:
            raise ConfigError(
                "plotting a plan needs matplotlib: pip install 'asyncbatch[plan]'"
            ) from exc

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        for r in self.ranks:
            if not r.curve:
                continue
            ends = np.array([c[0] for c in r.curve], dtype=np.float64)
            requests = np.cumsum([c[1] for c in r.curve])
            fetched = np.cumsum([c[2] for c in r.curve])
            # Sampled groups stand for all the groups up to them: scale to the rank's total.
            requests *= r.requests / max(requests[-1], 1e-9)
            fetched *= r.bytes_fetched / max(fetched[-1], 1e-9)
            top.plot(ends, requests, label=f"rank {r.rank}", lw=1)
            bottom.plot(ends, fetched / 2**20, lw=1)
        top.set_ylabel("data requests (cumulative)")
        bottom.set_ylabel("data MiB fetched (cumulative)")
        bottom.set_xlabel("batch of the epoch")
        top.set_title(
            f"{self.url}: W={self.world_size}, B={self.batch_size}, L={self.seq_len},"
            f" shuffle={self.shuffle}",
            fontsize=9,
        )
        if len(self.ranks) <= 8:
            top.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
        n /= 1024
    raise AssertionError


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.1f} h"


class _Ranked(_LoaderBase):
    """A loader's source, order and engine for one rank, built as the loader builds them;
    it opens no store and reads nothing."""

    def __init__(self, data: Dataset | Mixture, config: LoaderConfig) -> None:
        self._setup(data, config)
        self.engine = self._build(data)


def plan(
    dataset: Dataset | Mixture | str,
    *,
    world_size: int = 1,
    batch_size: int,
    seq_len: int | None = None,
    shuffle: bool | str = True,
    epochs: int = 1,
    seed: int = 0,
    next_token: bool = False,
    block_size: int | None = None,
    window: int | None = None,
    drop_last: bool = True,
    tail: str = "drop",
    prefetch: int | None = None,
    max_inflight: int | None = None,
    coalesce_gap: int | None = None,
    format_options: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    cache: DiskCache | str | None = None,
    latency: float = 0.010,
    bandwidth: float = 1.25e9,
    get_per_1000: float = S3_GET_PER_1000,
    egress_per_gb: float = S3_EGRESS_PER_GB,
    ranks: int = SAMPLED_RANKS,
    groups: int = SAMPLED_GROUPS,
    max_ids: int = MAX_IDS,
) -> Plan:
    """The cost of reading ``dataset`` (a URL, an opened :class:`Dataset` or a
    :class:`Mixture`) with these loader
    options on ``world_size`` ranks for ``epochs`` epochs, computed from its manifest (and
    footers, index metadata) and the loader's own order and read planning: no data is read.

    ``latency`` (seconds a request), ``bandwidth`` (bytes/s a rank) and ``max_inflight``
    give the epoch time; ``get_per_1000`` and ``egress_per_gb`` the dollars (S3 list prices
    by default). ``ranks``, ``groups`` and ``max_ids`` bound the work when the run is too big
    to cost every group (see the module docstring for the method and its error bound).
    ``cache`` is used to open the dataset only: reads are costed as they reach the store
    without a node-local cache. A dataset whose reads depend on bytes not in its metadata is
    a ConfigError saying what is missing.
    """
    for name, value in (("world_size", world_size), ("epochs", epochs), ("ranks", ranks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    for name, number in (("latency", latency), ("bandwidth", bandwidth)):
        if not number > 0:
            raise ConfigError(f"{name} must be positive, got {number!r}")
    if isinstance(dataset, str):
        dataset = open_dataset(dataset, storage_options, cache=cache)
    if not isinstance(dataset, Dataset | Mixture):
        raise ConfigError(f"plan takes a Dataset, a Mixture or a URL, got {dataset!r}")
    url = (
        dataset.url
        if isinstance(dataset, Dataset)
        else f"a mixture of {', '.join(d.url for d in dataset.datasets)}"
    )
    options: dict[str, Any] = {
        "batch_size": batch_size,
        "seq_len": seq_len,
        "shuffle": shuffle,
        "seed": seed,
        "next_token": next_token,
        "block_size": block_size,
        "window": window,
        "drop_last": drop_last,
        "tail": tail,
        "prefetch": prefetch,
        "coalesce_gap": coalesce_gap,
        "format_options": format_options,
        "storage_options": storage_options,
        "verify": "off",
        "world_size": world_size,
        "rank": 0,
    }
    if max_inflight is not None:
        options["max_inflight"] = max_inflight
    base = LoaderConfig(
        batch_size=batch_size, **{k: v for k, v in options.items() if k != "batch_size"}
    )
    first = _Ranked(dataset, dataclasses.replace(base, rank=0))
    source = first.engine.source
    _check_costable(source, url)
    gap, windows = run_sync(_store_traits(source, base))
    if coalesce_gap is not None:
        gap = coalesce_gap
    order = first.engine.order
    per_rank_ids = order.batches_per_epoch * batch_size
    sampled = per_rank_ids * world_size > max_ids
    chosen = (
        sorted({round(i * (world_size - 1) / max(1, ranks - 1)) for i in range(ranks)})
        if sampled
        else list(range(world_size))
    )
    costs = []
    for rank in chosen:
        ranked = first if rank == 0 else _Ranked(dataset, dataclasses.replace(base, rank=rank))
        costs.append(_cost_rank(ranked.engine, rank, gap, windows, groups if sampled else 0, seed))
    index_note = ""
    if isinstance(source, PackedDocuments) and source.index is not None:
        index_note = (
            " (estimated: pages as if a shard's documents were of equal length)"
            if (source.index.slot_at < 0).any()
            else " (slot tables: overflow reads not counted)"
        )
    return Plan(
        url=url,
        world_size=world_size,
        batch_size=batch_size,
        seq_len=seq_len,
        shuffle=base.shuffle if isinstance(base.shuffle, str) else str(base.shuffle),
        epochs=epochs,
        ranks=tuple(costs),
        sampled=sampled,
        latency=latency,
        bandwidth=bandwidth,
        max_inflight=base.max_inflight,
        get_per_1000=get_per_1000,
        egress_per_gb=egress_per_gb,
        index_note=index_note,
    )


def _check_costable(source: Source, url: str) -> None:
    """A ConfigError unless the reads of ``source`` follow from its metadata alone."""
    kind: type[Any] = type(source)
    if isinstance(source, DocumentSamples):
        if source.index is None:  # every document's offsets read at open (documents.idx)
            return
        raise ConfigError(
            f"plan cannot cost {url} as documents (seq_len=None): its per-shard indexes hold the"
            " documents' sizes, which the manifest does not record; give seq_len= (packed"
            " windows, costed from the manifest)"
        )
    if isinstance(source, PackedDocuments):
        return
    if isinstance(source, ParquetRows):
        if not source.scattered:
            return
        raise ConfigError(
            f"plan cannot cost {url} under shuffle=True: an exact shuffle reads Parquet rows by"
            " the pages of each column chunk's offset index, which lives in the files, not in"
            " their footers; cost shuffle='block' or False (whole row groups, from the footers)"
        )
    if isinstance(source, MegatronWindows):
        if source.index.unit == SEQUENCE:
            return
        raise ConfigError(
            f"plan cannot cost {url} with unit='document': which sequence pages a page of"
            " document indices names is in the .idx, not in its summary; open it with"
            " unit='sequence' to cost it"
        )
    if not (isinstance(source, PlannedSource) and kind.fetch is PlannedSource.fetch):
        manifest = source.datasets[0].manifest
        missing = ""
        if manifest.format == "webdataset":
            missing = (
                " (WebDataset: a sample's byte range is in its shard's tar headers or sidecar"
                " index, which the manifest does not record; without sidecars only a scan of"
                " every shard finds them)"
                if not manifest.metadata.get("sidecars")
                else " (WebDataset: a sample's byte range is in the sidecar bodies, fetched"
                " as batches need them)"
            )
        raise ConfigError(
            f"plan cannot cost {url}{missing}: format {manifest.format!r} finds where"
            f" a sample's bytes are ({kind.__name__}) from bytes it reads as it goes (per-shard"
            " sidecars, scans, footers' pages), not from the manifest; plan needs a format"
            " whose sample sizes the manifest or the index read at open records (tokens,"
            " documents with seq_len=, LLMBATCH, .npy, Megatron by sequence, Parquet row groups)"
        )


async def _store_traits(source: Source, config: LoaderConfig) -> tuple[int, bool]:
    """The request cost in bytes the engine merges reads with (the smallest of its stores'),
    and whether its one store copies windows itself (one request per window)."""
    stores = []
    seen: set[tuple[str, str]] = set()
    cache = config.cache if isinstance(config.cache, DiskCache) else None
    try:
        for dataset in source.datasets:
            key = (scheme_of(dataset.url), repr(sorted(dataset.storage_options.items())))
            if key not in seen:
                seen.add(key)
                stores.append(open_store(dataset.url, dataset.storage_options, cache=cache))
        gap = min(store.coalesce_gap for store in stores)
        windows = len(stores) == 1 and stores[0].supports_windows
        return gap, windows
    finally:
        await asyncio.gather(*(store.close() for store in stores), return_exceptions=True)


def _reads(source: Source, ids: Int64Array, gap: int) -> ReadPlan | WindowPlan:
    if isinstance(source, PackedDocuments | MegatronWindows):
        return source.windows(ids, gap)
    if isinstance(source, DocumentSamples):  # documents.idx: offsets in memory
        return source.plan(ids, gap)
    if isinstance(source, ParquetRows):  # the selected chunks of the row groups read
        needed = np.unique(np.searchsorted(source.ends, ids, side="right"))
        return source.plan_groups(needed, gap)[0]
    assert isinstance(source, PlannedSource)
    return source.reads(ids, gap)


def _cost_group(
    source: Source, ids: Int64Array, gap: int, windows: bool
) -> tuple[int, int, int, Int64Array]:
    """(requests, bytes fetched, bytes delivered, shards read) of one group's reads, counted
    as the store stack counts them."""
    reads = _reads(source, ids, gap)
    if isinstance(reads, WindowPlan):
        if windows:
            n = int(reads.starts.size)
            shards = np.unique(reads.layout.shard_of(reads.starts))
            return n, reads.nbytes, reads.nbytes, shards
        reads = reads.plan()
    fetched = int((reads.read_end - reads.read_start).sum())
    return reads.num_reads, fetched, reads.nbytes, np.unique(reads.read_shard)


def _cost_rank(
    engine: Engine, rank: int, gap: int, windows: bool, sample: int, seed: int
) -> RankCost:
    """One epoch (epoch 0) of ``rank``: every group (``sample`` 0), or up to ``sample``
    groups of each size, extrapolated."""
    source, order = engine.source, engine.order
    all_groups = list(engine.groups(0))
    by_size: dict[int, list[int]] = {}
    for i, g in enumerate(all_groups):
        by_size.setdefault(len(g), []).append(i)
    rng = np.random.default_rng([seed, rank, 0x9A7])
    picked: dict[int, Sequence[int]] = {}
    for size, members in by_size.items():
        if not sample or len(members) <= sample:
            picked[size] = members
        else:
            picked[size] = sorted(rng.choice(members, size=sample, replace=False).tolist())
    measured: dict[int, tuple[int, int, int, Int64Array]] = {}
    pages: dict[int, Int64Array] = {}  # Megatron: the .idx pages each group needs
    for chosen in picked.values():
        for i in chosen:
            g = all_groups[i]
            ids = order.sample_ids(0, g.start, g[-1] + 1)
            measured[i] = _cost_group(source, ids, gap, windows)
            if isinstance(source, MegatronWindows):
                pages[i] = source.index.pages_of_windows(source.window_starts(ids), source.window)
            elif isinstance(source, PackedDocuments) and source.index is not None:
                pages[i] = source.window_starts(ids)  # the pages are estimated from these
    requests = fetched = delivered = 0.0
    var_requests = var_bytes = 0.0
    for size, members in by_size.items():
        got = np.array([measured[i][:3] for i in picked[size]], dtype=np.float64)
        n, total = len(picked[size]), len(members)
        scale = total / n
        requests += got[:, 0].sum() * scale
        fetched += got[:, 1].sum() * scale
        delivered += got[:, 2].sum() * scale
        if n < total and n > 1:
            correction = (1 - n / total) * total**2 / n
            var_requests += got[:, 0].var(ddof=1) * correction
            var_bytes += got[:, 1].var(ddof=1) * correction
    if isinstance(source, MegatronWindows):
        index_requests, index_bytes = _megatron_cost(source, all_groups, pages, order)
    else:
        index_requests, index_bytes = _index_cost(source, all_groups, measured, pages, order)
    curve = tuple(
        (all_groups[i][-1] + 1, float(measured[i][0]), float(measured[i][1]))
        for i in sorted(measured)
    )
    return RankCost(
        rank=rank,
        batches=order.batches_per_epoch,
        requests=requests,
        bytes_fetched=fetched,
        bytes_delivered=delivered,
        index_requests=index_requests,
        index_bytes=index_bytes,
        requests_error=Z * math.sqrt(var_requests),
        bytes_error=Z * math.sqrt(var_bytes),
        curve=curve,
    )


def _index_cost(
    source: Source,
    all_groups: Sequence[range],
    measured: Mapping[int, tuple[int, int, int, Int64Array]],
    starts: Mapping[int, Int64Array],
    order: Any,
) -> tuple[float, float]:
    """(requests, bytes) of the per-shard document index one rank fetches in an epoch,
    estimated (see the module docstring); (0, 0) for other sources."""
    if not isinstance(source, PackedDocuments) or source.index is None:
        return 0.0, 0.0
    index: DocumentIndex = source.index
    width = source.window
    costed = sorted(starts)
    every = sum(len(all_groups[i]) for i in measured) == sum(len(g) for g in all_groups)
    windows = sum(int(starts[i].size) for i in costed)
    if every and windows <= WALK_WINDOWS:  # the source's walk over every group, in order
        gid, seg, page = _index_keys(index, width, [starts[i] for i in costed])
        requests, nbytes = _walk(index, gid, seg, page)
        more = _slot_walk(index, width, [starts[i] for i in costed], 1.0)
        return requests + more[0], nbytes + more[1]
    # Too many windows, or sampled groups: the distinct pages of the rank's windows from
    # those of (a random subset of) the costed groups, scaled to all its windows.
    rng = np.random.default_rng(len(costed))
    while windows > WALK_WINDOWS and len(costed) > 1:
        costed = sorted(rng.choice(costed, size=len(costed) // 2, replace=False).tolist())
        windows = sum(int(starts[i].size) for i in costed)
    share = max(1e-12, windows / max(1, order.batches_per_epoch * order.batch_size))
    _, seg, page = _index_keys(index, width, [starts[i] for i in costed])
    size = INDEX_DTYPE.itemsize
    documents, pages_of = index.documents, index.page
    slot_requests, slot_bytes = _slot_walk(index, width, [starts[i] for i in costed], share)
    live = (documents > 0) & (index.element_ends > index.element_starts) & (index.slot_at < 0)
    # A top level (or whole index) for every shard: the windows spread over them all.
    whole = live & (pages_of == 0)
    paged = live & (pages_of > 0)
    total_pages = np.where(paged, -(-documents // np.maximum(pages_of, 1)), 0)
    requests = float(live.sum())
    nbytes = float((size * (documents + 1))[whole].sum() + TOP_ENTRY_BYTES * total_pages.sum())
    if page.size:
        code = seg * (int(total_pages.max()) + 1) + page
        keys = np.unique(code)
        key_seg = keys // (int(total_pages.max()) + 1)
        met = np.bincount(key_seg, minlength=documents.size).astype(np.float64)
        breaks = np.ones(keys.size, dtype=bool)
        breaks[1:] = np.diff(keys) != 1
        runs = np.bincount(key_seg[breaks], minlength=documents.size).astype(np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            distinct = total_pages * -np.expm1(-met / share / np.maximum(total_pages, 1))
            per_key_runs = np.where(met > 0, runs / np.maximum(met, 1), 0)
        requests += float((distinct * per_key_runs).sum())
        nbytes += float((distinct * size * pages_of).sum() + (distinct * per_key_runs).sum() * size)
    return requests + slot_requests, nbytes + slot_bytes


def _slot_walk(
    index: DocumentIndex, width: int, groups: Sequence[Int64Array], share: float
) -> tuple[float, float]:
    """(requests, bytes) of the slots packed windows read from indexes with a slot table
    (no top level, no page): a window's blocks are its elements over ``B``, exact. With
    ``share`` 1 (every group, in order), each slot is fetched by the first group needing it,
    neighbours of one group in one range; else the distinct slots of the rank's windows are
    estimated from those of the groups given (a ``share`` of its windows), saturating. An
    overflowing block's second read (0.1 % of blocks) is not counted."""
    tables = index.slot_tables
    block = np.array([0 if t is None else t.block for t in tables], dtype=np.int64)
    slot_bytes = np.array([0 if t is None else t.slot_bytes for t in tables], dtype=np.int64)
    blocks = np.array([0 if t is None else t.blocks for t in tables], dtype=np.int64)
    if not (block > 0).any() or not groups:
        return 0.0, 0.0
    group, seg, lo, hi = _window_segments(index, width, groups)
    keep = (block[seg] > 0) & (lo < hi)
    seg, lo, hi, group = seg[keep], lo[keep], hi[keep], group[keep]
    if not seg.size:
        return 0.0, 0.0
    b = block[seg]
    first_block = lo // b
    count = (hi - 1) // b - first_block + 1
    step = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    number = np.repeat(first_block, count) + step
    seg, group = np.repeat(seg, count), np.repeat(group, count)
    stride = int(blocks.max()) + 1
    code = seg * stride + number
    if share >= 1.0:
        # The first group needing each slot fetches it; a group's new slots, neighbours in
        # one range.
        by_code = np.lexsort((group, code))
        fresh = np.ones(by_code.size, dtype=bool)
        fresh[1:] = np.diff(code[by_code]) != 0
        chosen = by_code[fresh]
        order = np.lexsort((code[chosen], group[chosen]))
        g, c = group[chosen][order], code[chosen][order]
        breaks = np.ones(g.size, dtype=bool)
        breaks[1:] = (np.diff(g) != 0) | (np.diff(c) != 1)
        return float(breaks.sum()), float(slot_bytes[c // stride].sum())
    keys = np.unique(code)
    key_seg = keys // stride
    met = np.bincount(key_seg, minlength=block.size).astype(np.float64)
    breaks = np.ones(keys.size, dtype=bool)
    breaks[1:] = np.diff(keys) != 1
    runs = np.bincount(key_seg[breaks], minlength=block.size).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        distinct = blocks * -np.expm1(-met / share / np.maximum(blocks, 1))
        per_key_runs = np.where(met > 0, runs / np.maximum(met, 1), 0)
    return float((distinct * per_key_runs).sum()), float((distinct * slot_bytes).sum())


def _megatron_cost(
    source: MegatronWindows,
    all_groups: Sequence[range],
    pages: Mapping[int, Int64Array],
    order: Any,
) -> tuple[float, float]:
    """(requests, bytes) of the ``.idx`` sequence pages one rank fetches in an epoch: each
    page its groups' windows need (from the summary read at open), the first time, as two
    ranges (lengths, pointers: 12 bytes a sequence); when groups were sampled, the distinct
    pages of the rank's windows estimated from the sampled groups' pages per window."""
    index = source.index
    layouts, seq = index.layouts, index.sequences
    sizes = np.array([layouts[int(k)].page for k in seq.dataset.tolist()], dtype=np.int64)
    totals = np.array([layouts[int(k)].sequences for k in seq.dataset.tolist()], dtype=np.int64)
    counts = np.minimum(sizes, totals - seq.local * sizes)
    if len(pages) == len(all_groups):  # every group costed: each page once, in order
        seen: set[int] = set()
        requests = nbytes = 0
        for i in sorted(pages):
            new = [g for g in pages[i].tolist() if g not in seen]
            seen.update(new)
            requests += 2 * sum(1 for g in new if counts[g] > 0)
            nbytes += 12 * int(counts[new].sum()) if new else 0
        return float(requests), float(nbytes)
    costed = sum(len(all_groups[i]) for i in pages)
    per_batch = sum(p.size for p in pages.values()) / max(1, costed)
    total_pages = max(1, counts.size)
    needed = per_batch * order.batches_per_epoch  # page uses over the epoch
    distinct = total_pages * -math.expm1(-needed / total_pages)
    mean = float(counts.mean()) if counts.size else 0.0
    return 2 * distinct, 12 * mean * distinct


#: Windows of one rank up to which the index walk follows every group (the keys of a
#: window take ~50 bytes: 2^22 windows, ~200 MiB); beyond, it is estimated from a subset.
WALK_WINDOWS = 2**22


def _window_segments(
    index: DocumentIndex, width: int, groups: Sequence[Int64Array]
) -> tuple[Int64Array, Int64Array, Int64Array, Int64Array]:
    """``(group, segment, lo, hi)`` for every segment each window of ``width`` elements at
    each group's ``starts`` overlaps, ``[lo, hi)`` its part local to the segment (empty
    where ``lo >= hi``)."""
    sizes = [int(g.size) for g in groups]
    at = np.concatenate([*groups, np.zeros(0, dtype=np.int64)])
    group = np.repeat(np.arange(len(groups), dtype=np.int64), sizes)
    ends = index.element_ends
    first = np.searchsorted(ends, at, side="right")
    last = np.searchsorted(ends, at + max(0, width - 1), side="right")
    count = last - first + 1
    step = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    seg = np.repeat(first, count) + step
    at, group = np.repeat(at, count), np.repeat(group, count)
    keep = seg < ends.size
    seg, at, group = seg[keep], at[keep], group[keep]
    base = index.element_starts[seg]
    lo = np.maximum(at, base) - base
    hi = np.minimum(at + width, ends[seg]) - base
    return group, seg, lo, hi


def _index_keys(
    index: DocumentIndex, width: int, groups: Sequence[Int64Array]
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """``(group, segment, page)`` of every paged-index page the windows of ``width``
    elements at each group's ``starts`` span, each element's page estimated as if a
    segment's documents were of equal length (whole indexes: page -1); unique, ordered."""
    group, seg, lo, hi = _window_segments(index, width, groups)
    n, per = index.documents[seg], index.page[seg]
    span = np.maximum(index.element_ends[seg] - index.element_starts[seg], 1)
    keep = (lo < hi) & (n > 0) & (index.slot_at[seg] < 0)  # slots: see _slot_walk
    seg, lo, hi, n, per, group = seg[keep], lo[keep], hi[keep], n[keep], per[keep], group[keep]
    span = span[keep]
    paged = per > 0
    safe = np.maximum(per, 1)
    first_page = np.where(paged, lo * n // span // safe, -1)
    last_page = np.where(paged, (hi - 1) * n // span // safe, -1)
    count = last_page - first_page + 1
    step = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    page = np.repeat(first_page, count) + step
    seg, group = np.repeat(seg, count), np.repeat(group, count)
    order = np.lexsort((page, seg, group))
    gid, seg, page = group[order], seg[order], page[order]
    fresh = np.ones(gid.size, dtype=bool)
    fresh[1:] = (np.diff(gid) != 0) | (np.diff(seg) != 0) | (np.diff(page) != 0)
    return gid[fresh], seg[fresh], page[fresh]


def _walk(
    index: DocumentIndex, gid: Int64Array, seg: Int64Array, page: Int64Array
) -> tuple[float, float]:
    """(requests, bytes) of the source's walk over the groups' keys (see
    :func:`_index_keys`): a segment's top level (or whole index) the first time a group
    touches it, one range; then the pages no earlier group fetched, neighbours in one range."""
    size = INDEX_DTYPE.itemsize
    if not gid.size:
        return 0.0, 0.0
    touched = np.unique(seg)
    touched = touched[index.slot_at[touched] < 0]  # windows of a slot table read no top level
    documents, per = index.documents[touched], index.page[touched]
    whole = per == 0
    requests = float(touched.size)
    nbytes = float((size * (documents[whole] + 1)).sum())
    tops = -(-documents[~whole] // np.maximum(per[~whole], 1))
    nbytes += float(TOP_ENTRY_BYTES * tops.sum())
    paged = page >= 0
    gid, seg, page = gid[paged], seg[paged], page[paged]
    if gid.size:
        width = int(page.max()) + 1
        code = seg * width + page
        # The first group that needs each page fetches it.
        by_code = np.lexsort((gid, code))
        first = np.ones(by_code.size, dtype=bool)
        first[1:] = np.diff(code[by_code]) != 0
        chosen = by_code[first]
        order = np.lexsort((code[chosen], gid[chosen]))
        g, c = gid[chosen][order], code[chosen][order]
        s, k = seg[chosen][order], page[chosen][order]
        breaks = np.ones(g.size, dtype=bool)
        breaks[1:] = (np.diff(g) != 0) | (np.diff(c) != 1)
        n, p = index.documents[s], index.page[s]
        requests += float(breaks.sum())
        nbytes += float((size * (np.minimum(n, (k + 1) * p) - k * p)).sum() + size * breaks.sum())
    return requests, nbytes
