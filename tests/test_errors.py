"""Every error pickles with its message and every attribute (multiprocessing, spawn)."""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from servers import RangeHTTPServer

import asyncbatch as ab
from asyncbatch import _errors as errors
from asyncbatch._workers import keep_batch

ERRORS = [
    cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, errors.AsyncBatchError)
]
STORE_ERRORS = [cls for cls in ERRORS if issubclass(cls, errors.StoreError)]


@pytest.mark.parametrize("cls", STORE_ERRORS, ids=lambda c: c.__name__)
def test_store_errors_pickle_with_every_attribute(cls: type[errors.StoreError]) -> None:
    error = cls("read failed: s3://b/k bytes [0, 10)", "s3://b/k", 0, 10)
    # What the stores and the retry policy attach after construction.
    error.attempts = ["HTTP 503 SlowDown", "HTTP 500"]  # type: ignore[attr-defined]
    error.detail = "HTTP 503 SlowDown"  # type: ignore[attr-defined]
    error.retryable = True  # type: ignore[attr-defined]
    if isinstance(error, errors.ThrottledError):
        error.retry_after = 2.5
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert str(copy) == str(error)
    assert (copy.url, copy.start, copy.end) == ("s3://b/k", 0, 10)
    assert vars(copy) == vars(error)
    assert getattr(copy, "retry_after", None) == (2.5 if cls is errors.ThrottledError else None)
    assert isinstance(copy, OSError | ab.AsyncBatchError)


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_every_error_pickles_with_its_message_and_attributes(
    cls: type[errors.AsyncBatchError],
) -> None:
    error = cls("bad value: s3://b/k")
    error.note = 3  # type: ignore[attr-defined]
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is cls
    assert str(copy) == "bad value: s3://b/k"
    assert vars(copy) == vars(error)


def test_builtin_bases_let_callers_catch_by_kind() -> None:
    assert issubclass(ab.NotFoundError, FileNotFoundError)
    assert issubclass(ab.PermissionDeniedError, PermissionError)
    assert issubclass(ab.CredentialsError, PermissionError)
    assert issubclass(ab.EndpointError, ConnectionError)
    assert issubclass(ab.StoreTimeoutError, TimeoutError)
    assert issubclass(ab.ShortReadError, EOFError)
    assert issubclass(ab.ConfigError, ValueError)
    assert issubclass(ab.FormatError, ValueError)
    assert {errors.CredentialsError, errors.EndpointError} <= set(STORE_ERRORS)
    assert len(STORE_ERRORS) >= 10


# torchdata 0.11 calls torch.set_vital on import, which torch 2.13 deprecates.
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("stateful", [False, True], ids=["DataLoader", "StatefulDataLoader"])
def test_a_worker_error_reaches_the_consumer_with_its_attributes(
    http_root: tuple[Path, RangeHTTPServer], tokens: npt.NDArray[np.uint16], stateful: bool
) -> None:
    root, server = http_root
    name = f"broken-in-workers-{stateful}"
    written = ab.write_tokens(str(root / name), tokens, shard_size=4096)
    last = written.manifest.shards[-1]
    (root / name / last.path).write_bytes(b"\0" * 100)  # truncated after writing
    url = f"{server.url}/{name}"
    source = ab.LoaderDataset(url, batch_size=4, seq_len=64, shuffle=False, verify="off")
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader

        batches: Iterable[ab.Batch] = StatefulDataLoader(
            source, batch_size=None, collate_fn=keep_batch, num_workers=2, timeout=60
        )
    else:
        batches = source.dataloader(num_workers=2, timeout=60)
    taken = 0
    iterator = iter(batches)
    try:
        with pytest.raises(ab.ShortReadError) as caught:
            for _ in iterator:
                taken += 1
    finally:
        # Now: the traceback keeps the iterator alive, and the garbage collector would stop
        # its workers later, during another test, taking seconds there.
        iterator._shutdown_workers()  # type: ignore[attr-defined]
    assert taken > 0  # the epoch broke midway, at the last shard
    error = caught.value
    assert error.url == f"{url}/{last.path}"
    assert error.start is not None and error.end is not None
    assert error.end > 100  # past the end of what is left of the shard
    assert f"bytes [{error.start}, {error.end})" in str(error)
    assert "DataLoader worker process" in error.__notes__[-1]


def test_a_sync_calls_error_is_not_chained_to_the_loop_lookup(tmp_path: Path) -> None:
    with pytest.raises(errors.NotFoundError) as caught:
        ab.open_dataset(str(tmp_path / "missing"))
    chain: list[BaseException] = []
    todo: list[BaseException | None] = [caught.value]
    while todo:
        exc = todo.pop()
        if exc is not None and exc not in chain:
            chain.append(exc)
            todo += [exc.__cause__, exc.__context__]
    assert not any("no running event loop" in str(e) for e in chain), chain
