"""A WebDataset sample as tar members, as webdataset's ``TarWriter`` writes it: one member
``<key>.<field>`` per field, in sorted field order, each value encoded by its field's
extension; and the ustar headers, made the same for the same member every time.

What a value may be, as webdataset's default encoders take it (the extension is the field's
last dot-part, lowercased: ``seg.png`` → ``png``):

- ``bytes``, ``bytearray``, ``memoryview``: written as they are, in any field;
- ``str``: UTF-8, in any field;
- ``cls cls2 class count index inx id``: an int or float (numpy's too), written as its
  ``str`` (``3`` → ``b"3"``);
- ``json jsn``: anything ``json.dumps`` takes (``json.dumps(value).encode()``);
- ``npy``: a numpy array, as ``numpy.lib.format.write_array`` writes it.

Anything else (an image array for ``jpg``, a pickle) is a ConfigError: pass its encoded
bytes. Fields starting with ``_`` (``__url__``, ``__local_path__``) are metadata, not
written, as webdataset skips them. A key or field that webdataset's grouping would read back
as another (a dot in the key's base name, a ``/`` in a field) is a ConfigError.

Headers: ustar, mode 0o444, mtime 0, uid and gid 0, no user or group names; a name longer
than ustar's 100 bytes goes in its 155-byte prefix (split at a ``/``), and only a name that
fits neither (or a member of 8 GiB or more) gets a pax header.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._errors import ConfigError
from ._webdataset_index import BLOCK, split_name

KEY = "__key__"
#: Two zero blocks: the end of an archive.
END_OF_ARCHIVE = bytes(2 * BLOCK)
#: webdataset's default encoders of values that are neither bytes nor str, by extension.
NUMBER_FIELDS = frozenset(("cls", "cls2", "class", "count", "index", "inx", "id"))
JSON_FIELDS = frozenset(("json", "jsn"))
NPY_FIELDS = frozenset(("npy",))

Value = bytes | bytearray | memoryview


def padded(length: int) -> int:
    """``length`` rounded up to whole tar blocks."""
    return -(-length // BLOCK) * BLOCK


def member_header(name: str, size: int) -> bytes:
    """The header (one block, or a pax header before it) of a regular member."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o444
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    try:
        return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
    except ValueError:  # too long a name for ustar's name and prefix, or too large a member
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict")


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _where(position: int, key: object) -> str:
    return f"sample {position}" + (f" (key {key!r})" if key is not None else "")


def encode_value(field: str, value: Any) -> Value | None:
    """``value`` as bytes by ``field``'s extension, webdataset's way; None if it has no
    encoder there."""
    if isinstance(value, memoryview) and not value.contiguous:
        return value.tobytes()
    if isinstance(value, bytes | bytearray | memoryview):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    extension = field.rpartition(".")[2].lower()
    if extension in NUMBER_FIELDS:
        if isinstance(value, int | float | np.integer | np.floating) and not isinstance(
            value, bool | np.bool_
        ):
            return str(value).encode("ascii")
    elif extension in JSON_FIELDS:
        return json.dumps(value).encode("utf-8")
    elif extension in NPY_FIELDS and isinstance(value, np.ndarray):
        stream = io.BytesIO()
        np.lib.format.write_array(stream, value)
        return stream.getvalue()
    return None


def sample_members(position: int, sample: object) -> tuple[str, list[tuple[str, Value]]]:
    """The key of the ``position``-th sample and its ``(member name, bytes)`` in the order
    written; a ConfigError naming the sample for anything webdataset would not read back
    as given."""
    if not isinstance(sample, Mapping):
        raise ConfigError(
            f"sample {position}: expected a dict of fields, got {type(sample).__name__}"
        )
    key = sample.get(KEY)
    if KEY not in sample:
        raise ConfigError(f"sample {position}: no {KEY!r}; every sample needs its key")
    if not isinstance(key, str) or not key:
        raise ConfigError(f"{_where(position, key)}: {KEY} must be a non-empty str")
    where = _where(position, key)
    if "\0" in key or not _utf8(key):
        raise ConfigError(f"{where}: a tar member's name holds no NUL and is valid UTF-8")
    members: list[tuple[str, Value]] = []
    seen: dict[str, str] = {}
    for field in sorted(sample, key=str):
        if not isinstance(field, str) or not field:
            raise ConfigError(f"{where}: field names must be non-empty str, got {field!r}")
        if field.startswith("_"):
            continue  # metadata (__key__, __url__): not a member, as webdataset skips it
        if "\0" in field or not _utf8(field):
            raise ConfigError(f"{where}: field {field!r}: a NUL or a character UTF-8 lacks")
        name = f"{key}.{field}"
        if split_name(name) != (key, field.lower()):
            got = split_name(name)
            read = "skipped" if got is None else f"key {got[0]!r}, field {got[1]!r}"
            raise ConfigError(
                f"{where}, field {field!r}: webdataset would read member {name!r} as {read}"
                " (a key's base name holds no dot, a field no '/')"
            )
        lower = field.lower()
        if lower in seen:
            raise ConfigError(
                f"{where}: fields {seen[lower]!r} and {field!r} are one field once read"
                " (webdataset lowercases field names)"
            )
        seen[lower] = field
        value = sample[field]
        try:
            data = encode_value(field, value)
        except (TypeError, ValueError) as exc:  # json.dumps of an object it cannot write
            raise ConfigError(f"{where}, field {field!r}: cannot encode it: {exc}") from exc
        if data is None:
            raise ConfigError(
                f"{where}, field {field!r}: a {type(value).__name__} has no encoder for this"
                " extension; pass bytes or str (numbers go in cls-like fields, JSON values in"
                " json, numpy arrays in npy)"
            )
        members.append((name, data))
    if not members:
        raise ConfigError(f"{where}: no fields to write besides {KEY}")
    return key, members
