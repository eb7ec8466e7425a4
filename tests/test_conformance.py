"""Every built-in store passes asyncbatch.testing's conformance suite; a broken one fails it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import numpy.typing as npt
import pytest
import s3fs
from conftest import BUCKET, expected_windows, s3_options
from plugin.abtest_adapter import DirTransport
from servers import RangeHTTPServer

import asyncbatch as ab
from asyncbatch._errors import ShortReadError
from asyncbatch.stores import open_store
from asyncbatch.stores._base import ObjectInfo, ReadsTail, check_length, fetch_tail
from asyncbatch.stores._stack import stacked
from asyncbatch.testing import StoreConformance, StoreKit

#: chmod 0 denies nothing to root.
CHMOD_DENIES = hasattr(os, "geteuid") and os.geteuid() != 0


def _replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` beside ``path`` and rename it into place, as a writer would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _deny_file(path: Path) -> None:
    path.chmod(0)


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def store_kit(self, tmp_path: Path) -> StoreKit:
        return StoreKit(
            open=lambda: open_store(str(tmp_path / "x")),
            url=lambda name: str(tmp_path / name),
            put=lambda name, data: _replace_file(tmp_path / name, data),
            deny=(lambda name: _deny_file(tmp_path / name)) if CHMOD_DENIES else None,
        )


class TestS3Store(StoreConformance):
    @pytest.fixture
    def store_kit(self, s3_endpoint: str, request: pytest.FixtureRequest) -> StoreKit:
        options = s3_options(s3_endpoint)
        fs = s3fs.S3FileSystem(**options)
        prefix = f"{BUCKET}/conformance/{request.node.name}"
        return StoreKit(
            open=lambda: open_store(f"s3://{prefix}", options),
            url=lambda name: f"s3://{prefix}/{name}",
            put=lambda name, data: fs.pipe_file(f"{prefix}/{name}", data),
        )


class TestHttpStore(StoreConformance):
    @pytest.fixture
    def store_kit(self, http_root: tuple[Path, RangeHTTPServer]) -> StoreKit:
        root, server = http_root
        return StoreKit(
            open=lambda: open_store(server.url),
            url=lambda name: f"{server.url}/conformance/{name}",
            put=lambda name, data: _replace_file(root / "conformance" / name, data),
            # The test server answers 403 for a file with a NAME.forbidden beside it.
            deny=lambda name: (root / "conformance" / f"{name}.forbidden").touch(),
        )


class TestFsspecMemoryStore(StoreConformance):
    @pytest.fixture
    def store_kit(self, request: pytest.FixtureRequest) -> StoreKit:
        fs = fsspec.filesystem("memory")
        prefix = f"/conformance/{request.node.name}"
        return StoreKit(
            open=lambda: open_store(f"memory://{prefix}"),
            url=lambda name: f"memory://{prefix}/{name}",
            put=lambda name, data: fs.pipe_file(f"{prefix}/{name}", data),
        )


class TestExampleAdapter(StoreConformance):
    """The adapter of docs/adapters.md (tests/plugin), through the stack alone."""

    @pytest.fixture
    def store_kit(self, tmp_path: Path) -> StoreKit:
        return StoreKit(
            open=DirTransport,
            url=lambda name: f"dirtest://{tmp_path / name}",
            put=lambda name, data: _replace_file(tmp_path / name, data),
            deny=(lambda name: _deny_file(tmp_path / name)) if CHMOD_DENIES else None,
        )


class DirIntoTransport(DirTransport):
    """The example adapter with the engine's fast path: a group's ranges into one buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def read_into(
        self,
        urls: Sequence[str],
        which: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        ends: npt.NDArray[np.int64],
        dest: npt.NDArray[np.uint8],
        dest_offsets: npt.NDArray[np.int64],
    ) -> None:
        self.calls += 1
        rows = zip(
            which.tolist(), starts.tolist(), ends.tolist(), dest_offsets.tolist(), strict=True
        )

        def read() -> None:
            for index, start, end, at in rows:
                with open(self.path(urls[index]), "rb") as file:
                    view = memoryview(dest)[at : at + end - start]  # type: ignore[arg-type]
                    got = os.preadv(file.fileno(), [view], start)
                check_length(urls[index], start, end, got)

        await asyncio.to_thread(read)


class TestReadsIntoAdapter(StoreConformance):
    @pytest.fixture
    def store_kit(self, tmp_path: Path) -> StoreKit:
        return StoreKit(
            open=DirIntoTransport,
            url=lambda name: f"dirinto://{tmp_path / name}",
            put=lambda name, data: _replace_file(tmp_path / name, data),
        )


