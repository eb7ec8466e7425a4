"""``decode=`` and ``sample_transform=``: each sample's binary fields decoded, transformed
and collated into its batch, on a pool of threads.

The stage runs on the engine's decode pool (``asyncbatch-samples``: as many threads as the
cores the process may use, or ``decode_threads=``), after a group's reads and before the
per-batch ``transform=``. A group's samples are cut into a few chunks per thread (not one
task per sample: each hop costs tens of microseconds); each thread decodes and transforms
its chunk sample by sample, then the batches are collated, also in the pool, so neither the
loop nor the consumer's thread touches a pixel. Pillow releases the GIL inside its codecs,
so the threads decode at once on separate cores. The pool (:class:`OrderedPool`) takes the
oldest group's work first: a group's collation never waits behind a later group's decoding,
and later groups decode whenever the earlier ones leave a thread free.

What decodes which field is resolved once, from the source's schema, when the loader is
built: ``"image"`` takes every binary field whose name's last extension is an image type
(``jpg``, ``seg.png``); a dict's key names a field, or the last extension of fields' names
(``"jpg"`` also takes ``"seg.jpg"``; a field named exactly wins), as webdataset's handlers
match. A key that takes no field is a ConfigError.

A field's value in a batch: one tensor ``[B, ...]`` when every sample's value is a tensor of
one shape and dtype; a tensor ``[B]`` (int64, or float64 with any float) when every value is
an int or float; otherwise a Python list with one value per sample. Fields not decoded keep
the format's own column.

A sample whose field fails to decode is a :class:`DecodeError` naming the shard, the sample's
key (``__key__``, else its global index) and the field, delivered after every batch before
its own; with ``on_error="skip"`` the sample
is left out of its batch instead (shorter, its ``global_indexes`` those delivered; an
empty batch keeps its place) and counted. ``sample_transform=`` errors are never skipped.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import io
import itertools
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import Any, Literal, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from ._batch import Batch, FieldSchema, Jagged, Strings
from ._errors import ConfigError, DecodeError, TransformError

#: Names' last extensions that ``decode="image"`` decodes.
IMAGE_EXTENSIONS = frozenset(
    {"jpg", "jpeg", "png", "webp", "ppm", "pgm", "pbm", "pnm", "bmp", "gif", "tif", "tiff"}
)
IMAGE = "image"
INSTALL_HINT = "pip install 'asyncbatch[images]'"
ON_ERROR = ("raise", "skip")

FieldDecoder: TypeAlias = Callable[[bytes], Any]
#: What ``decode=`` accepts: ``"image"``, or field names (or extensions) to ``"image"`` or a
#: callable of the field's bytes.
Decode: TypeAlias = "Literal['image'] | Mapping[str, Literal['image'] | Callable[[bytes], Any]]"
#: What ``sample_transform=`` accepts: one sample's decoded fields in, its fields out.
SampleTransform: TypeAlias = Callable[[dict[str, Any]], Mapping[str, Any]]
OnError: TypeAlias = Literal["raise", "skip"]
KEY, URL = "__key__", "__url__"
#: Chunks of a group per pool thread: a little balance at a few hops per group.
CHUNKS_PER_THREAD = 2


def check_decode(decode: Any) -> Any:
    """``decode`` checked: None, ``"image"`` or a dict of field names to ``"image"`` or
    callables; a ConfigError otherwise, or when an image is asked for without Pillow."""
    if decode is None:
        return None
    if isinstance(decode, str):
        if decode != IMAGE:
            raise ConfigError(f"decode={decode!r}: expected 'image' or a dict of fields")
        image_module()
        return decode
    if not isinstance(decode, Mapping):
        raise ConfigError(f"decode must be 'image' or a dict of fields, got {decode!r}")
    checked: dict[str, Any] = {}
    for name, how in decode.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"decode: field names are non-empty strings, got {name!r}")
        if how == IMAGE:
            image_module()
        elif not callable(how):
            raise ConfigError(
                f"decode[{name!r}]={how!r}: expected 'image' or a callable taking bytes"
            )
        checked[name] = how
    return checked


def check_sample_transform(transform: Any) -> SampleTransform | None:
    if transform is not None and not callable(transform):
        raise ConfigError(
            f"sample_transform must be a callable taking a dict of fields, got {transform!r}"
        )
    return transform  # type: ignore[no-any-return]


def check_on_error(on_error: Any) -> OnError:
    if on_error not in ON_ERROR:
        raise ConfigError(f"on_error={on_error!r}: expected one of {ON_ERROR}")
    return on_error  # type: ignore[no-any-return]


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def image_module() -> Any:
    """``PIL.Image``, or a ConfigError saying how to install it."""
    try:
        from PIL import Image
    except ImportError as exc:
        raise ConfigError(
            f"decode='image' needs Pillow, which is not installed: {INSTALL_HINT}"
        ) from exc
    return Image


def jpeg_module() -> Any:
    """``simplejpeg`` where it is installed (the ``images`` extra), else None."""
    global _simplejpeg
    if _simplejpeg is False:
        try:
            import simplejpeg
        except ImportError:
            simplejpeg = None
        _simplejpeg = simplejpeg
    return _simplejpeg


_simplejpeg: Any = False  # not looked for yet


def decode_image(data: bytes | memoryview) -> torch.Tensor:
    """An image file's bytes as a uint8 tensor ``[3, H, W]``, RGB (grayscale repeated,
    alpha dropped: torchvision's ``ImageReadMode.RGB``); a view of ``[H, W, 3]`` memory.

    A JPEG is decoded by simplejpeg where it is installed: libjpeg-turbo straight into the
    array, the GIL released throughout (Pillow holds it while it copies its pixels out, a
    seventh of the time, which caps two threads at 1.7x one). Its pixels are Pillow's (the
    same library, accurate DCT, smooth upsampling); a CMYK one, or one it cannot decode (a
    corrupt file), goes to Pillow, which decodes it or raises its own error."""
    jpeg = jpeg_module() if data[:3] == b"\xff\xd8\xff" else None
    if jpeg is not None:
        try:
            # YCbCr and gray only: Pillow converts CMYK (Adobe's inverted) its own way.
            if jpeg.decode_jpeg_header(data)[2] in ("YCbCr", "Gray"):
                return torch.from_numpy(jpeg.decode_jpeg(data, "RGB")).permute(2, 0, 1)
        except ValueError:
            pass
    image = image_module().open(io.BytesIO(data))
    image.load()  # the codec's loop, without the GIL
    if image.mode != "RGB":
        image = image.convert("RGB")
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


def _number(kind: Callable[[str], Any], data: bytes) -> Any:
    return kind(data.decode("utf-8"))


def _text(data: bytes) -> str:
    return data.decode("utf-8")


def field_decoder(how: Any) -> FieldDecoder:
    """The function of bytes ``how`` names: ``"image"``; ``int``, ``float`` and ``str`` read
    the bytes as UTF-8 text first (``b"7"`` is 7, not ``"b'7'"``); any other callable as is."""
    if how == IMAGE:
        return decode_image
    if how is int or how is float:
        return functools.partial(_number, how)
    if how is str:
        return _text
    return how  # type: ignore[no-any-return]


def resolve_fields(decode: Any, schema: Mapping[str, FieldSchema]) -> dict[str, FieldDecoder]:
    """Each field ``decode`` takes (see the module docstring) and its decoder; a
    ConfigError for a key that takes none, or a field that holds no bytes."""
    strings = {name for name, s in schema.items() if s.dtype in ("bytes", "str")}
    binary = sorted(name for name in strings if schema[name].dtype == "bytes")
    if decode == IMAGE:
        # Fields named as images, and those the format says are (a Hugging Face Image).
        found: dict[str, FieldDecoder] = {
            n: decode_image
            for n in binary
            if extension(n) in IMAGE_EXTENSIONS or schema[n].media == IMAGE
        }
        if not found:
            raise ConfigError(
                f"decode='image': no field is an image ({', '.join(IMAGE_EXTENSIONS_SHOWN)},"
                f" or a Hugging Face Image column); the binary fields are {binary or 'none'}"
            )
        return found
    fields: dict[str, FieldDecoder] = {}
    for key, how in decode.items():
        names = (
            [key]
            if key in schema
            else [n for n in sorted(schema) if extension(n) == key and n not in decode]
        )
        if not names:
            raise ConfigError(
                f"decode[{key!r}]: no field is named {key!r} or ends in .{key}; the fields"
                f" are {sorted(schema)}"
            )
        for name in names:
            if name not in strings:
                raise ConfigError(
                    f"decode[{key!r}]: field {name!r} holds {schema[name].dtype} values, not"
                    " bytes: only binary and string fields are decoded"
                )
            fields[name] = field_decoder(how)
    return fields


IMAGE_EXTENSIONS_SHOWN = sorted(IMAGE_EXTENSIONS)


def extension(name: str) -> str:
    """A field name's last extension, lower case: ``"seg.PNG"`` → ``"png"``."""
    return name.rsplit(".", 1)[-1].lower()


