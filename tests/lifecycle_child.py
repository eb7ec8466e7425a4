"""Scenarios run in a subprocess by tests/test_lifecycle.py (and child-process targets).

``python tests/lifecycle_child.py SCENARIO JSON`` runs one scenario with the JSON arguments
and prints one JSON line of results on stdout; the test reads it, and checks stderr.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import importlib
import json
import os
import re
import resource
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from servers import RangeHandler, RangeHTTPServer  # noqa: E402

import asyncbatch as ab  # noqa: E402
from asyncbatch.stores import ObjectInfo  # noqa: E402
from asyncbatch.stores._local import LocalStore  # noqa: E402


def asyncbatch_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("asyncbatch"))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) - 1  # the descriptor listdir itself holds


def rss_bytes() -> int:
    with open("/proc/self/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def ids_of(batches: Any, limit: int | None = None) -> list[int]:
    out: list[int] = []
    for step, batch in enumerate(batches):
        out += batch.global_indexes.tolist()
        if limit is not None and step + 1 == limit:
            break
    return out


# -- stores that never answer ---------------------------------------------------------------


class StalledStore(LocalStore):
    """Local files whose data reads never finish while ``StalledStore.stall`` is set."""

    stall = True

    async def size(self, url: str) -> int:
        return await super().size(url.removeprefix("stalled://"))

    async def stat(self, url: str) -> ObjectInfo:
        return await super().stat(url.removeprefix("stalled://"))

    async def read_into(self, urls: list[str], *args: Any) -> None:
        if StalledStore.stall:
            await asyncio.sleep(3600)
        await super().read_into([url.removeprefix("stalled://") for url in urls], *args)

    async def read_windows(self, urls: list[str], *args: Any) -> bool:
        if StalledStore.stall:
            await asyncio.sleep(3600)
        return await super().read_windows([url.removeprefix("stalled://") for url in urls], *args)


def stalled_store(scheme: str, options: Any, *, max_inflight: int) -> StalledStore:
    return StalledStore()


class StalledHandler(RangeHandler):
    """Serves the manifest; data requests get headers, then nothing."""

    def do_GET(self) -> None:
        if self.path.endswith(".bin") or self.server.stall_everything:  # type: ignore[attr-defined]
            path = self._file()
            if path is None:
                return
            size = path.stat().st_size
            match = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
            start, end = (0, size) if match is None else (int(match[1]), int(match[2]) + 1)
            self.send_response(206 if match else 200)
            if match:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            time.sleep(3600)  # headers sent, the body never comes
            return
        super().do_GET()


@contextlib.contextmanager
def stalled_http(root: Path, everything: bool = False) -> Iterator[str]:
    server = RangeHTTPServer(root)
    server.RequestHandlerClass = StalledHandler
    server.stall_everything = everything  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, name="stalled-http", daemon=True)
    thread.start()
    yield server.url


# -- scenarios ------------------------------------------------------------------------------


def sigint(args: dict[str, Any]) -> dict[str, Any]:
    """Block in next() (or in a Loader's opening of its URL) on a store that never
    answers; the parent sends SIGINT."""
    # A shell starts background jobs with SIGINT ignored, and Python then installs no handler
    # of its own: Ctrl-C's handler, as in any terminal, whoever started the test run.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    path = args["path"]
    if args["kind"] == "open":
        return open_in_a_running_loop(path)
    # The loader's modules (torch too: opening a dataset no longer loads it) before "ready",
    # so the signal finds next() waiting on the store, not the Loader still importing.
    importlib.import_module("asyncbatch._loader")
    if args["kind"] == "store":
        ab.register_store("stalled", stalled_store)
        local = ab.open_dataset(path)
        dataset = ab.Dataset("stalled://" + path, local.manifest)
        url_or_dataset: Any = dataset
        context: Any = contextlib.nullcontext()
    else:  # "loader_open": the manifest never comes either, the Loader waits in its opening
        context = stalled_http(Path(path).parent, everything=args["kind"] == "loader_open")
        url_or_dataset = None
    with context as server:
        if url_or_dataset is None:
            url_or_dataset = f"{server}/{Path(path).name}"
        try:
            print("ready", flush=True)
            loader = ab.Loader(url_or_dataset, batch_size=4, seq_len=16)
            next(iter(loader))
        except KeyboardInterrupt:
            at = time.monotonic()  # the system-wide clock: the parent compares it with its own
            report = {"at": at, "threads": asyncbatch_threads()}
            if args["kind"] == "store":  # the store answers now: the loader goes on
                StalledStore.stall = False
                report["resumed"] = next(iter(loader)).global_indexes.tolist()
                loader.close()
            print(json.dumps(report), flush=True)
            raise
    return {"interrupted": False}


def open_in_a_running_loop(path: str) -> dict[str, Any]:
    """``open_dataset`` called from code a loop runs (a notebook cell), on a stalled server.

    The loop installs no SIGINT handler (as in a notebook), so Ctrl-C raises in the thread
    waiting for the portal's helper thread.
    """

    # asyncbatch loads its modules on first use: load them (torch too) before "ready", so the
    # signal finds open_dataset waiting on the server, not on an import in the helper thread.
    importlib.import_module("asyncbatch._open")

    async def main(url: str) -> None:
        ab.open_dataset(url)  # sync, on purpose: what a notebook user writes

    loop = asyncio.new_event_loop()
    with stalled_http(Path(path).parent, everything=True) as server:
        try:
            print("ready", flush=True)
            loop.run_until_complete(main(f"{server}/{Path(path).name}"))
        except KeyboardInterrupt:
            at = time.monotonic()
            print(json.dumps({"at": at, "threads": asyncbatch_threads()}), flush=True)
            raise
        finally:
            loop.close()
    return {}


def leak(args: dict[str, Any]) -> dict[str, Any]:
    """Each of ``args["modes"]`` in turn (see :func:`leak_once`); threads after each."""
    return {mode: leak_once(mode, args["url"], args["options"]) for mode in args["modes"]}


def leak_once(mode: str, url: str, options: dict[str, Any]) -> dict[str, Any]:
    """Early break, close, garbage collection, an async loop, or exit with a running loader."""
    kwargs = dict(batch_size=4, seq_len=16, prefetch=4, storage_options=options)
    out: dict[str, Any] = {}
    if mode == "break":
        with ab.Loader(url, **kwargs) as loader:
            out["ids"] = len(ids_of(loader, 3))
    elif mode == "close":
        loader = ab.Loader(url, **kwargs)
        out["ids"] = len(ids_of(loader, 2))
        loader.close()
    elif mode == "gc":
        loader = ab.Loader(url, **kwargs)
        out["ids"] = len(ids_of(loader, 2))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            del loader
            gc.collect()
        out["warnings"] = [str(w.message)[:16] for w in caught]
    elif mode == "async":

        async def main() -> int:
            async with ab.AsyncLoader(url, **kwargs) as loader:
                async for _ in loader:
                    break
                count = 0
                async for batch in loader:  # the same epoch goes on
                    count += batch.batch_size
                    if count >= 12:
                        break
            return count

        out["ids"] = asyncio.run(main())
    elif mode == "steady":
        out = steady(url, options)
        out["ids"] = 1
    elif mode == "exit":
        # Left running, referenced by a global: interpreter exit closes it.
        global _kept
        _kept = ab.Loader(url, **kwargs)
        out["ids"] = len(ids_of(_kept, 2))
        # Registered last, so it runs first among atexit handlers: the loader is closed
        # already (torch's handlers, say, find no loader thread running).
        atexit.register(_report_threads_at_exit)
    out["threads"] = asyncbatch_threads() if mode != "exit" else []
    return out


_kept: Any = None


def _report_threads_at_exit() -> None:
    if asyncbatch_threads():
        print(f"asyncbatch threads at exit: {asyncbatch_threads()}", file=sys.stderr)


def steady(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """Threads, descriptors and RSS before and after early breaks, closes and 20 epochs."""
    kwargs = dict(batch_size=8, seq_len=32, prefetch=4, storage_options=options)

    def one_round(epochs: int) -> None:
        with ab.Loader(url, **kwargs) as loader:
            ids_of(loader, 3)
        loader = ab.Loader(url, **kwargs)
        ids_of(loader, 1)
        loader.close()
        with ab.Loader(url, **kwargs) as loader:
            for _ in range(epochs):
                ids_of(loader)

    one_round(2)  # imports, allocator pools and the page cache warm up here
    gc.collect()
    before = (asyncbatch_threads(), open_fds(), rss_bytes())
    one_round(20)
    gc.collect()
    after = (asyncbatch_threads(), open_fds(), rss_bytes())
    return {"before": before, "after": after}


def low_fd_limit(args: dict[str, Any]) -> dict[str, Any]:
    """Read every sample of a dataset of thousands of shards under a low descriptor limit,
    with the store's default descriptor LRU and then with an LRU larger than the limit."""
    limit, seq_len = args["limit"], args["seq_len"]
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    urls = ab.open_dataset(args["url"]).shard_urls
    tokens = np.concatenate([np.fromfile(url, dtype=np.uint16) for url in urls])
    out: dict[str, Any] = {"shards": len(urls)}
    for name, options in (("lru", {}), ("no_lru", {"max_open_files": 10 * limit})):
        dataset = ab.open_dataset(args["url"], options)
        before, peak, seen = open_fds(), 0, 0
        try:
            # Without the cap the reads fail with EMFILE, retried like any OSError: two
            # attempts say so as well as the default ten, whose backoff takes ~30 s.
            retry = None if name == "lru" else ab.RetryPolicy(max_attempts=2, base_delay=0)
            with ab.Loader(dataset, batch_size=16, seq_len=seq_len, seed=1, retry=retry) as loader:
                for batch in loader:
                    if name == "lru":  # (without, listing /proc/self/fd may fail)
                        peak = max(peak, open_fds())
                    starts = batch.global_indexes[:, None] * seq_len + np.arange(seq_len)
                    if not np.array_equal(batch["tokens"].numpy(), tokens[starts]):
                        raise AssertionError(f"wrong bytes in batch {batch.extra}")
                    seen += batch.batch_size
        except ab.StoreError as exc:
            out[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
        out[name] = {"seen": seen, "before": before, "peak": peak, "after": open_fds()}
    return out


# -- targets for child processes (multiprocessing) ------------------------------------------


def read_rest(loader: ab.Loader, results: Any) -> None:
    """Child process: the rest of the epoch from a loader the parent started."""
    try:
        results.put(("ok", ids_of(loader), asyncbatch_threads()))
        loader.close()
    except BaseException as exc:  # noqa: BLE001 - report it to the parent
        results.put(("error", repr(exc), []))


def ignored_range(args: dict[str, Any]) -> dict[str, Any]:
    """A loader over a server that ignores ``Range`` on every read, slowly and unevenly, so
    the first read to fail leaves reads of other shards in flight; the error it raised."""
    from faults import Fault, fault_server

    with fault_server(Path(args["root"])) as server:
        server.inject(default=Fault(ignore_range=True, delay=0.01, jitter=0.3))
        try:
            with ab.Loader(f"{server.url}/ds", batch_size=8, seq_len=64) as loader:
                next(loader)
        except ab.RangeNotSupportedError as exc:
            return {"error": type(exc).__name__}
    return {"error": None}


SCENARIOS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "ignored_range": ignored_range,
    "sigint": sigint,
    "leak": leak,
    "low_fd_limit": low_fd_limit,
}

if __name__ == "__main__":
    result = SCENARIOS[sys.argv[1]](json.loads(sys.argv[2]))
    print(json.dumps(result), flush=True)
