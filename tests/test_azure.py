"""The Azure Blob store (``az://``, ``abfs://``) against Azurite, Microsoft's emulator: the
conformance suite, datasets written and read exactly under every shuffle and resumed,
Parquet prefixes opened from their footers alone, each way of giving credentials, the node
cache and ``verify=``. Objects are put out of band by azure-storage-blob, Azure's own SDK."""

from __future__ import annotations

import asyncio
import io
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from conftest import azure_options, expected_windows
from faults import FaultServer, fault_server

import asyncbatch as ab
from asyncbatch.stores import _azure as azure_module
from asyncbatch.stores import open_store
from asyncbatch.stores._azure import AzureStore
from asyncbatch.stores._azure_auth import (
    DEV_ACCOUNT,
    DEV_KEY,
    AccountFinder,
    BearerToken,
    parse_connection_string,
)
from asyncbatch.stores._base import ListsInfo, ObjectInfo
from asyncbatch.testing import StoreConformance, StoreKit

CONTAINER = "asyncbatch-tests"
_names = itertools.count()


def connection_string(endpoint: str) -> str:
    return (
        f"DefaultEndpointsProtocol=http;AccountName={DEV_ACCOUNT};AccountKey={DEV_KEY};"
        f"BlobEndpoint={endpoint};"
    )


@pytest.fixture(scope="module")
def blobs(azurite_endpoint: str) -> Any:
    """azure-storage-blob's client of Azurite's container :data:`CONTAINER` (created)."""
    from azure.storage.blob import BlobServiceClient

    service = BlobServiceClient.from_connection_string(connection_string(azurite_endpoint))
    container = service.get_container_client(CONTAINER)
    if not container.exists():
        container.create_container()
    yield container
    service.close()


def put(blobs: Any, name: str, data: bytes) -> None:
    blobs.get_blob_client(name).upload_blob(data, overwrite=True)


class TestAzureStore(StoreConformance):
    @pytest.fixture
    def store_kit(
        self, azurite_endpoint: str, blobs: Any, request: pytest.FixtureRequest
    ) -> StoreKit:
        options = azure_options(azurite_endpoint)
        prefix = f"conformance/{request.node.name}"
        return StoreKit(
            open=lambda: open_store(f"az://{CONTAINER}/{prefix}", options),
            url=lambda name: f"az://{CONTAINER}/{prefix}/{name}",
            put=lambda name, data: put(blobs, f"{prefix}/{name}", data),
        )


# -- datasets ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokens_az(azurite_endpoint: str) -> tuple[ab.Dataset, npt.NDArray[np.uint16]]:
    """A tokens dataset written by asyncbatch's writer to az:// (the container made by the
    write), and its tokens."""
    tokens = np.random.default_rng(0).integers(0, 60_000, 12_011, dtype=np.uint16)
    url = f"az://written-{next(_names)}/tokens"
    options = azure_options(azurite_endpoint)
    ab.write_tokens(url, tokens, shard_size=2_500, storage_options=options)
    return ab.open_dataset(url, options), tokens


def ids_of(loader: ab.Loader, limit: int | None = None) -> list[list[int]]:
    return [b.global_indexes.tolist() for b in itertools.islice(loader, limit)]


@pytest.mark.parametrize("shuffle", [False, True, "block"])
def test_a_written_dataset_reads_exactly_under_every_shuffle_and_resumes(
    tokens_az: tuple[ab.Dataset, npt.NDArray[np.uint16]], shuffle: bool | str
) -> None:
    dataset, tokens = tokens_az
    kwargs: dict[str, Any] = dict(batch_size=8, seq_len=40, shuffle=shuffle, seed=3, prefetch=4)
    if shuffle == "block":
        kwargs.update(block_size=6, window=3)
    seen: list[int] = []
    with ab.Loader(dataset, **kwargs) as loader:
        for batch in loader:
            np.testing.assert_array_equal(
                batch["tokens"].numpy(), expected_windows(tokens, batch.global_indexes, 40)
            )
            seen += batch.global_indexes.tolist()
    windows = tokens.size // 40
    assert len(seen) == windows // 8 * 8 and len(set(seen)) == len(seen)
    with ab.Loader(dataset, **kwargs) as loader:
        full = ids_of(loader)
    with ab.Loader(dataset, **kwargs) as loader:
        first = ids_of(loader, 5)
        state = loader.state_dict()
    with ab.Loader(dataset, **kwargs) as loader:
        loader.load_state_dict(state)
        assert first + ids_of(loader) == full