class Decoding:
    """What a loader decodes and how: the fields and their decoders (resolved from the
    source's schema), the sample transform, what a decode error does, the pool's size, and
    the samples skipped so far."""

    def __init__(
        self,
        decode: Any,
        schema: Mapping[str, FieldSchema],
        *,
        sample_transform: SampleTransform | None = None,
        on_error: OnError = "raise",
        threads: int | None = None,
        shard_urls: Sequence[str] = (),
        shard_samples: Sequence[int] | None = None,
    ) -> None:
        self.fields = resolve_fields(decode, schema)
        self.sample_transform = sample_transform
        self.skip = on_error == "skip"
        self.threads = threads or usable_cores()
        self.schema = dict(schema)
        #: The shards, and where each one's samples end (global ids), to name a sample's
        #: shard in an error when the samples carry no ``__url__`` (None: not known).
        self.shard_urls = list(shard_urls)
        self.shard_ends = None if shard_samples is None else np.cumsum(shard_samples)
        #: Samples left out of their batches by ``on_error="skip"`` (batches read ahead too).
        self.skipped = 0

    def decode_rows(
        self, fields: Mapping[str, Any], ids: npt.NDArray[np.int64], start: int, stop: int
    ) -> list[dict[str, Any] | None | Exception]:
        """Samples ``start`` to ``stop`` of a group, decoded and transformed (None: skipped);
        in a pool thread. A sample that fails (and is not skipped) ends the list as its
        error: the samples before it still reach their batches."""
        columns = [(name, decode, *_raw(fields[name])) for name, decode in self.fields.items()]
        out: list[dict[str, Any] | None | Exception] = []
        transform = self.sample_transform
        for i in range(start, stop):
            sample: dict[str, Any] = {}
            for name, decode, data, offsets in columns:
                view = data[offsets[i] : offsets[i + 1]]
                # decode_image reads the view in place; other decoders are given bytes.
                raw: bytes | memoryview = view if decode is decode_image else bytes(view)
                try:
                    sample[name] = decode(raw)  # type: ignore[arg-type]
                except Exception as exc:  # noqa: BLE001 - any decoder's error, named
                    if not self.skip:
                        error = self._error(fields, ids, i, name, exc)
                        error.__cause__ = exc
                        out.append(error)
                        return out
                    sample = {}
                    break
            else:
                if transform is not None:
                    try:
                        sample = self._transform(transform, sample, fields, ids, i)
                    except TransformError as error:
                        out.append(error)
                        return out
                out.append(sample)
                continue
            out.append(None)
        return out

    def _transform(
        self,
        transform: SampleTransform,
        sample: dict[str, Any],
        fields: Mapping[str, Any],
        ids: npt.NDArray[np.int64],
        i: int,
    ) -> dict[str, Any]:
        try:
            result = transform(sample)
            if not isinstance(result, Mapping):
                raise TypeError(f"it returned {type(result).__name__}, not a dict of fields")
            return dict(result)
        except BaseException as exc:  # noqa: BLE001 - the user's code: an error, never a hang
            shard, _, named = self._where(fields, ids, i)
            error = TransformError(
                f"sample_transform failed on sample {named} of {shard}: {type(exc).__name__}: {exc}"
            )
            raise error from exc

    def _where(
        self, fields: Mapping[str, Any], ids: npt.NDArray[np.int64], i: int
    ) -> tuple[str, str | int, str]:
        """Sample ``i``'s shard, key (its ``__key__``, else its global index) and the key
        as a message names it."""
        urls, keys = fields.get(URL), fields.get(KEY)
        shard = str(urls[i]) if isinstance(urls, Strings) else self._shard(int(ids[i]))
        if isinstance(keys, Strings):
            key = str(keys[i])
            return shard, key, repr(key)
        return shard, int(ids[i]), f"#{int(ids[i])} (global index)"

    def _shard(self, sample: int) -> str:
        urls, ends = self.shard_urls, self.shard_ends
        if ends is not None:
            return urls[int(np.searchsorted(ends, sample, side="right"))]
        return urls[0] if len(urls) == 1 else f"one of {len(urls)} shards ({urls[0]}, ...)"

    def _error(
        self,
        fields: Mapping[str, Any],
        ids: npt.NDArray[np.int64],
        i: int,
        name: str,
        exc: Exception,
    ) -> DecodeError:
        shard, key, named = self._where(fields, ids, i)
        return DecodeError(
            f"{shard}: sample {named}, field {name!r} does not decode:"
            f" {type(exc).__name__}: {exc} (on_error='skip' leaves such samples out)",
            url=shard,
            key=key,
            field=name,
        )

    def collate(
        self,
        fields: Mapping[str, Any],
        samples: Sequence[dict[str, Any] | None],
        ids: npt.NDArray[np.int64],
        start: int,
        stop: int,
    ) -> tuple[npt.NDArray[np.int64], dict[str, Any], dict[str, FieldSchema], int]:
        """Batch ``[start, stop)`` of the group: its delivered ids, fields, schema, bytes."""
        kept = [i for i in range(start, stop) if samples[i] is not None]
        whole = len(kept) == stop - start
        out: dict[str, Any] = {}
        schema: dict[str, FieldSchema] = {}
        rows = np.asarray(kept, dtype=np.int64)
        for name, value in fields.items():
            if name in self.fields:
                continue
            out[name] = value[start:stop] if whole else take_rows(value, rows)
            schema[name] = self.schema[name]
        decoded = [sample for i in kept if (sample := samples[i]) is not None]
        names = list(decoded[0]) if decoded else [n for n in self.fields]
        for name in names:
            try:
                values = [sample[name] for sample in decoded]
            except KeyError as exc:
                raise TransformError(
                    f"sample_transform returned field {name!r} for some samples of a batch"
                    " and not for others: every sample needs the same fields"
                ) from exc
            out[name], schema[name] = collate_values(values)
        nbytes = sum(value_bytes(v) for v in out.values())
        return ids[start:stop] if whole else ids[rows], out, schema, nbytes


