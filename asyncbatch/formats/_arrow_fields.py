"""Which batch fields the columns of an Arrow schema give, struct columns flattened.

A column of numbers, lists of numbers, strings or binary is one field of its own name. A
struct column gives one field per leaf, named by its dotted path (``meta.score``,
``meta.pos.x``): nested structs recurse. A *media* struct, exactly a binary ``bytes`` and a
string ``path`` (how Hugging Face's ``Image``, ``Audio``, ``Video`` and ``Pdf`` features store
a sample, recognised by its shape, with or without the ``huggingface`` schema metadata), is
one field of the struct's name holding the bytes (``image``); ``image.path`` is a field only
when ``columns=`` names it, and its nulls (no path, as most embedded images have) read as
empty strings whatever ``nulls=``. ``columns=`` may name a column (a struct: all its fields)
or any struct's child by its dotted path; a child so named is read as it is: ``image.bytes``
is the plain binary child, whose nulls are nulls.

A media field's row whose bytes are null while the struct is not (an image stored by path
only) cannot be read: asyncbatch reads the bytes in the files, not the files a path names.
The source reads that row's path and raises :func:`stored_by_path`'s FormatError.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import ConfigError, FormatError
from .._schema import FieldSchema

#: The children of a media struct, in order.
MEDIA = ("bytes", "path")


@dataclass(frozen=True)
class Field:
    """One batch field: its name, the top-level column it is in, the child names down to
    its leaf (``()`` for a column that is not a struct), the leaf's Arrow type, whether it
    is a media struct's bytes read under the struct's name, and whether its nulls read as
    empty whatever ``nulls=`` (a media struct's path)."""

    name: str
    column: str
    path: tuple[str, ...]
    kind: Any
    media: bool = False
    optional: bool = False

    @property
    def dotted(self) -> str:
        """The leaf's dotted path (how Parquet names its column chunks' prefix)."""
        return ".".join((self.column, *self.path))


def is_media(kind: Any, pa: Any) -> bool:
    """Whether Arrow type ``kind`` is a struct of a binary ``bytes`` and a string ``path``."""
    t = pa.types
    if not t.is_struct(kind) or kind.num_fields != 2:
        return False
    data, path = kind.field(0), kind.field(1)
    return (
        (data.name, path.name) == MEDIA
        and (t.is_binary(data.type) or t.is_large_binary(data.type))
        and (t.is_string(path.type) or t.is_large_string(path.type))
    )


def _expand(
    name: str,
    column: str,
    path: tuple[str, ...],
    kind: Any,
    pa: Any,
    out: list[Field],
    parent: Any = None,
) -> None:
    if is_media(kind, pa):
        out.append(Field(name, column, (*path, MEDIA[0]), kind.field(0).type, media=True))
    elif pa.types.is_struct(kind) and kind.num_fields:
        for child in kind:
            _expand(f"{name}.{child.name}", column, (*path, child.name), child.type, pa, out, kind)
    else:
        optional = parent is not None and is_media(parent, pa) and path[-1] == MEDIA[1]
        out.append(Field(name, column, path, kind, optional=optional))


def fields_of(schema: Any, names: Sequence[str], pa: Any) -> list[Field]:
    """The fields of columns or dotted struct children ``names`` of ``schema``, in order; a
    name that is neither, or a field named twice, is a ConfigError."""
    out: list[Field] = []
    for name in names:
        if name in schema.names:
            _expand(name, name, (), schema.field(name).type, pa, out)
            continue
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            column = ".".join(parts[:cut])
            if column in schema.names:
                kind, path = schema.field(column).type, tuple(parts[cut:])
                parent = None
                for child in path:
                    at = kind.get_field_index(child) if pa.types.is_struct(kind) else -1
                    if at < 0:
                        break
                    parent, kind = kind, kind.field(at).type
                else:
                    _expand(name, column, path, kind, pa, out, parent)
                    break
        else:
            raise ConfigError(
                f"options columns={list(names)!r}: {name!r} is neither a column nor a struct's"
                f" child (dotted); the files hold {available(schema, pa)}"
            )
    seen: set[str] = set()
    for field in out:
        if field.name in seen:
            raise ConfigError(f"options columns={list(names)!r} name field {field.name!r} twice")
        seen.add(field.name)
    return out


def available(schema: Any, pa: Any) -> list[str]:
    """The columns, then every struct child by its dotted path."""
    children: list[str] = []

    def walk(name: str, kind: Any) -> None:
        if pa.types.is_struct(kind):
            for child in kind:
                children.append(f"{name}.{child.name}")
                walk(f"{name}.{child.name}", child.type)

    for field in schema:
        walk(field.name, field.type)
    return [*schema.names, *children]


def field_array(column: Any, field: Field) -> Any:
    """Field ``field`` of a column's array: a struct's child taken with every enclosing
    struct's nulls; for a media field the media struct itself (the bytes are taken by
    :func:`media_bytes` once its rows are in order), whose nulls are the field's nulls."""
    array = column
    for child in field.path[:-1] if field.media else field.path:
        array = array.flatten()[array.type.get_field_index(child)]
    return array


def media_bytes(struct: Any) -> tuple[Any, npt.NDArray[np.bool_] | None]:
    """The bytes of a media struct's array (null where the struct is), and the rows whose
    bytes are null while the struct is not (None when there are none)."""
    data = struct.flatten()[0]
    if data.null_count == struct.null_count:
        return data, None
    bad = struct.is_valid().to_numpy(zero_copy_only=False) & data.is_null().to_numpy(
        zero_copy_only=False
    )
    return data, bad if bad.any() else None


@dataclass(frozen=True)
class StoredByPath:
    """What a decode returns instead of fields when rows ``ids`` (global) of media field
    ``field`` hold no bytes: the source reads their paths, then raises."""

    field: Field
    ids: npt.NDArray[np.int64]


def path_name(field: Field) -> str:
    """The dotted name of a media field's ``path`` child."""
    return ".".join((field.column, *field.path[:-1], MEDIA[1]))


def stored_by_path(url: str, row: int, field: Field, path: str, more: int) -> FormatError:
    """The error of a media row without bytes (``path`` its path, ``more`` such rows besides
    it in the batch)."""
    others = f" (and {more} more rows of the batch)" if more else ""
    return FormatError(
        f"{url}: row {row}, column {field.name!r} holds no bytes, only the path {path!r}"
        f"{others}: asyncbatch reads the bytes stored in the files, not the files a path names;"
        " write them embedded (datasets' save_to_disk and push_to_hub embed them,"
        " Dataset.to_parquet does not),"
        f" or read them as they are with options={{'columns': ['{field.dotted}',"
        f" '{path_name(field)}'], 'nulls': 'fill'}}"
    )


def with_media(
    schema: Mapping[str, FieldSchema], fields: Sequence[Field], arrow_schema: Any
) -> dict[str, FieldSchema]:
    """``schema`` with each media field's :attr:`FieldSchema.media`: its Hugging Face feature's
    type, lowercased (``"image"``, ``"audio"``), as the Arrow schema's ``huggingface``
    metadata says; fields it says nothing of keep ``""``."""
    out = dict(schema)
    features: Any = {}
    raw = (arrow_schema.metadata or {}).get(b"huggingface")
    if raw:
        try:
            features = json.loads(raw).get("info", {}).get("features", {})
        except (ValueError, AttributeError):
            features = {}  # metadata of another writer: the fields stay plain bytes
    for field in fields:
        if not field.media:
            continue
        node = features.get(field.column) if isinstance(features, dict) else None
        for child in field.path[:-1]:  # down to the media struct (its ``bytes`` excluded)
            node = node.get(child) if isinstance(node, dict) else None
        kind = node.get("_type") if isinstance(node, dict) else None
        if isinstance(kind, str) and field.name in out:
            out[field.name] = replace(out[field.name], media=kind.lower())
    return out
