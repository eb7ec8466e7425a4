"""The member index of a WebDataset tar shard: its samples, each one contiguous byte range,
and their fields' byte ranges inside it; found by walking the shard's 512-byte headers in
memory, and kept in a sidecar file beside the shard (``000000.tar.abidx``).

Samples follow the webdataset library's own rule (``tariterators.group_by_keys`` over
``base_plus_ext``): regular members only, ``__*__`` metadata members skipped, names without
a dot in their base name skipped; consecutive members with the same key (the name up to the
first dot of its base name, the folder part kept) form one sample, its fields named by the
rest of the name, lowercased (``jpg``, ``seg.png``). A sample ends at its shard's end, so a
key split across two shards is two samples; a key seen again after another is another
sample; one field twice in a sample is a FormatError, as webdataset raises.

The sidecar layout (version 2), little-endian::

    offset size type   field
    0      8    bytes  magic "ABTARIDX"
    8      4    u32    version (2)
    12     4    u32    F: field names
    16     8    u64    the shard's size in bytes
    24     8    u64    S: samples
    32     8    u64    M: members (fields of all samples)
    40     8    u64    K: bytes of the keys
    48     8    u64    N: bytes of the field names
    56     8    u64    xxh3-64 of the body
    64          body:
                u64[S]   sample start: the first header of its first member
                u64[S]   sample end: the end of its last member's data
                u64[S+1] key offsets into the keys
                u64[M]   member data offset in the shard
                u64[M]   member data length
                u32[S]   members of each sample (they follow each other)
                u32[M]   member field (index into the names)
                u8[K]    keys, UTF-8, one after another
                summary:
                u64[F]   samples holding each field
                u64[F]   bytes of each field's data, all samples together
                u32[F+1] field name offsets into the names
                u8[N]    field names, UTF-8, one after another
                64 bytes the header again
    end - 16    u64    xxh3-64 of the summary
    end - 8     bytes  magic "ABTARIDX"

Opening reads the summary only, from the sidecar's end (one suffix range, which also tells
the sidecar's size): each shard's sample count, fields and size. The header and body, bytes
``[0, 64 + body)``, are fetched when a batch first reads the shard; their header must be the
summary's copy, and their digest the header's. Every array is read with one
``np.frombuffer``; the arrays' own consistency (starts before ends, members inside their
sample, inside the shard, the fields' counts the summary's) is checked. Sidecars of version
1 (the same header and arrays, the field names' offsets and names closing the body, no
summary) are still read, whole, at open.
"""

from __future__ import annotations

import asyncio
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .._checksums import digest
from .._errors import FormatError
from ..stores._base import ObjectInfo, Store, fetch_tail, tail_by_stat
from ..stores._cache import CachedStore
from ..stores._disk_cache import DiskCache

Int64Array = npt.NDArray[np.int64]

FORMAT = "webdataset"
SIDECAR_SUFFIX = ".abidx"
MAGIC = b"ABTARIDX"
VERSION = 2
BLOCK = 512
#: Bytes of a shard read at once when it is scanned without a sidecar.
SCAN_CHUNK = 8 << 20
#: Bytes of a version 1 sidecar read first (a larger one takes a second read of the rest).
SIDECAR_PROBE = 256 << 10
#: Bytes at a sidecar's end read at open: its summary (a larger one takes a second read).
SUMMARY_PROBE = 1 << 10
#: The most bytes a long-name or pax header's data may hold.
MAX_NAME_DATA = 1 << 20
_HEADER = struct.Struct("<8sIIQQQQQQ")
_TRAILER = struct.Struct("<Q8s")
#: webdataset's ``base_plus_ext``: the key (folder part kept) and the extensions.
_BASE_PLUS_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
#: webdataset's ``skip_meta`` (matched at the start of a name).
_SKIP_META = re.compile(r"__[^/]*__($|/)")
#: Type flags of members whose data is a file (tarfile's ``REGULAR_TYPES`` less sparse).
_REGULAR = (b"0", b"\0", b"7")