def _raw(column: Any) -> tuple[memoryview, list[int]]:
    """A Strings column's bytes and offsets, for slicing in a thread."""
    if not isinstance(column, Strings):
        raise TypeError(f"a decoded field must be bytes, got {type(column).__name__}")
    data = column.data.numpy()
    return memoryview(data), column.offsets.tolist()  # type: ignore[arg-type]


def collate_values(values: list[Any]) -> tuple[Any, FieldSchema]:
    """One field's values of a batch's samples, as the module docstring says."""
    first = values[0] if values else None
    arrays = isinstance(first, np.ndarray) and first.dtype != object
    if arrays and all(isinstance(v, np.ndarray) for v in values):
        values = [torch.from_numpy(np.ascontiguousarray(v)) for v in values]
        first = values[0]
    if isinstance(first, torch.Tensor) and all(
        isinstance(v, torch.Tensor) and v.shape == first.shape and v.dtype == first.dtype
        for v in values
    ):
        stacked = torch.stack(values)
        return stacked, FieldSchema(_dtype_name(stacked.dtype), tuple(first.shape))
    if values and all(type(v) is int for v in values):
        return torch.tensor(values, dtype=torch.int64), FieldSchema("int64", ())
    if values and all(type(v) in (int, float) for v in values):
        return torch.tensor(values, dtype=torch.float64), FieldSchema("float64", ())
    dtype = _dtype_name(first.dtype) if isinstance(first, torch.Tensor) else "object"
    return list(values), FieldSchema(dtype, (-1,), tensor=False)


