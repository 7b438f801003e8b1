"""The core's multi-version AdamW test over every backend, plus fault injection over S3."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import deltastore.publish.commit
from deltastore import AccessDeniedError, Publisher, StoreError, Subscriber
from deltastore.format.manifest import LATEST_KEY, manifest_key, parse_latest
from deltastore.publish.commit import advance_latest
from deltastore.store import LocalStore, Store
from deltastore.store.fsspec_store import RetryPolicy
from deltastore.testing.synthetic import TINY, AdamWTrajectory
from tests.servers import azurite, azurite_executable, gcs_emulator

VERSIONS = 4
CREDENTIALS = {"key": "testing", "secret": "testing"}


def s3(endpoint: str, **kwargs: Any) -> Store:
    from deltastore.store.s3 import S3Store

    return S3Store(
        f"s3://e2e/{uuid.uuid4().hex[:8]}", {**CREDENTIALS, "endpoint_url": endpoint}, **kwargs
    )


@pytest.fixture(scope="module")
def gcs_endpoint() -> Iterator[str]:
    pytest.importorskip("gcsfs")
    with gcs_emulator() as url:
        from gcsfs.core import GCSFileSystem

        GCSFileSystem(skip_instance_cache=True, endpoint_url=url, token="anon").mkdir("e2e")
        yield url


def gcs(endpoint: str) -> Store:
    from deltastore.store.gcs import GCSStore

    # the emulator ignores generation preconditions (docs/stores.md): commits are unsafe there
    return GCSStore(
        f"gs://e2e/{uuid.uuid4().hex[:8]}",
        {"endpoint_url": endpoint, "token": "anon", "project": "test"},
        unsafe_commits=True,
    )


@pytest.fixture(scope="module")
def azure_connection() -> Iterator[str]:
    if azurite_executable() is None:
        pytest.skip("Azurite not installed (make test installs it into .azurite/ when npm exists)")
    with azurite() as conn:
        from azure.storage.blob import BlobServiceClient

        with BlobServiceClient.from_connection_string(conn) as service:
            service.create_container("e2e-container")
        yield conn


@pytest.fixture(params=["local", "s3", "gcs", "azure"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    if request.param == "gcs":
        return gcs(request.getfixturevalue("gcs_endpoint"))
    if request.param == "azure":
        from deltastore.store.azure import AzureStore

        return AzureStore(
            f"az://e2e-container/{uuid.uuid4().hex[:8]}",
            {"connection_string": request.getfixturevalue("azure_connection")},
        )
    return s3(request.getfixturevalue("s3_endpoint"))


@pytest.fixture(scope="module")
def states() -> list[dict[str, torch.Tensor]]:
    traj = AdamWTrajectory(TINY, lr=1e-6, seed=3)
    return [traj.bf16()] + [traj.step() for _ in range(VERSIONS - 1)]


def same(a: dict[str, torch.Tensor], b: Any) -> bool:
    return set(a) == set(b) and all(
        np.array_equal(a[k].view(torch.int16).numpy(), b[k].view(torch.int16).numpy()) for k in a
    )


class CountingStore:
    """Wraps a store's get_range to count the bytes a subscriber fetches."""

    def __init__(self, inner: Store) -> None:
        self.inner, self.fetched = inner, 0
        self._orig = inner.get_range
        inner.get_range = self._get_range  # type: ignore[method-assign]

    def _get_range(self, key: str, start: int, length: int) -> bytes:
        data = self._orig(key, start, length)
        self.fetched += len(data)
        return data


def test_adamw_versions_bit_exact(store: Store, states: list[dict[str, torch.Tensor]]) -> None:
    pub = Publisher(store, max_frame_bytes=256 << 10, max_object_bytes=2 << 20)
    fresh = Subscriber(store, max_workers=4)
    attached = Subscriber(store, tensors={k: v.clone() for k, v in states[0].items()}, version=1)
    counter = CountingStore(store)
    for v, state in enumerate(states, start=1):
        report = pub.publish(state, version=v)
        assert fresh.latest() == v
        before = counter.fetched
        fresh.sync()
        assert counter.fetched - before == report.payload_bytes  # exactly the frames published
        assert same(state, fresh.tensors)
        if v > 1:
            before = counter.fetched
            sync = attached.sync()
            assert counter.fetched - before == sync.payload_bytes < 0.03 * sync.dense_bytes
            assert same(state, attached.tensors)
    late = Subscriber(store)
    late.sync()
    assert same(states[-1], late.tensors)


def test_only_changed_tensors_are_fetched(
    store: Store, states: list[dict[str, torch.Tensor]]
) -> None:
    pub = Publisher(store, max_frame_bytes=64 << 10)
    pub.publish(states[0], version=1)
    sub = Subscriber(store, tensors={k: v.clone() for k, v in states[0].items()}, version=1)
    changed = {k: v.clone() for k, v in states[0].items()}
    name = "model.layers.1.mlp.up_proj.weight"
    changed[name].view(torch.int16).view(-1)[:100] ^= 1
    pub.publish(changed, version=2)
    counter = CountingStore(store)
    report = sub.sync()
    assert report.changed_elements == 100
    assert counter.fetched == report.payload_bytes < 2000 < report.dense_bytes // 1000
    assert same(changed, sub.tensors)