def sidecar_url(shard_url: str) -> str:
    """Where the sidecar index of ``shard_url`` lives: beside it, the name plus ``.abidx``."""
    return shard_url + SIDECAR_SUFFIX


@dataclass(frozen=True, eq=False)
class SidecarSummary:
    """What opening reads of a sidecar: its header and summary (see the module's layout).
    Enough to place the shard's samples and choose its fields; the rest, its body, is
    fetched (``[0, fetch_bytes)``) when a batch first reads the shard."""

    #: The 64-byte header, as the sidecar's start must hold it.
    header: bytes
    size: int
    samples: int
    members: int
    key_bytes: int
    fields: tuple[str, ...]
    #: Samples holding each field; bytes of each field's data (all samples).
    field_samples: Int64Array
    field_bytes: Int64Array
    #: The summary's own bytes (the header copy last): what identifies the index.
    packed: bytes

    @property
    def body_bytes(self) -> int:
        s, m = self.samples, self.members
        return 8 * (3 * s + 1 + 2 * m) + 4 * (s + m) + self.key_bytes

    @property
    def fetch_bytes(self) -> int:
        """Bytes of the sidecar a batch fetches: its header and body."""
        return _HEADER.size + self.body_bytes

    @property
    def sidecar_bytes(self) -> int:
        """The whole sidecar's size."""
        return self.fetch_bytes + len(self.packed) + _TRAILER.size

    @classmethod
    def parse(cls, data: bytes | bytearray | memoryview, total: int, url: str) -> SidecarSummary:
        """The summary from the sidecar's last bytes ``data`` (its summary and trailer,
        :func:`summary_span` of them), the sidecar being ``total`` bytes."""
        view = memoryview(data)
        packed = bytes(view[: -_TRAILER.size])
        checksum, _ = _TRAILER.unpack_from(view, len(view) - _TRAILER.size)
        if digest(packed) != checksum:
            raise FormatError(f"{url}: its checksum does not match its bytes (corrupt)")
        header = packed[-_HEADER.size :]
        _, _, nfields, size, samples, members, nkeys, nnames, _ = _HEADER.unpack(header)
        at = 0

        def take(dtype: str, count: int) -> Int64Array:
            nonlocal at
            array = np.frombuffer(packed, dtype=dtype, count=count, offset=at)
            at += array.nbytes
            return array.astype(np.int64)

        field_samples, field_bytes = take("<u8", nfields), take("<u8", nfields)
        name_offsets = take("<u4", nfields + 1)
        fields = _names(packed[at : at + nnames], name_offsets, url)
        summary = cls(
            header, size, samples, members, nkeys, fields, field_samples, field_bytes, packed
        )
        if summary.sidecar_bytes != total:
            raise FormatError(
                f"{url}: {total} bytes, but its header ({samples} samples, {members} members)"
                f" needs {summary.sidecar_bytes}: truncated or corrupt; write it again with"
                " `asyncbatch index`"
            )
        if (
            len(set(fields)) != len(fields)
            or bool((field_samples > samples).any())
            or int(field_samples.sum()) != members
        ):
            raise FormatError(f"{url}: corrupt tar index (its field counts); write it again")
        return summary


def summary_span(tail: bytes | bytearray | memoryview, total: int, url: str) -> int | None:
    """Bytes at the end of a ``total``-byte sidecar that hold its summary and trailer, from
    its last bytes ``tail`` (at least 80 of them, or all); None for a sidecar
    without a summary (version 1, or not a sidecar at all)."""
    view = memoryview(tail)
    if len(view) < _TRAILER.size or bytes(view[-8:]) != MAGIC:
        return None
    if total < _HEADER.size * 2 + _TRAILER.size:
        raise FormatError(
            f"{url}: {total} bytes: truncated; write it again with `asyncbatch index`"
        )
    end = len(view) - _TRAILER.size
    magic, version, nfields, *_, nnames, _ = _HEADER.unpack_from(view, end - _HEADER.size)
    if magic != MAGIC or version != VERSION:
        raise FormatError(
            f"{url}: tar index version {version} is unknown (known: {VERSION}), or corrupt;"
            " write it again with `asyncbatch index`"
        )
    span: int = 16 * nfields + 4 * (nfields + 1) + nnames + _HEADER.size + _TRAILER.size
    if span > total:
        raise FormatError(f"{url}: corrupt tar index (its summary is larger than it)")
    return span