def take_rows(value: Any, rows: npt.NDArray[np.int64]) -> Any:
    """The samples ``rows`` of a column (sorted, within it)."""
    if isinstance(value, torch.Tensor):
        return value[torch.from_numpy(rows)]
    if isinstance(value, np.ndarray):
        return value[rows]
    if isinstance(value, Strings | Jagged):
        pieces = [value[int(i) : int(i) + 1] for i in rows]
        inner = [p.data if isinstance(p, Strings) else p.values for p in pieces]
        lengths = [len(x) for x in inner]
        offsets = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int64)
        whole = value.data if isinstance(value, Strings) else value.values
        if isinstance(whole, torch.Tensor):
            joined: Any = torch.cat(inner) if inner else whole[:0]
        else:
            joined = np.concatenate(inner) if inner else whole[:0]
        if isinstance(value, Strings):
            return Strings(joined, offsets, value.binary)
        return Jagged(joined, offsets)
    return [value[int(i)] for i in rows]


def value_bytes(value: Any) -> int:
    """Bytes a batch's field holds (a list: its tensors' and arrays')."""
    if isinstance(value, list):
        return sum(int(getattr(v, "nbytes", 0)) for v in value)
    if isinstance(value, Strings):
        return int(value.data.nbytes + value.offsets.nbytes)
    if isinstance(value, Jagged):
        return int(getattr(value.values, "nbytes", 0)) + int(value.offsets.nbytes)
    return int(getattr(value, "nbytes", 0))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