class DirTailTransport(DirTransport):
    """The example adapter with tails: size, version and last bytes in one thread job.
    ``short`` makes it return one byte too few, as a broken adapter would."""

    def __init__(self, short: bool = False) -> None:
        super().__init__()
        self.short = short
        self.tails = 0

    async def read_tail(self, url: str, length: int) -> tuple[bytes, ObjectInfo]:
        self.tails += 1

        def read() -> tuple[bytes, ObjectInfo]:
            with open(self.path(url), "rb") as file:
                stat = os.fstat(file.fileno())
                count = min(length, stat.st_size) - self.short
                tail = os.pread(file.fileno(), count, stat.st_size - count) if count > 0 else b""
            version = f"{stat.st_ino}-{stat.st_size}-{stat.st_mtime_ns}"
            return tail, ObjectInfo(stat.st_size, version)

        return await asyncio.to_thread(read)


class TestReadsTailAdapter(StoreConformance):
    @pytest.fixture
    def store_kit(self, tmp_path: Path) -> StoreKit:
        return StoreKit(
            open=DirTailTransport,
            url=lambda name: f"dirtail://{tmp_path / name}",
            put=lambda name, data: _replace_file(tmp_path / name, data),
        )


def test_an_adapters_tail_is_used_and_checked(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(b"0123456789")
    transport, short = DirTailTransport(), DirTailTransport(short=True)
    url = f"dirtail://{tmp_path / 'x'}"

    async def main() -> tuple[bytes | bytearray, ObjectInfo]:
        store, broken = stacked(transport), stacked(short)
        try:
            assert isinstance(store, ReadsTail)
            with pytest.raises(ShortReadError, match=r"x bytes \[6, 10\) returned 3 of 4"):
                await fetch_tail(broken, url, 4)
            return await fetch_tail(store, url, 4)
        finally:
            await store.close()
            await broken.close()

    tail, info = asyncio.run(main())
    assert (bytes(tail), info.size, transport.tails) == (b"6789", 10, 1)


def test_the_engine_reads_an_adapters_buffer_path(
    tmp_path: Path, tokens: npt.NDArray[np.uint16]
) -> None:
    made: list[DirIntoTransport] = []

    def factory(scheme: str, options: Any, *, max_inflight: int) -> DirIntoTransport:
        made.append(DirIntoTransport())
        return made[-1]

    ab.register_store("dirinto", factory, clobber=True)
    ab.write_tokens(str(tmp_path / "ds"), tokens, shard_size=5_000)
    assert open_store(f"dirinto://{tmp_path}").supports_read_into  # kept through the stack
    with ab.Loader(f"dirinto://{tmp_path}/ds", batch_size=16, seq_len=50) as loader:
        for batch in loader:
            np.testing.assert_array_equal(
                batch["tokens"].numpy(), expected_windows(tokens, batch.global_indexes, 50)
            )
    assert sum(t.calls for t in made) > 0


BROKEN = """
from pathlib import Path

import pytest
from abtest_adapter import DirTransport

from asyncbatch.testing import StoreConformance, StoreKit


class OffByOne(DirTransport):
    async def get_ranges(self, url, *, starts, ends):
        shifted = [s + 1 for s in starts], [e + 1 for e in ends]
        return await super().get_ranges(url, starts=shifted[0], ends=shifted[1])


class ShortRead(DirTransport):
    async def get_ranges(self, url, *, starts, ends):
        short = [max(s, e - 1) for s, e in zip(starts, ends)]
        return await super().get_ranges(url, starts=starts, ends=short)


@pytest.fixture(params=[OffByOne, ShortRead])
def transport(request):
    return request.param


class TestBroken(StoreConformance):
    @pytest.fixture
    def store_kit(self, tmp_path, transport):
        return StoreKit(
            open=transport,
            url=lambda name: f"broken://{tmp_path / name}",
            put=lambda name, data: (tmp_path / name).write_bytes(data),
        )
"""


@pytest.mark.timeout(120)
def test_a_broken_adapter_fails_the_suite(tmp_path: Path) -> None:
    (tmp_path / "test_broken.py").write_text(textwrap.dedent(BROKEN))
    plugin = Path(__file__).parent / "plugin"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin), *sys.path])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "test_broken.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    # Shifted bytes and short ones are both caught, by the tests that name the fault.
    assert "FAILED test_broken.py::TestBroken::test_ranges_are_end_exclusive[OffByOne]" in out
    assert "FAILED test_broken.py::TestBroken::test_ranges_are_end_exclusive[ShortRead]" in out