def test_poll_finds_a_version_committed_without_latest(
    store: Store, states: list[dict[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    pub = Publisher(store)
    sub = Subscriber(store)
    assert sub.latest() is None
    pub.publish(states[0], version=1)
    assert sub.latest() == 1
    monkeypatch.setattr(  # the publisher died between its commit and LATEST
        deltastore.publish.commit, "advance_latest", lambda store, version, body, **_: None
    )
    pub.publish(states[1], version=2)
    assert parse_latest(store.get(LATEST_KEY)).version == 1
    assert sub.latest() == 2  # LATEST is a hint: manifests after it are listed


def test_damaged_latest_is_ignored(store: Store, states: list[dict[str, torch.Tensor]]) -> None:
    pub = Publisher(store)
    pub.publish(states[0], version=1)
    pub.publish(states[1], version=2)
    store.put(
        LATEST_KEY, b'{"format_version":1,"version":9,"manifest":"x","sha256":"' + b"0" * 64 + b'"}'
    )
    assert Subscriber(store).latest() == 2
    store.put(LATEST_KEY, b"not json")
    assert Subscriber(store).latest() == 2


def test_latest_cas_never_moves_backwards_on_s3(
    s3_endpoint: str, states: list[dict[str, torch.Tensor]]
) -> None:
    store = s3(s3_endpoint)
    fast, slow = Publisher(store), Publisher(store)
    fast.publish(states[0], version=1)
    fast.publish(states[1], version=5)
    advance_latest(slow.store, 3, store.get(manifest_key(5)))  # a slow writer finishing late
    assert parse_latest(store.get(LATEST_KEY)).version == 5


class FlakyFS:
    """Proxy for an fsspec filesystem: a seeded share of calls fail before or after acting."""

    def __init__(
        self,
        inner: Any,
        rate: float,
        *,
        error: type[BaseException] = ConnectionError,
        seed: int = 0,
    ) -> None:
        self._inner, self._rate, self._error = inner, rate, error
        self._rng = random.Random(seed)
        self.calls = self.failures = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in {
            "cat_file",
            "pipe_file",
            "info",
            "find",
            "rm_file",
            "exists",
            "call_s3",
            "call",
        }:
            return attr

        def flaky(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            roll = self._rng.random()
            if roll < self._rate / 2:
                self.failures += 1
                raise self._error("injected failure before the request")
            out = attr(*args, **kwargs)
            if roll < self._rate:
                self.failures += 1
                raise self._error("injected failure after the request (response lost)")
            return out

        return flaky


@pytest.mark.parametrize("backend", ["s3", "gcs"])
def test_thirty_percent_transient_failures_still_bit_exact(
    request: pytest.FixtureRequest, backend: str, states: list[dict[str, torch.Tensor]]
) -> None:
    store = (
        s3(request.getfixturevalue("s3_endpoint"))
        if backend == "s3"
        else gcs(request.getfixturevalue("gcs_endpoint"))
    )
    store.retry = RetryPolicy(attempts=12, base_delay=0.001, max_delay=0.01)  # type: ignore[attr-defined]
    flaky = FlakyFS(store.fs, 0.3, seed=7)  # type: ignore[attr-defined]
    store.fs = flaky  # type: ignore[attr-defined]
    pub = Publisher(store, max_frame_bytes=256 << 10, max_object_bytes=1 << 20)
    sub = Subscriber(store, max_workers=2)
    for v, state in enumerate(states[:3], start=1):
        pub.publish(state, version=v)
        sub.sync()
        assert same(state, sub.tensors)
    assert flaky.failures > 20 and flaky.failures / flaky.calls > 0.2


def test_permanent_403_fails_fast(s3_endpoint: str, states: list[dict[str, torch.Tensor]]) -> None:
    store = s3(s3_endpoint)
    flaky = FlakyFS(store.fs, 2.0, error=PermissionError)  # every call fails first  # type: ignore[attr-defined]
    store.fs = flaky  # type: ignore[attr-defined]
    with pytest.raises(AccessDeniedError, match=r"access denied \(injected") as info:
        store.get("manifests/00000000000000000001.json")
    assert isinstance(info.value, StoreError)
    assert "manifests/00000000000000000001.json" in str(info.value)
    assert flaky.calls == 1  # not retried


def test_slow_publisher_losing_the_latest_cas_does_not_move_it_back(
    s3_endpoint: str, states: list[dict[str, torch.Tensor]]
) -> None:
    """The slow writer reads LATEST at v1, the fast one advances it to v3, the slow writer's
    If-Match then fails (412) and its retry sees v3 and leaves it."""
    from deltastore.errors import PreconditionFailedError

    shared = s3(s3_endpoint)
    fast = Publisher(shared)
    fast.publish(states[0], version=1)
    slow_store = s3(s3_endpoint)
    slow_store.root = shared.root  # type: ignore[attr-defined]
    slow = Publisher(slow_store)
    real = slow_store.put_if_match
    outcomes: list[str] = []

    def racing_put_if_match(key: str, data: bytes, token: str | None) -> None:
        if not outcomes:  # first attempt: the fast publisher commits v3 in between
            fast.publish(states[1], version=3)
        try:
            real(key, data, token)
            outcomes.append("wrote")
        except PreconditionFailedError:
            outcomes.append("lost")
            raise

    slow_store.put_if_match = racing_put_if_match  # type: ignore[method-assign]
    advance_latest(slow.store, 2, shared.get(manifest_key(1)))
    assert outcomes == ["lost"]  # the retry read v3 and did not write
    assert parse_latest(shared.get(LATEST_KEY)).version == 3


def test_zero_byte_exclusive_create_does_not_overwrite(s3_endpoint: str) -> None:
    from deltastore.errors import VersionExistsError

    store = s3(s3_endpoint)
    store.put_if_absent("manifests/empty", b"")
    with pytest.raises(VersionExistsError):
        store.put_if_absent("manifests/empty", b"")
    store.put_if_absent("manifests/full", b"data")
    with pytest.raises(VersionExistsError):
        store.put_if_absent("manifests/full", b"")
    assert store.get("manifests/full") == b"data"