def test_node_cache_and_verify(
    tokens_az: tuple[ab.Dataset, npt.NDArray[np.uint16]], tmp_path: Path
) -> None:
    dataset, tokens = tokens_az
    for verify in ("full", "block"):
        with ab.Loader(
            dataset, batch_size=8, seq_len=40, cache=tmp_path / "cache", verify=verify
        ) as loader:
            for batch in loader:
                np.testing.assert_array_equal(
                    batch["tokens"].numpy(), expected_windows(tokens, batch.global_indexes, 40)
                )
            stats = loader.statistics()
    assert stats is not None
    assert any((tmp_path / "cache").rglob("*"))  # blocks were kept on disk


def test_abfs_urls_read_and_list_in_their_own_form(azurite_endpoint: str, blobs: Any) -> None:
    data = bytes(range(256)) * 40
    put(blobs, "abfs/one.bin", data)
    put(blobs, "abfs/sub/two.bin", b"2")
    root = f"abfs://{CONTAINER}@{DEV_ACCOUNT}.dfs.core.windows.net/abfs"
    # The endpoint option serves the URL's account (Azurite's, at a path of its own).
    options = {"account_key": DEV_KEY, "endpoint": azurite_endpoint}

    async def main() -> tuple[list[tuple[str, ObjectInfo | None]], bytes]:
        store = open_store(root, options)
        try:
            assert isinstance(store, ListsInfo)
            listed = await store.list_info(root)
            buffer = bytearray(100)
            await store.read_ranges(
                f"{root}/one.bin", starts=[1000], ends=[1100], buffers=[memoryview(buffer)]
            )
            return listed, bytes(buffer)
        finally:
            await store.close()

    listed, got = asyncio.run(main())
    assert got == data[1000:1100]
    assert [name for name, _ in listed] == [f"{root}/one.bin", f"{root}/sub"]
    info = listed[0][1]
    assert info is not None and info.size == len(data) and info.version is not None
    assert info.version.startswith('"')  # quoted, as GETs report it


# -- Parquet -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def azure_proxy(azurite_endpoint: str) -> Iterator[FaultServer]:
    upstream = azurite_endpoint.rsplit("/", 1)[0]
    with fault_server(upstream=upstream) as server:
        yield server


def test_a_parquet_prefix_opens_from_its_footers_alone(
    azurite_endpoint: str, azure_proxy: FaultServer, blobs: Any
) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    folder = f"parquet-{next(_names)}"
    rows = 0
    for index, count in enumerate([100, 0, 250]):
        table = pa.table({"id": np.arange(rows, rows + count, dtype=np.int64)})
        sink = io.BytesIO()
        pq.write_table(table, sink, row_group_size=64)
        put(blobs, f"{folder}/part-{index}.parquet", sink.getvalue())
        rows += count
    options = azure_options(f"{azure_proxy.url}/{DEV_ACCOUNT}")
    azure_proxy.reset()
    dataset = ab.open_dataset(f"az://{CONTAINER}/{folder}", options)
    on_files = [(m, p, r) for m, p, r in azure_proxy.log if p.endswith(".parquet")]
    # The listing told sizes and ETags: one ranged GET per footer, no HEAD, no suffix range.
    assert [m for m, _, _ in on_files] == ["GET"] * 3
    assert all(r.startswith("bytes=") and not r.startswith("bytes=-") for _, _, r in on_files)
    with ab.Loader(dataset, batch_size=32, shuffle=False, drop_last=False) as loader:
        assert [i for b in loader for i in b["id"].tolist()] == list(range(rows))