def _names(raw: bytes, offsets: Int64Array, url: str) -> tuple[str, ...]:
    if offsets.size and (int(offsets[0]) != 0 or int(offsets[-1]) != len(raw)):
        raise FormatError(f"{url}: corrupt field names; write it again")
    try:
        return tuple(
            raw[a:b].decode("utf-8", "surrogateescape")
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
        )
    except ValueError as exc:
        raise FormatError(f"{url}: corrupt field names: {exc}") from exc


@dataclass(frozen=True, eq=False)
class ShardIndex:
    """The samples of one shard and their members (see the module's layout)."""

    size: int
    starts: Int64Array
    ends: Int64Array
    key_offsets: Int64Array
    keys: npt.NDArray[np.uint8]
    #: Members of each sample; sample ``s``'s are ``member_base[s] ..`` (cumulative).
    members: Int64Array
    offsets: Int64Array
    lengths: Int64Array
    #: Field of each member: an index into ``fields``.
    field: Int64Array
    fields: tuple[str, ...]

    @property
    def num_samples(self) -> int:
        return int(self.starts.size)

    def key(self, sample: int) -> str:
        raw = self.keys[int(self.key_offsets[sample]) : int(self.key_offsets[sample + 1])]
        return raw.tobytes().decode("utf-8", "surrogateescape")

    def _body(self) -> bytes:
        return b"".join(
            (
                self.starts.astype("<u8").tobytes(),
                self.ends.astype("<u8").tobytes(),
                self.key_offsets.astype("<u8").tobytes(),
                self.offsets.astype("<u8").tobytes(),
                self.lengths.astype("<u8").tobytes(),
                self.members.astype("<u4").tobytes(),
                self.field.astype("<u4").tobytes(),
                self.keys.tobytes(),
            )
        )

    def _header(self, body: bytes, nnames: int) -> bytes:
        return _HEADER.pack(
            MAGIC,
            VERSION,
            len(self.fields),
            self.size,
            self.num_samples,
            int(self.offsets.size),
            int(self.keys.size),
            nnames,
            digest(body),
        )

    def _summary(self, header: bytes) -> bytes:
        names = [name.encode("utf-8", "surrogateescape") for name in self.fields]
        name_offsets = np.cumsum([0, *(len(n) for n in names)]).astype("<u4")
        count = len(self.fields)
        field_samples = np.bincount(self.field, minlength=count)[:count]
        field_bytes = np.bincount(self.field, weights=self.lengths, minlength=count)[:count]
        return b"".join(
            (
                field_samples.astype("<u8").tobytes(),
                field_bytes.astype("<u8").tobytes(),
                name_offsets.tobytes(),
                b"".join(names),
                header,
            )
        )

    def pack(self) -> bytes:
        """The sidecar's bytes."""
        body = self._body()
        nnames = sum(len(n.encode("utf-8", "surrogateescape")) for n in self.fields)
        header = self._header(body, nnames)
        summary = self._summary(header)
        return header + body + summary + _TRAILER.pack(digest(summary), MAGIC)

    def summary(self) -> SidecarSummary:
        """What opening reads of this index's sidecar."""
        packed = self.pack()
        span = summary_span(packed, len(packed), "")
        assert span is not None
        return SidecarSummary.parse(packed[-span:], len(packed), "")

    @classmethod
    def parse(cls, data: bytes | bytearray | memoryview, url: str) -> ShardIndex:
        """The index in the whole sidecar ``data`` read from ``url`` (version 1 or 2); a
        FormatError naming the URL for anything the layout does not allow."""
        view = memoryview(data)
        if len(view) < _HEADER.size or bytes(view[:8]) != MAGIC:
            raise FormatError(
                f"{url}: not an asyncbatch tar index (no {MAGIC.decode()} magic); write it"
                " again with `asyncbatch index`"
            )
        version = _HEADER.unpack_from(view)[1]
        if version == 1:
            return cls._parse_v1(view, url)
        span = summary_span(view, len(view), url)
        if span is None:
            raise FormatError(
                f"{url}: tar index version {version} without its summary: truncated or corrupt;"
                " write it again with `asyncbatch index`"
            )
        summary = SidecarSummary.parse(view[-span:], len(view), url)
        return cls.from_body(view[: summary.fetch_bytes], summary, url)

    @classmethod
    def from_body(
        cls, data: bytes | bytearray | memoryview, summary: SidecarSummary, url: str
    ) -> ShardIndex:
        """The index from a sidecar's first ``summary.fetch_bytes`` bytes ``data`` (its
        header and body), whose summary was read before."""
        view = memoryview(data)
        if bytes(view[: _HEADER.size]) != summary.header:
            raise FormatError(
                f"{url}: bytes [0, {_HEADER.size}) are not the header its summary holds: it"
                " changed after it was opened, or is corrupt; write it again with"
                " `asyncbatch index`"
            )
        body = view[_HEADER.size : summary.fetch_bytes]
        checksum = _HEADER.unpack(summary.header)[-1]
        if len(body) != summary.body_bytes or digest(body) != checksum:
            raise FormatError(f"{url}: its checksum does not match its bytes (corrupt)")
        samples, members = summary.samples, summary.members
        at = 0

        def take(dtype: str, count: int) -> Int64Array:
            nonlocal at
            array = np.frombuffer(body, dtype=dtype, count=count, offset=at)
            at += array.nbytes
            return array.astype(np.int64)

        starts, ends = take("<u8", samples), take("<u8", samples)
        key_offsets = take("<u8", samples + 1)
        offsets, lengths = take("<u8", members), take("<u8", members)
        per_sample = take("<u4", samples)
        field = take("<u4", members)
        keys = np.frombuffer(body, dtype=np.uint8, count=summary.key_bytes, offset=at)
        index = cls(
            summary.size,
            starts,
            ends,
            key_offsets,
            keys,
            per_sample,
            offsets,
            lengths,
            field,
            summary.fields,
        )
        index.check(url)
        count = len(summary.fields)
        if not np.array_equal(np.bincount(field, minlength=count), summary.field_samples):
            raise FormatError(f"{url}: corrupt tar index (its field counts); write it again")
        return index

    @classmethod
    def _parse_v1(cls, view: memoryview, url: str) -> ShardIndex:
        """A version 1 sidecar: no summary, the field names closing the body."""
        _, _, nfields, size, samples, members, nkeys, nnames, checksum = _HEADER.unpack_from(view)
        expected = (
            _HEADER.size
            + 8 * (3 * samples + 1 + 2 * members)
            + 4 * (samples + nfields + 1 + members)
            + nkeys
            + nnames
        )
        if len(view) != expected:
            raise FormatError(
                f"{url}: {len(view)} bytes, but its header ({samples} samples, {members}"
                f" members) needs {expected}: truncated or corrupt; write it again with"
                " `asyncbatch index`"
            )
        body = view[_HEADER.size :]
        if digest(body) != checksum:
            raise FormatError(f"{url}: its checksum does not match its bytes (corrupt)")
        at = 0

        def take(dtype: str, count: int) -> Int64Array:
            nonlocal at
            array = np.frombuffer(body, dtype=dtype, count=count, offset=at)
            at += array.nbytes
            return array.astype(np.int64)

        starts, ends = take("<u8", samples), take("<u8", samples)
        key_offsets = take("<u8", samples + 1)
        offsets, lengths = take("<u8", members), take("<u8", members)
        per_sample = take("<u4", samples)
        name_offsets = take("<u4", nfields + 1)
        field = take("<u4", members)
        keys = np.frombuffer(body, dtype=np.uint8, count=nkeys, offset=at)
        fields = _names(bytes(body[at + nkeys :]), name_offsets, url)
        index = cls(
            size, starts, ends, key_offsets, keys, per_sample, offsets, lengths, field, fields
        )
        index.check(url)
        return index

    def check(self, url: str) -> None:
        """Every sample inside the shard, its members inside it, offsets in order; each
        check runs only once those before it hold (they size its arrays)."""
        checks: list[tuple[str, Callable[[], bool]]] = [
            ("key offsets", lambda: self.key_offsets.size == self.num_samples + 1),
            (
                "key offsets out of order",
                lambda: (
                    int(self.key_offsets[0]) == 0
                    and bool((np.diff(self.key_offsets) >= 0).all())
                    and int(self.key_offsets[-1]) == self.keys.size
                ),
            ),
            (
                "a negative offset or length",
                lambda: all(
                    bool((a >= 0).all()) for a in (self.starts, self.offsets, self.lengths)
                ),
            ),
            ("a sample ends before it starts", lambda: bool((self.starts <= self.ends).all())),
            ("a sample past the shard's end", lambda: bool((self.ends <= self.size).all())),
            ("samples overlap", lambda: bool((self.starts[1:] >= self.ends[:-1]).all())),
            ("member counts", lambda: int(self.members.sum()) == self.offsets.size),
            ("a sample without members", lambda: bool((self.members >= 1).all())),
            ("a field number", lambda: bool((self.field < len(self.fields)).all())),
            ("a member outside its sample", self._members_inside),
        ]
        for what, holds in checks:
            if not holds():
                raise FormatError(f"{url}: corrupt tar index ({what}); write it again")

    def _members_inside(self) -> bool:
        owner = np.repeat(np.arange(self.num_samples), self.members)
        return bool(
            (self.offsets - BLOCK >= self.starts[owner]).all()
            and (self.offsets + self.lengths <= self.ends[owner]).all()
        )


