"""AzureStore against Azurite over HTTP: the conformance suite and Azure's commit rules.

Azurite comes from npm (``make test`` installs it into ``.azurite/`` when npm exists); without
it these tests skip. Azurite enforces ``If-None-Match: *`` and ``If-Match`` atomically, so the
conformance suite's race tests run here too.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from deltastore.errors import PreconditionFailedError, StoreError, VersionExistsError
from deltastore.store import open_store
from deltastore.store.fsspec_store import RetryPolicy
from deltastore.testing.conformance import StoreTests, race
from tests.servers import AZURITE_ACCOUNT, AZURITE_KEY, azurite, azurite_executable, free_port

pytest.importorskip("adlfs")
if azurite_executable() is None:
    pytest.skip(
        "Azurite not installed: `make test` installs it when npm exists "
        "(npm install --prefix .azurite azurite@3.37.0)",
        allow_module_level=True,
    )

from deltastore.store.azure import AzureStore


@pytest.fixture(scope="module")
def connection_string() -> Iterator[str]:
    with azurite() as conn:
        yield conn


@pytest.fixture(scope="module")
def container(connection_string: str) -> str:
    from azure.storage.blob import BlobServiceClient

    name = f"deltastore-{uuid.uuid4().hex[:12]}"
    with BlobServiceClient.from_connection_string(connection_string) as service:
        service.create_container(name)
    return name


def options(connection_string: str) -> dict[str, Any]:
    return {"connection_string": connection_string}


def az_store(connection_string: str, container: str) -> AzureStore:
    store = open_store(f"az://{container}/{uuid.uuid4().hex[:8]}", options(connection_string))
    assert isinstance(store, AzureStore)
    return store


class TestAzureStore(StoreTests):
    @pytest.fixture
    def store(self, connection_string: str, container: str) -> AzureStore:
        return az_store(connection_string, container)


def test_second_writer_gets_version_exists(connection_string: str, container: str) -> None:
    a = az_store(connection_string, container)
    b = AzureStore(a.url, options(connection_string))
    a.put_if_absent("manifests/00000000000000000001.json", b"writer a")
    with pytest.raises(VersionExistsError):
        b.put_if_absent("manifests/00000000000000000001.json", b"writer b")
    assert b.get("manifests/00000000000000000001.json") == b"writer a"


def test_stale_etag_is_refused(connection_string: str, container: str) -> None:
    a = az_store(connection_string, container)
    b = AzureStore(a.url, options(connection_string))
    a.put_if_match("LATEST", b"1", None)
    seen_a, seen_b = a.get_with_token("LATEST"), b.get_with_token("LATEST")
    assert seen_a is not None and seen_b is not None and seen_a[1] == seen_b[1]
    b.put_if_match("LATEST", b"3", seen_b[1])  # b advances first
    with pytest.raises(PreconditionFailedError):
        a.put_if_match("LATEST", b"2", seen_a[1])  # a's ETag is stale: it cannot move it back
    assert a.get("LATEST") == b"3"
    a.delete("LATEST")
    with pytest.raises(PreconditionFailedError):  # deleted since read: the token is stale too
        a.put_if_match("LATEST", b"2", seen_a[1])
    assert not a.exists("LATEST")


def test_token_names_the_bytes_read(connection_string: str, container: str) -> None:
    store = az_store(connection_string, container)
    store.put("LATEST", b"1")
    first = store.get_with_token("LATEST")
    store.put("LATEST", b"2")
    second = store.get_with_token("LATEST")
    assert first is not None and second is not None
    assert first[0] == b"1" and second[0] == b"2" and first[1] != second[1]
    assert store.head_token("LATEST") == second[1]
    assert store.head_token("nope") is None


def test_race_of_separate_clients_has_one_winner(connection_string: str, container: str) -> None:
    url = az_store(connection_string, container).url
    stores = [AzureStore(url, options(connection_string)) for _ in range(8)]
    results = race(8, lambda i: stores[i].put_if_absent("m/x.json", f"w{i}".encode()))
    winners = [i for i, r in enumerate(results) if r is None]
    assert len(winners) == 1
    assert all(isinstance(r, VersionExistsError) for r in results if r is not None)
    assert stores[0].get("m/x.json") == f"w{winners[0]}".encode()


def test_probe_accepts_azurite(connection_string: str, container: str) -> None:
    store = az_store(connection_string, container)
    assert store.check_conditional_writes() is True
    assert store.list() == []  # the probe cleans up


def test_probe_refuses_a_server_that_ignores_if_none_match(
    connection_string: str, container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = az_store(connection_string, container)
    monkeypatch.setattr(store, "_create", lambda path, data: store.fs.pipe_file(path, data))
    with pytest.raises(StoreError, match="If-None-Match"):
        store.check_conditional_writes()


def test_ambiguous_commit_is_resolved_by_reading_back(
    connection_string: str, container: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The create reached the service but the reply was lost: the retry finds the blob, reads
    it back and reports success, not another writer's VersionExistsError."""
    from azure.core.exceptions import ServiceResponseError

    store = az_store(connection_string, container)
    real = store._create
    calls = 0

    def lost_reply(path: str, data: bytes) -> None:
        nonlocal calls
        calls += 1
        real(path, data)
        if calls == 1:
            raise ServiceResponseError("connection reset after the request was sent")

    monkeypatch.setattr(store, "_create", lost_reply)
    store.put_if_absent("manifests/1.json", b"mine")
    assert calls == 2 and store.get("manifests/1.json") == b"mine"
    with pytest.raises(VersionExistsError):
        store.put_if_absent("manifests/1.json", b"someone else")


