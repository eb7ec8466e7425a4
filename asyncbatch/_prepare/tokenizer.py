"""Tokenizers for ``prepare``: a ``tokenizer.json`` path or URL, a ``tokenizers.Tokenizer``, a
``tiktoken.Encoding`` or any callable ``list[str] -> list[list[int]]``.

The driver turns what the user gave into a :class:`TokenizerSpec` (small, picklable, with a
fingerprint for the units' done records); each worker process loads it once
(:func:`encoder`) and keeps it for every unit it runs.
"""

from __future__ import annotations

import dataclasses
import marshal
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._checksums import digest, format_digest
from .._errors import ConfigError
from .inputs import filesystem

Encode = Callable[[list[str]], Sequence[Sequence[int]]]


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """``kind`` is ``"hf"`` (``payload``: the tokenizer's JSON), ``"tiktoken"`` (the
    ``Encoding``), ``"callable"`` or ``"none"`` (ids read from ``token_field``)."""

    kind: str
    payload: Any
    fingerprint: str
    vocab_size: int | None


def make_spec(tokenizer: Any, vocab_size: int | None, options: Mapping[str, Any]) -> TokenizerSpec:
    """The spec of what the user passed as ``tokenizer=``."""
    if tokenizer is None:
        return TokenizerSpec("none", None, "none", vocab_size)
    if isinstance(tokenizer, os.PathLike | str):
        text = _read_text(os.fspath(tokenizer), options)
        try:
            from tokenizers import Tokenizer

            loaded = Tokenizer.from_str(text)
        except ImportError as exc:
            raise ConfigError(
                "a tokenizer.json needs Hugging Face tokenizers: pip install tokenizers"
            ) from exc
        except Exception as exc:  # noqa: BLE001 - the Rust parser's errors
            raise ConfigError(f"{tokenizer}: not a tokenizers tokenizer.json: {exc}") from exc
        size = vocab_size or loaded.get_vocab_size(with_added_tokens=True)
        fingerprint = f"hf:{format_digest(digest(text.encode()))}"
        _LOADED.clear()  # kept: the driver runs units too while its workers start
        _LOADED[fingerprint] = loaded
        return TokenizerSpec("hf", text, fingerprint, size)
    kind = f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}"
    if kind.startswith("tokenizers.") and hasattr(tokenizer, "to_str"):
        text = tokenizer.to_str()
        size = vocab_size or tokenizer.get_vocab_size(with_added_tokens=True)
        return TokenizerSpec("hf", text, f"hf:{format_digest(digest(text.encode()))}", size)
    if kind.startswith("tiktoken.") and hasattr(tokenizer, "encode_ordinary_batch"):
        name = getattr(tokenizer, "name", "?")
        ident = f"{name}:{tokenizer.n_vocab}:{getattr(tokenizer, '_pat_str', '')}"
        size = vocab_size or int(tokenizer.n_vocab)
        return TokenizerSpec("tiktoken", tokenizer, f"tiktoken:{ident}", size)
    if callable(tokenizer):
        return TokenizerSpec("callable", tokenizer, _callable_fingerprint(tokenizer), vocab_size)
    raise ConfigError(
        f"tokenizer must be a tokenizer.json path or URL, a tokenizers.Tokenizer, a"
        f" tiktoken.Encoding or a callable list[str] -> list[list[int]], got {kind}"
    )


def _callable_fingerprint(function: Any) -> str:
    """A callable's name, with its code, defaults and closure values for a function (or its
    pickled state for another callable): an edited function redoes the units it made. What
    the function calls is not covered."""
    name = getattr(function, "__qualname__", type(function).__qualname__)
    module = getattr(function, "__module__", "?")
    code = getattr(function, "__code__", None)
    if code is not None:
        values = [cell.cell_contents for cell in (function.__closure__ or ())]
        values += list(function.__defaults__ or ())
        body = marshal.dumps(code) + b"".join(map(_state, values))
    else:
        body = _state(function)
    return f"callable:{module}.{name}:{format_digest(digest(body))}"