#: A pool's waiting call: its rank, its place in submission order, its future and itself.
_Work: TypeAlias = tuple[tuple[int, ...], int, "Future[Any]", Callable[[], Any]]


class OrderedPool(Executor):
    """``threads`` threads that run the work of the lowest rank first (ties: in submission
    order): the decode pool, ranked by batch, so the batch due next is done first and the
    threads are never idle while any group waits to be decoded or collated."""

    def __init__(self, threads: int, name: str = "asyncbatch-samples") -> None:
        self._size, self._name = max(1, threads), name
        self._work: list[_Work] = []
        self._ready = threading.Condition()
        self._order = itertools.count()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for work
        self._shutdown = False

    def submit_ranked(
        self, rank: tuple[int, ...], fn: Callable[..., Any], /, *args: Any
    ) -> Future[Any]:
        """Run ``fn(*args)`` before every waiting call of a higher ``rank``."""
        future: Future[Any] = Future()
        with self._ready:
            if self._shutdown:
                raise RuntimeError("cannot schedule new work after shutdown")
            work: _Work = (rank, next(self._order), future, functools.partial(fn, *args))
            heapq.heappush(self._work, work)
            if not self._idle and len(self._threads) < self._size:
                # Daemon threads: loaders close their pools as interpreter shutdown begins
                # (asyncbatch._lifecycle); an idle thread left behind holds nothing.
                thread = threading.Thread(
                    target=self._run, name=f"{self._name}_{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            self._ready.notify()
        return future

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """:class:`~concurrent.futures.Executor`'s: after every ranked call waiting."""
        return self.submit_ranked((2**62,), functools.partial(fn, *args, **kwargs))

    def _run(self) -> None:
        while True:
            with self._ready:
                self._idle += 1
                while not self._work and not self._shutdown:
                    self._ready.wait()
                self._idle -= 1
                if not self._work:  # shut down, nothing left
                    return
                _, _, future, work = heapq.heappop(self._work)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = work()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, work

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work; the threads end once the waiting work is done (``cancel_futures``:
        cancelled instead); ``wait``: join them."""
        with self._ready:
            self._shutdown = True
            if cancel_futures:
                for _, _, future, _ in self._work:
                    future.cancel()
                self._work.clear()
            self._ready.notify_all()
        if wait:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()


def _chunks(count: int, parts: int) -> list[tuple[int, int]]:
    """``[0, count)`` cut into at most ``parts`` near-equal consecutive ranges."""
    parts = max(1, min(parts, count))
    cuts = [count * k // parts for k in range(parts + 1)]
    return [(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]


async def decode_group(
    decoding: Decoding,
    pool: Executor,
    fields: Mapping[str, Any],
    ids: npt.NDArray[np.int64],
    lengths: Sequence[int],
    batches: Sequence[int],
    epoch: int,
) -> tuple[list[Batch], list[int], Exception | None]:
    """A group's batches (``lengths`` samples each) with their samples decoded,
    transformed and collated in ``pool``, and each batch's bytes; never blocks the loop.
    A sample that fails cuts the group short: the batches before its own, and its error."""
    loop = asyncio.get_running_loop()
    rank = (epoch, batches[0]) if batches else (epoch,)

    def run(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        if isinstance(pool, OrderedPool):
            return asyncio.wrap_future(pool.submit_ranked(rank, fn, *args), loop=loop)
        return loop.run_in_executor(pool, fn, *args)

    work = _chunks(len(ids), decoding.threads * CHUNKS_PER_THREAD)
    decoded: list[list[dict[str, Any] | None | Exception]] = await asyncio.gather(
        *(run(decoding.decode_rows, fields, ids, a, b) for a, b in work)
    )
    samples: list[dict[str, Any] | None] = []
    error: Exception | None = None
    for part in decoded:
        if part and isinstance(part[-1], Exception):
            error = part[-1]
            samples.extend(part[:-1])  # type: ignore[arg-type]
            break
        samples.extend(part)  # type: ignore[arg-type]
    cuts = np.cumsum([0, *lengths]).tolist()
    spans = list(zip(cuts[:-1], cuts[1:], strict=True))
    if error is not None:  # only the batches wholly before the failed sample
        spans = spans[: int(np.searchsorted(cuts, len(samples), side="right")) - 1]
    parts = _chunks(len(spans), decoding.threads)

    def collate(a: int, b: int) -> list[tuple[Any, ...]]:
        return [decoding.collate(fields, samples, ids, *span) for span in spans[a:b]]

    collated = await asyncio.gather(*(run(collate, a, b) for a, b in parts))
    skipped = sum(1 for sample in samples[: cuts[len(spans)]] if sample is None)
    decoding.skipped += skipped
    group: list[Batch] = []
    sizes: list[int] = []
    made = [batch for part in collated for batch in part]
    for number, (batch_ids, out, schema, nbytes) in zip(batches, made, strict=False):
        group.append(Batch(batch_ids, out, schema, {"epoch": epoch, "batch": number}))
        sizes.append(nbytes)
    return group, sizes, error