@pytest.mark.parametrize("folder", ["50%41", "a+b", "with space", "ünï"])
def test_names_with_escapes_and_non_ascii_are_signed_as_sent(
    azurite_endpoint: str, blobs: Any, folder: str
) -> None:
    # Shared Key signs the listing's prefix= decoded, as sent; unquoting it again signed
    # "50A/" for "50%41/" (a 403 CredentialsError for an account key, while SAS worked).
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    prefix = f"escapes-{next(_names)}/{folder}"
    for index, name in enumerate(["part 0%41+ü.parquet", "part-1.parquet"]):
        sink = io.BytesIO()
        ids = np.arange(index * 50, index * 50 + 50, dtype=np.int64)
        pq.write_table(pa.table({"id": ids}), sink)
        put(blobs, f"{prefix}/{name}", sink.getvalue())
    options = azure_options(azurite_endpoint)
    root = f"az://{CONTAINER}/{prefix}"
    with ab.Loader(ab.open_dataset(root, options), batch_size=25, shuffle=False) as loader:
        assert [i for b in loader for i in b["id"].tolist()] == list(range(100))
    single = ab.open_dataset(f"{root}/part 0%41+ü.parquet", options)
    with ab.Loader(single, batch_size=25, shuffle=False) as loader:
        assert [i for b in loader for i in b["id"].tolist()] == list(range(50))
    # Written by asyncbatch's writer under the same prefix, and read back.
    tokens = np.arange(1_000, dtype=np.uint16)
    ab.write_tokens(f"{root}/tokens", tokens, storage_options=options)
    with ab.Loader(ab.open_dataset(f"{root}/tokens", options), batch_size=5, seq_len=20) as loader:
        for batch in loader:
            np.testing.assert_array_equal(
                batch["tokens"].numpy(), expected_windows(tokens, batch.global_indexes, 20)
            )


# -- credentials -------------------------------------------------------------------------


def _read_with(url: str, options: dict[str, Any]) -> bytes:
    async def main() -> bytes:
        store = open_store(url, options)
        buffer = bytearray(10)
        try:
            await store.read_ranges(url, starts=[5], ends=[15], buffers=[memoryview(buffer)])
        finally:
            await store.close()
        return bytes(buffer)

    return asyncio.run(main())


DATA = bytes(range(100))


def test_a_sas_token_reads(azurite_endpoint: str, blobs: Any) -> None:
    import datetime

    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    put(blobs, "sas/obj", DATA)
    token = generate_container_sas(
        DEV_ACCOUNT,
        CONTAINER,
        account_key=DEV_KEY,
        permission=ContainerSasPermissions(read=True, list=True),
        expiry=datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1),
    )
    options = {"account_name": DEV_ACCOUNT, "sas_token": token, "endpoint": azurite_endpoint}
    assert _read_with(f"az://{CONTAINER}/sas/obj", options) == DATA[5:15]
    with pytest.raises(ab.PermissionDeniedError):  # read and list only: no write
        asyncio.run(_write(f"az://{CONTAINER}/sas/new", options))


async def _write(url: str, options: dict[str, Any]) -> None:
    store = open_store(url, options)
    try:
        await store.write(url, b"x")
    finally:
        await store.close()


def test_a_connection_string_from_the_environment_reads(
    azurite_endpoint: str, blobs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(blobs, "env/obj", DATA)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(azurite_endpoint))
    assert _read_with(f"az://{CONTAINER}/env/obj", {}) == DATA[5:15]