def _state(value: Any) -> bytes:
    """``value`` pickled (a repr could hold a memory address), or its type's name."""
    try:
        return pickle.dumps(value)
    except Exception:  # noqa: BLE001 - unpicklable: its type alone
        return type(value).__qualname__.encode()


def _read_text(url: str, options: Mapping[str, Any]) -> str:
    fs, path = filesystem(url, options)
    try:
        with fs.open(path, "rb") as handle:
            raw: bytes = handle.read()
    except FileNotFoundError as exc:
        raise ConfigError(f"tokenizer file not found: {url}") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read the tokenizer file {url}: {exc}") from exc
    return raw.decode("utf-8")


def special_ids(spec: TokenizerSpec, value: Any, name: str) -> tuple[int, ...]:
    """``bos=`` / ``eos=`` as token ids: ``None``, an id, a token string, or a list of them."""
    if value is None:
        return ()
    items = value if isinstance(value, list | tuple) else [value]
    ids: list[int] = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            token = item
        elif isinstance(item, str):
            token = _token_id(spec, item, name)
        else:
            raise ConfigError(f"{name} must be a token id or token string, got {item!r}")
        limit = spec.vocab_size if spec.vocab_size is not None else 2**32
        if not 0 <= token < limit:
            raise ConfigError(f"{name}={item!r} is id {token}, outside the vocabulary [0, {limit})")
        ids.append(token)
    return tuple(ids)


def _token_id(spec: TokenizerSpec, token: str, name: str) -> int:
    found: int | None = None
    if spec.kind == "hf":
        found = load(spec).token_to_id(token)
    elif spec.kind == "tiktoken":
        try:
            found = int(spec.payload.encode_single_token(token))
        except KeyError:
            found = None
    else:
        raise ConfigError(f"{name}={token!r}: a token string needs a tokenizer; give its id")
    if found is None:
        raise ConfigError(f"{name}={token!r} is not a token of the tokenizer")
    return int(found)


def output_dtype(spec: TokenizerSpec) -> np.dtype[Any]:
    """uint16 when every id fits (a vocabulary of at most 65,536), else uint32."""
    if spec.vocab_size is not None and spec.vocab_size <= 2**16:
        return np.dtype("<u2")
    return np.dtype("<u4")


_LOADED: dict[str, Any] = {}


def load(spec: TokenizerSpec) -> Any:
    """The tokenizer object of ``spec``, loaded once per process (a tokenizer.json's; other
    kinds travel as objects)."""
    if spec.kind != "hf":
        return spec.payload
    loaded = _LOADED.get(spec.fingerprint)
    if loaded is None:
        from tokenizers import Tokenizer

        loaded = Tokenizer.from_str(spec.payload)
        _LOADED.clear()  # one tokenizer per process at a time
        _LOADED[spec.fingerprint] = loaded
    return loaded


def encoder(spec: TokenizerSpec) -> Encode:
    """``texts -> ids`` as ``tokenizer.encode(text)`` gives them (tiktoken: ``encode_ordinary``)
    for each text, on the calling thread alone: a worker is one core."""
    tokenizer = load(spec)
    if spec.kind == "hf":
        batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)

        def encode_hf(texts: list[str]) -> list[list[int]]:
            return [encoding.ids for encoding in batch(texts)]

        return encode_hf
    if spec.kind == "tiktoken":

        def encode_tiktoken(texts: list[str]) -> Sequence[Sequence[int]]:
            return tokenizer.encode_ordinary_batch(texts, num_threads=1)  # type: ignore[no-any-return]

        return encode_tiktoken
    if spec.kind == "callable":
        return tokenizer  # type: ignore[no-any-return]
    raise ConfigError("no tokenizer: give tokenizer= or token_field=")
