"""A store conformance suite: every backend's test class subclasses :class:`StoreTests`
and provides a ``store`` fixture yielding an empty store."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from deltastore.errors import (
    InvalidKeyError,
    ObjectNotFoundError,
    PreconditionFailedError,
    VersionExistsError,
)
from deltastore.store import Store

BAD_KEYS = [
    "",
    "/abs/path",
    "../escape",
    "a/../../b",
    "a/./b",
    "a//b",
    "a/",
    "a\\b",
    "a\x00b",
    "s3://other-bucket/key",
    "file:///etc/passwd",
    ".hidden",
    "a/.tmp-x",
    "a b",
    "x" * 2000,
]


def race(n: int, fn: Callable[[int], object]) -> list[object]:
    """Run ``fn(i)`` for i in range(n) on n threads released together; results or exceptions."""
    barrier = threading.Barrier(n)

    def go(i: int) -> object:
        barrier.wait()
        try:
            return fn(i)
        except Exception as exc:  # the test inspects what each writer got
            return exc

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(go, range(n)))


class StoreTests:
    """Behaviour every :class:`Store` must have."""

    def test_put_get_roundtrip_and_replace(self, store: Store) -> None:
        store.put("a/b/c.bin", b"hello")
        assert store.get("a/b/c.bin") == b"hello"
        store.put("a/b/c.bin", b"bye")
        assert store.get("a/b/c.bin") == b"bye"
        store.put("empty", b"")
        assert store.get("empty") == b""

    def test_missing_keys(self, store: Store) -> None:
        with pytest.raises(ObjectNotFoundError):
            store.get("nope")
        with pytest.raises(FileNotFoundError):
            store.get_range("nope", 0, 1)
        with pytest.raises(ObjectNotFoundError):
            store.delete("nope")
        assert store.get_with_token("nope") is None
        assert not store.exists("nope")

    def test_get_range(self, store: Store) -> None:
        data = bytes(range(256)) * 4
        store.put("r", data)
        assert store.get_range("r", 10, 20) == data[10:30]
        assert store.get_range("r", 0, len(data)) == data
        assert store.get_range("r", len(data) - 5, 100) == data[-5:]  # short: object ends
        assert store.get_range("r", 3, 0) == b""

    def test_large_object(self, store: Store) -> None:
        data = bytes(range(251)) * (40 << 10)  # ~10 MB, not a multiple of any part size
        store.put("big/object", data)
        assert store.get("big/object") == data
        assert store.get_range("big/object", 7_000_001, 1234) == data[7_000_001:7_001_235]

    def test_put_if_absent(self, store: Store) -> None:
        store.put_if_absent("m/1.json", b"first")
        with pytest.raises(VersionExistsError):
            store.put_if_absent("m/1.json", b"second")
        with pytest.raises(FileExistsError):
            store.put_if_absent("m/1.json", b"third")
        assert store.get("m/1.json") == b"first"

    def test_put_if_absent_race_has_one_winner(self, store: Store) -> None:
        results = race(12, lambda i: store.put_if_absent("m/race.json", f"writer-{i}".encode()))
        winners = [i for i, r in enumerate(results) if r is None]
        assert len(winners) == 1
        assert all(isinstance(r, VersionExistsError) for r in results if r is not None)
        assert store.get("m/race.json") == f"writer-{winners[0]}".encode()

    def test_compare_and_swap(self, store: Store) -> None:
        store.put_if_match("L", b"v1", None)
        with pytest.raises(PreconditionFailedError):
            store.put_if_match("L", b"again", None)
        current = store.get_with_token("L")
        assert current is not None and current[0] == b"v1"
        store.put_if_match("L", b"v2", current[1])
        with pytest.raises(PreconditionFailedError):
            store.put_if_match("L", b"v3", current[1])  # stale token
        assert store.get("L") == b"v2"

    def test_compare_and_swap_loses_no_update(self, store: Store) -> None:
        store.put("counter", b"0")

        def increment(_: int) -> None:
            while True:
                data, token = store.get_with_token("counter") or (b"", None)
                try:
                    store.put_if_match("counter", str(int(data) + 1).encode(), token)
                    return
                except PreconditionFailedError:
                    continue

        results = race(8, increment)
        assert results == [None] * 8
        assert store.get("counter") == b"8"

    def test_list(self, store: Store) -> None:
        assert store.list() == []
        assert store.list("manifests/") == []
        for key in ("manifests/2.json", "manifests/1.json", "versions/1/a.dsz", "LATEST"):
            store.put(key, b"x")
        assert store.list("manifests/") == ["manifests/1.json", "manifests/2.json"]
        assert store.list() == sorted(
            ["LATEST", "manifests/1.json", "manifests/2.json", "versions/1/a.dsz"]
        )
        assert store.list("versions/") == ["versions/1/a.dsz"]

    def test_delete(self, store: Store) -> None:
        store.put("d/x", b"1")
        store.delete("d/x")
        assert not store.exists("d/x")
        assert store.list("d/") == []

    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_invalid_keys_are_refused(self, store: Store, key: str) -> None:
        for op in (
            lambda: store.get(key),
            lambda: store.get_range(key, 0, 1),
            lambda: store.put(key, b"x"),
            lambda: store.put_if_absent(key, b"x"),
            lambda: store.put_if_match(key, b"x", None),
            lambda: store.delete(key),
        ):
            with pytest.raises(InvalidKeyError):
                op()

    def test_concurrent_writers_to_distinct_keys(self, store: Store) -> None:
        results = race(16, lambda i: store.put(f"many/{i:03d}", bytes([i]) * (1000 + i)))
        assert results == [None] * 16
        assert store.list("many/") == [f"many/{i:03d}" for i in range(16)]
        for i in range(16):
            assert store.get(f"many/{i:03d}") == bytes([i]) * (1000 + i)