def test_an_account_key_from_the_environment_reads(
    azurite_endpoint: str, blobs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(blobs, "env/key", DATA)
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING", raising=False)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", DEV_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_KEY", DEV_KEY)
    assert _read_with(f"az://{CONTAINER}/env/key", {"endpoint": azurite_endpoint}) == DATA[5:15]


def test_where_credentials_are_found() -> None:
    env = {"AZURE_STORAGE_ACCOUNT_NAME": "fromenv", "AZURE_STORAGE_KEY": DEV_KEY}
    # Options first, then the environment; the URL's account wins over both.
    finder = AccountFinder({"account_name": "given", "sas_token": "?sv=1&sig=x"}, env)
    account = finder.account(None)
    assert (account.name, account.base) == ("given", "https://given.blob.core.windows.net")
    assert account.auth.sas == "sv=1&sig=x" and account.auth.shared_key is None
    other = finder.account("other", "other.dfs.core.windows.net")
    assert other.base == "https://other.blob.core.windows.net"
    from_env = AccountFinder({}, env).account(None)
    assert from_env.name == "fromenv" and from_env.auth.shared_key is not None
    from azure.core.credentials import AzureNamedKeyCredential, AzureSasCredential

    named = AccountFinder({"credential": AzureNamedKeyCredential("k", DEV_KEY)}).account("k")
    assert named.auth.shared_key is not None and named.auth.shared_key.account == "k"
    sas = AccountFinder({"credential": AzureSasCredential("sv=1&sig=y")}).account("k").auth
    assert sas.sas == "sv=1&sig=y"
    anon = AccountFinder({"anon": True}, env).account(None).auth
    assert (anon.shared_key, anon.sas, anon.bearer) == (None, None, None)
    dev = parse_connection_string("UseDevelopmentStorage=true")
    assert dev["AccountName"] == DEV_ACCOUNT and dev["BlobEndpoint"].endswith(DEV_ACCOUNT)
    text = f"AccountName=a;AccountKey={DEV_KEY};EndpointSuffix=core.chinacloudapi.cn"
    chinese = AccountFinder({"connection_string": text}).account(None)
    assert chinese.base == "https://a.blob.core.chinacloudapi.cn"


class _Token:
    def __init__(self, token: str, expires_on: int) -> None:
        self.token, self.expires_on = token, expires_on


class _Credential:
    """An azure-identity style credential (``get_token``) counting its calls."""

    def __init__(self, fail: bool = False) -> None:
        self.calls = 0
        self.fail = fail

    async def get_token(self, *scopes: str) -> _Token:
        import time

        from azure.core.exceptions import ClientAuthenticationError

        self.calls += 1
        if self.fail:
            raise ClientAuthenticationError("DefaultAzureCredential failed to retrieve a token")
        assert scopes == ("https://storage.azure.com/.default",)
        return _Token(f"t{self.calls}", int(time.time()) + 3600)


def test_bearer_tokens_are_kept_until_near_expiry_and_failures_typed() -> None:
    async def main() -> None:
        credential = _Credential()
        bearer = BearerToken(credential, owned=False)
        assert await bearer.header() == "Bearer t1"
        assert await bearer.header() == "Bearer t1"
        assert credential.calls == 1
        # A credential made by the store shares its token with the next store's.
        first = BearerToken(_Credential(), owned=True, shared=("test", "shared"))
        assert await first.header() == "Bearer t1"
        again = _Credential()
        assert (
            await BearerToken(again, owned=True, shared=("test", "shared")).header() == "Bearer t1"
        )
        assert again.calls == 0
        failing = BearerToken(_Credential(fail=True), owned=False)
        with pytest.raises(ab.CredentialsError, match="az login.*failed to retrieve a token"):
            await failing.header()

    asyncio.run(main())


def test_a_credential_that_never_answers_is_a_timeout() -> None:
    class Silent:
        async def get_token(self, *scopes: str) -> _Token:
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

    async def main() -> None:
        bearer = BearerToken(Silent(), owned=False)
        bearer.TIMEOUT = 0.2
        began = time.monotonic()
        with pytest.raises(ab.StoreTimeoutError, match="no token from the Azure credential"):
            await bearer.header()
        assert time.monotonic() - began < 5

    asyncio.run(main())


# -- writes --------------------------------------------------------------------------------


def test_large_writes_go_in_blocks(
    azurite_endpoint: str, blobs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(azure_module, "PUT_LIMIT", 100_000)
    monkeypatch.setattr(azure_module, "BLOCK_SIZE", 40_000)
    data = np.random.default_rng(1).bytes(250_000)
    url = f"az://{CONTAINER}/blocks/big.bin"
    asyncio.run(_write_data(url, azure_options(azurite_endpoint), data))
    assert blobs.get_blob_client("blocks/big.bin").download_blob().readall() == data
    committed, _ = blobs.get_blob_client("blocks/big.bin").get_block_list()
    assert [block.size for block in committed] == [40_000] * 6 + [10_000]


async def _write_data(url: str, options: dict[str, Any], data: bytes) -> None:
    store = AzureStore(options)
    try:
        await store.write(url, data)
    finally:
        await store.close()