# ---------------------------------------------------------------------------------------------
# Walking the headers


def _nts(field: bytes) -> bytes:
    """A NUL-terminated field, up to its NUL."""
    end = field.find(b"\0")
    return field if end < 0 else field[:end]


def _number(field: bytes) -> int | None:
    """A numeric header field as tarfile reads it (octal, or GNU base-256); None if neither."""
    if field[:1] in (b"\x80", b"\xff"):
        value = 0
        for byte in field[1:]:
            value = (value << 8) + byte
        if field[0] == 0xFF:
            value -= 256 ** (len(field) - 1)
        return value
    text = _nts(field).strip()
    try:
        return int(text or b"0", 8)
    except ValueError:
        return None


def _checksum_ok(block: bytes) -> bool:
    """tarfile's check: the stored sum is the unsigned or signed sum of the header bytes,
    its checksum field counted as spaces."""
    stored = _number(block[148:156])
    if stored is None:
        return False
    unsigned = 256 + sum(block[:148]) + sum(block[156:])
    if stored == unsigned:
        return True
    signed: int = 256 + sum(struct.unpack_from("148b8x356b", block))
    return stored == signed


def _pax_records(data: bytes, url: str, at: int) -> dict[str, str]:
    """``key=value`` records of a pax extended header's data."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos : pos + 1] != b"\0":
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            length = 0
        record = data[space + 1 : pos + length]
        if space < 0 or length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise FormatError(f"{url}: corrupt pax header at bytes [{at}, {at + BLOCK})")
        key, _, value = record[:-1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


@dataclass(slots=True)
class _Member:
    name: str
    header: int  # the first header of the member (long-name and pax ones included)
    offset: int
    length: int


class TarWalk:
    """Walks a tar shard's headers from bytes fed to it in order, never its data: tells which
    bytes it needs next (:attr:`position`), takes a chunk starting there (:meth:`feed`), and
    collects the regular members with their names and data ranges."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size = url, size
        self.position = 0
        self.done = size == 0
        self.members: list[_Member] = []
        self._first_header: int | None = None
        self._name: str | None = None
        self._size: int | None = None
        self._key = "(none yet)"

    def _where(self, at: int) -> str:
        return f"{self.url}: bytes [{at}, {at + BLOCK}) (after sample key {self._key!r})"

    def feed(self, chunk: bytes | bytearray | memoryview, at: int) -> None:
        """Parse the headers inside ``chunk`` (bytes ``[at, at + len(chunk))`` of the shard,
        ``at`` being :attr:`position`); moves :attr:`position` past them."""
        assert at == self.position, "fed from the position asked for"
        assert not self.done
        data = bytes(chunk)
        end = at + len(data)
        while not self.done:
            pos = self.position
            if pos >= self.size:  # no end-of-archive blocks: the archive ends here
                self.done = True
                break
            if self.size - pos < BLOCK:
                if end < self.size:
                    break
                rest = data[pos - at :]
                if rest.count(0) != len(rest):
                    raise FormatError(
                        f"{self.url}: truncated: {len(rest)} bytes at [{pos}, {self.size}) where"
                        f" a {BLOCK}-byte header should be (after sample key {self._key!r})"
                    )
                self.done = True
                break
            if pos + BLOCK > end:
                break
            block = data[pos - at : pos - at + BLOCK]
            if block.count(0) == BLOCK:  # end of archive
                self.done = True
                break
            if not _checksum_ok(block):
                what = "not a tar file" if pos == 0 else "corrupt"
                raise FormatError(f"{self._where(pos)}: bad tar header checksum ({what})")
            length = _number(block[124:136])
            if length is None or length < 0:
                raise FormatError(f"{self._where(pos)}: bad size field in a tar header")
            kind = block[156:157]
            if kind in (b"L", b"K", b"x", b"X", b"g"):
                # The header's data names the next member (or says what it is): it must be
                # in memory.
                if length > MAX_NAME_DATA:
                    raise FormatError(f"{self._where(pos)}: a {length}-byte long-name header")
                stop = pos + BLOCK + length
                if stop > self.size:
                    raise self._truncated(pos, stop)
                if stop > end:
                    break
                self._special(kind, data[pos - at + BLOCK : stop - at], pos)
                if self._first_header is None:
                    self._first_header = pos
                self.position = pos + BLOCK + _padded(length)
                continue
            if kind == b"S":
                raise FormatError(
                    f"{self._where(pos)}: a GNU sparse member; WebDataset shards hold plain files"
                )
            if self._size is not None:
                length = self._size
            name = self._name
            if name is None:
                name = _nts(block[0:100]).decode("utf-8", "surrogateescape")
                prefix = _nts(block[345:500]).decode("utf-8", "surrogateescape")
                if kind == b"\0" and name.endswith("/"):
                    kind = b"5"
                if prefix:
                    name = prefix + "/" + name
            data_start = pos + BLOCK
            data_end = data_start + length
            first = pos if self._first_header is None else self._first_header
            self._name = self._size = self._first_header = None
            if kind in _REGULAR:
                self.members.append(_Member(name, first, data_start, length))
                self._key = name
                if data_end > self.size:
                    raise self._truncated(pos, data_end)
            self.position = data_start + _padded(length)

    def _truncated(self, pos: int, stop: int) -> FormatError:
        return FormatError(
            f"{self.url}: truncated: the member at bytes [{pos}, {stop}) ({self._key!r}) runs past"
            f" the shard's end at {self.size}"
        )

    def _special(self, kind: bytes, data: bytes, pos: int) -> None:
        """A GNU long name (``L``), long link (``K``) or pax header (``x``, ``g``) before a
        member: what tarfile takes from it (the name and size of the next member)."""
        if kind == b"L":
            self._name = _nts(data).decode("utf-8", "surrogateescape")
        elif kind == b"K":
            pass  # a link target: the member it precedes is a link, not a file
        else:
            records = _pax_records(data, self.url, pos)
            if kind == b"g":
                if "path" in records or "size" in records:
                    raise FormatError(
                        f"{self._where(pos)}: a global pax header setting path or size;"
                        " WebDataset shards name each member on its own"
                    )
                return
            if any(key.startswith("GNU.sparse") for key in records):
                raise FormatError(f"{self._where(pos)}: a pax sparse member")
            if "path" in records:
                self._name = records["path"]
            if "size" in records:
                try:
                    self._size = int(records["size"])
                except ValueError:
                    raise FormatError(f"{self._where(pos)}: bad pax size") from None

    def index(self) -> ShardIndex:
        """The samples of the members walked, grouped as webdataset groups them."""
        return group_members(self.url, self.size, self.members)