def test_transient_and_permanent_errors(connection_string: str, container: str) -> None:
    from azure.core.exceptions import (
        ClientAuthenticationError,
        HttpResponseError,
        ServiceRequestError,
    )

    store = az_store(connection_string, container)

    def http(status: int) -> HttpResponseError:
        exc = HttpResponseError(message=f"status {status}")
        exc.status_code = status
        return exc

    assert store.transient(ServiceRequestError("connection refused"))
    assert store.transient(http(503)) and store.transient(http(429)) and store.transient(http(500))
    assert not store.transient(http(403)) and not store.transient(http(404))
    assert not store.transient(ClientAuthenticationError("bad key"))


def test_unreachable_service_is_bounded_by_the_retry_policy(container: str) -> None:
    """The SDK's own retries (15-80 s backoffs) are off: RetryPolicy alone bounds the wait."""
    dead = free_port()
    conn = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{dead}/{AZURITE_ACCOUNT};"
    )
    retry = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05, total_seconds=5)
    store = AzureStore(f"az://{container}/p", {"connection_string": conn}, retry=retry)
    for op in (
        lambda: store.put("k", b"v"),
        lambda: store.get("k"),
        lambda: store.put_if_absent("k", b"v"),
        lambda: store.get_with_token("k"),
    ):
        start = time.monotonic()
        with pytest.raises(StoreError, match="after 3 attempts"):
            op()
        assert time.monotonic() - start < 5
        store._failing_until = 0.0  # each operation on its own (see the next test)


def test_after_a_give_up_the_next_operations_try_once(container: str) -> None:
    """An operation that gave up on a dead endpoint makes the store's next operations within
    the timeout fail after one attempt: a command's fallbacks do not multiply the wait."""
    dead = free_port()
    conn = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{dead}/{AZURITE_ACCOUNT};"
    )
    retry = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05, total_seconds=5)
    store = AzureStore(f"az://{container}/p", {"connection_string": conn}, retry=retry)
    with pytest.raises(StoreError, match="after 3 attempts"):
        store.get("k")
    with pytest.raises(StoreError, match=r"after 1 attempt .*the previous operation gave up"):
        store.list("manifests/")


def test_missing_container_is_named_not_an_empty_store(connection_string: str) -> None:
    from deltastore.errors import BucketNotFoundError

    container = f"no-such-{uuid.uuid4().hex[:8]}"
    store = AzureStore(f"az://{container}/p", options(connection_string))
    for op in (
        lambda: store.put("k", b"v"),
        lambda: store.get("k"),
        lambda: store.get_with_token("LATEST"),
        lambda: store.head_token("LATEST"),
        lambda: store.put_if_absent("m/1.json", b"v"),
        lambda: store.list("manifests/"),
        lambda: store.delete("k"),
    ):
        with pytest.raises(BucketNotFoundError, match=f"container '{container}' .* does not exist"):
            op()


def test_an_empty_container_is_an_empty_store(connection_string: str, container: str) -> None:
    store = az_store(connection_string, container)
    assert store.list() == [] and store.get_with_token("LATEST") is None


def test_cli_credentials_as_documented(
    connection_string: str, container: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection string works through ``-o`` and through ``AZURE_STORAGE_CONNECTION_STRING``
    (``account_name``/``account_key`` build an https URL, which Azurite does not serve here)."""
    import torch
    from safetensors.torch import save_file
    from typer.testing import CliRunner

    from deltastore_cli import app

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(logging.root, "handlers", logging.root.handlers[:])  # the CLI sets its own
    (tmp_path / "ckpt").mkdir()
    save_file({"w": torch.arange(8.0)}, tmp_path / "ckpt" / "model.safetensors")
    runner = CliRunner()
    url = f"az://{container}/{uuid.uuid4().hex[:8]}"
    option = ["-o", f"connection_string={connection_string}"]
    published = runner.invoke(
        app, ["publish", url, str(tmp_path / "ckpt"), "--version", "1", *option]
    )
    assert published.exit_code == 0, published.output
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string)
    logged = runner.invoke(app, ["log", url, "--json"])
    assert logged.exit_code == 0, logged.output
    assert [v["version"] for v in json.loads(logged.stdout)] == [1]
    missing = runner.invoke(app, ["log", f"az://no-such-{uuid.uuid4().hex[:8]}/p"])
    assert missing.exit_code == 4 and "does not exist" in missing.stderr, missing.output


def test_wrong_key_fails_fast(connection_string: str, container: str) -> None:
    bad = connection_string.replace("AccountKey=Eby8", "AccountKey=Xby8")
    store = AzureStore(f"az://{container}/p", {"connection_string": bad})
    with pytest.raises(StoreError):
        store.put("k", b"v")


@pytest.mark.parametrize(
    "url", ["az://", "az://ab/p", "az://Upper/p", "az://a--b/p", "az://under_score"]
)
def test_container_name_is_checked(url: str) -> None:
    with pytest.raises(StoreError, match="container"):
        AzureStore(url, {"connection_string": "UseDevelopmentStorage=true"})


def test_open_store_schemes(connection_string: str, container: str) -> None:
    for scheme in ("az", "abfs", "abfss"):
        store = open_store(f"{scheme}://{container}/p", options(connection_string))
        assert isinstance(store, AzureStore) and store.root == f"{container}/p"