def _padded(length: int) -> int:
    return -(-length // BLOCK) * BLOCK


def split_name(name: str) -> tuple[str, str] | None:
    """``(key, field)`` of a member name as webdataset splits it; None for a member it skips
    (metadata, or no extension)."""
    if "/" not in name and name.startswith("__") and name.endswith("__"):
        return None
    if _SKIP_META.match(name):
        return None
    match = _BASE_PLUS_EXT.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


def group_members(url: str, size: int, members: Sequence[_Member]) -> ShardIndex:
    """Consecutive members of one key as samples (webdataset's ``group_by_keys``)."""
    starts: list[int] = []
    ends: list[int] = []
    keys: list[bytes] = []
    counts: list[int] = []
    offsets: list[int] = []
    lengths: list[int] = []
    field_of: list[int] = []
    fields: dict[str, int] = {}
    current: str | None = None
    seen: set[str] = set()
    for member in members:
        split = split_name(member.name)
        if split is None:
            continue
        key, field = split
        if key != current:
            current = key
            seen = set()
            starts.append(member.header)
            ends.append(member.offset + member.length)
            keys.append(key.encode("utf-8", "surrogateescape"))
            counts.append(0)
        if field in seen:
            raise FormatError(
                f"{url}: sample {key!r} holds field {field!r} twice (member {member.name!r} at"
                f" bytes [{member.offset}, {member.offset + member.length})); webdataset refuses"
                " a duplicate file name in a sample too"
            )
        seen.add(field)
        counts[-1] += 1
        ends[-1] = member.offset + member.length
        offsets.append(member.offset)
        lengths.append(member.length)
        field_of.append(fields.setdefault(field, len(fields)))
    key_lengths = [len(k) for k in keys]
    return ShardIndex(
        size=size,
        starts=np.array(starts, dtype=np.int64),
        ends=np.array(ends, dtype=np.int64),
        key_offsets=np.cumsum([0, *key_lengths], dtype=np.int64),
        keys=np.frombuffer(b"".join(keys), dtype=np.uint8),
        members=np.array(counts, dtype=np.int64),
        offsets=np.array(offsets, dtype=np.int64),
        lengths=np.array(lengths, dtype=np.int64),
        field=np.array(field_of, dtype=np.int64),
        fields=tuple(fields),
    )


# ---------------------------------------------------------------------------------------------
# Reading indexes from a store


async def scan_shard(store: Store, url: str, size: int) -> ShardIndex:
    """The index of the ``size``-byte shard at ``url`` from its headers, read in ranges of
    :data:`SCAN_CHUNK` bytes one after another (a range starts at the next header needed, so
    the data of members larger than a chunk is skipped), parsed off the loop."""
    walk = TarWalk(url, size)
    want = SCAN_CHUNK
    while not walk.done:
        start = walk.position
        stop = min(size, start + want)
        chunk = bytearray(stop - start)
        await store.read_ranges(url, starts=[start], ends=[stop], buffers=[memoryview(chunk)])
        await asyncio.to_thread(walk.feed, chunk, start)
        # No header whole in the chunk (a long name's data larger than it): a larger one. A
        # header's data is at most MAX_NAME_DATA, so this ends.
        want = SCAN_CHUNK if walk.position > start else 2 * want
    return await asyncio.to_thread(walk.index)


async def read_sidecar(
    store: Store, url: str, info: ObjectInfo | None = None
) -> SidecarSummary | ShardIndex:
    """The summary of the sidecar at ``url``: one read of its last :data:`SUMMARY_PROBE`
    bytes that also tells its size (a plain range when ``info`` tells it), a second where
    the summary is larger. A version 1 sidecar, which has none, is read whole: its index."""
    if info is None:
        tail, info = await fetch_tail(store, url, SUMMARY_PROBE)
    else:
        tail, info = await tail_by_stat(store, url, SUMMARY_PROBE, info)
    span = summary_span(tail, info.size, url)
    if span is None:
        return ShardIndex.parse(await _rest(store, url, info.size, tail), url)
    if span > len(tail):
        tail = await _rest(store, url, info.size, tail, span)
    return SidecarSummary.parse(memoryview(tail)[-span:], info.size, url)


async def _rest(
    store: Store, url: str, size: int, tail: bytes | bytearray, want: int | None = None
) -> bytes:
    """The last ``want`` bytes (default: all) of the ``size``-byte object ``url`` whose last
    bytes ``tail`` were read."""
    start = size - (size if want is None else want)
    if start >= size - len(tail):
        return bytes(tail)
    head = bytearray(size - len(tail) - start)
    await store.read_ranges(
        url, starts=[start], ends=[start + len(head)], buffers=[memoryview(head)]
    )
    return bytes(head) + bytes(tail)


async def read_whole(store: Store, url: str, info: ObjectInfo | None = None) -> bytes:
    """The whole (small) object at ``url``: one read of its last :data:`SIDECAR_PROBE` bytes
    that also tells its size (a plain range when ``info`` tells it), a second for the rest."""
    if info is None:
        tail, info = await fetch_tail(store, url, SIDECAR_PROBE)
    else:
        tail, info = await tail_by_stat(store, url, SIDECAR_PROBE, info)
    if info.size > len(tail):
        head = bytearray(info.size - len(tail))
        await store.read_ranges(url, starts=[0], ends=[len(head)], buffers=[memoryview(head)])
        return bytes(head) + bytes(tail)
    return bytes(tail)


#: What the node cache keeps a scan's index of a shard under: the shard's URL with this
#: suffix, at the shard's version (a new version of the shard is a new entry).
CACHED_INDEX = "#asyncbatch-webdataset-index"


async def scanned_index(store: Store, url: str, info: ObjectInfo) -> ShardIndex:
    """The index of a shard without a sidecar: from the node cache where a scan of this
    version of it (by any process of the node) kept it, else a scan, then kept there. Without
    a cache (``cache=``) or a version, a scan."""
    cache = store.cache if isinstance(store, CachedStore) else None
    if cache is None or info.version is None:
        return await scan_shard(store, url, info.size)
    directory = cache.object_dir(url + CACHED_INDEX, info.version)
    data = await asyncio.to_thread(_cached_index, cache, directory)
    if data is not None:
        try:
            return ShardIndex.parse(data, url)
        except FormatError:  # not an entry this code wrote whole: scanned again below
            pass
    index = await scan_shard(store, url, info.size)
    packed = index.pack()
    entry = {0: memoryview(len(packed).to_bytes(8, "little")), 1: memoryview(packed)}
    await asyncio.to_thread(cache.store, directory, entry)
    return index


def _cached_index(cache: DiskCache, directory: str) -> bytes | None:
    """The index bytes kept in ``directory`` (block 0: their length; block 1: them), or None."""
    length = bytearray(8)
    if not cache.read(directory, [(0, 8, [(0, 8, memoryview(length), 0)])]):
        return None
    size = int.from_bytes(length, "little")
    data = bytearray(size)
    if not cache.read(directory, [(1, size, [(0, size, memoryview(data), 0)])]):
        return None
    return bytes(data)
