"""GCSStore against gcp-storage-emulator over HTTP: the conformance suite and GCS's commit rules.

The emulator ignores every generation precondition (``ifGenerationMatch``), so the tests that
prove exclusivity or compare-and-swap are skipped here (they run against the local store), the
store is opened with ``unsafe_commits=True``, and a test shows the probe refuses the emulator.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")

from deltastore.errors import ObjectNotFoundError, StoreError
from deltastore.store import open_store
from deltastore.store.gcs import GCSStore
from deltastore.testing.conformance import StoreTests
from tests.servers import gcs_emulator

EMULATOR_IGNORES_PRECONDITIONS = (
    "gcp-storage-emulator ignores ifGenerationMatch preconditions, so exclusivity and "
    "compare-and-swap cannot be tested against it; they run against the local store"
)


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with gcs_emulator() as url:
        yield url


def options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "token": "anon", "project": "test"}


@pytest.fixture(scope="module")
def bucket(endpoint: str) -> str:
    from gcsfs.core import GCSFileSystem

    name = f"deltastore-{uuid.uuid4().hex[:12]}"
    GCSFileSystem(skip_instance_cache=True, **options(endpoint)).mkdir(name)
    return name


def gcs_store(endpoint: str, bucket: str, *, unsafe_commits: bool = True) -> GCSStore:
    return GCSStore(
        f"gs://{bucket}/{uuid.uuid4().hex[:8]}", options(endpoint), unsafe_commits=unsafe_commits
    )


class TestGCSStore(StoreTests):
    @pytest.fixture
    def store(self, endpoint: str, bucket: str) -> GCSStore:
        return gcs_store(endpoint, bucket)

    @pytest.mark.skip(reason=EMULATOR_IGNORES_PRECONDITIONS)
    def test_put_if_absent(self, store: GCSStore) -> None:  # type: ignore[override]
        raise AssertionError("not run")

    @pytest.mark.skip(reason=EMULATOR_IGNORES_PRECONDITIONS)
    def test_put_if_absent_race_has_one_winner(self, store: GCSStore) -> None:  # type: ignore[override]
        raise AssertionError("not run")

    @pytest.mark.skip(reason=EMULATOR_IGNORES_PRECONDITIONS)
    def test_compare_and_swap(self, store: GCSStore) -> None:  # type: ignore[override]
        raise AssertionError("not run")

    @pytest.mark.skip(reason=EMULATOR_IGNORES_PRECONDITIONS)
    def test_compare_and_swap_loses_no_update(self, store: GCSStore) -> None:  # type: ignore[override]
        raise AssertionError("not run")


def test_open_store_picks_gcs(endpoint: str, bucket: str) -> None:
    for scheme in ("gs", "gcs"):
        store = open_store(f"{scheme}://{bucket}/x", options(endpoint))
        assert isinstance(store, GCSStore)
        assert store.root == f"{bucket}/x"


def test_probe_refuses_the_emulator(endpoint: str, bucket: str) -> None:
    store = gcs_store(endpoint, bucket, unsafe_commits=False)
    with pytest.raises(StoreError, match="ignores ifGenerationMatch"):
        store.check_conditional_writes()
    assert store.list() == []  # the probe key is removed
    store.unsafe_commits = True
    assert store.check_conditional_writes() is False


def test_conditional_uploads_send_if_generation_match(
    endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the emulator cannot enforce, the requests must still ask for."""
    store = gcs_store(endpoint, bucket)
    sent: list[dict[str, Any]] = []
    call = store.fs.call

    def spy(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        if method == "POST":
            sent.append({"path": path, **kwargs})
        return call(method, path, *args, **kwargs)

    monkeypatch.setattr(store.fs, "call", spy)
    store.put_if_absent("m/1.json", b"first")
    current = store.get_with_token("m/1.json")
    assert current is not None and current[0] == b"first"
    store.put_if_match("m/1.json", b"second", current[1])
    assert [s["ifGenerationMatch"] for s in sent] == ["0", current[1]]
    assert all(s["uploadType"] == "media" and "/upload/storage/v1/b/" in s["path"] for s in sent)
    assert sent[0]["name"] == store.root.split("/", 1)[1] + "/m/1.json"


def test_412_maps_to_typed_errors(
    endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service that enforces preconditions answers 412; gcsfs raises FileExistsError."""
    from deltastore.errors import PreconditionFailedError, VersionExistsError

    store = gcs_store(endpoint, bucket)
    store.put("L", b"v1")

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise FileExistsError("412 Precondition Failed")

    monkeypatch.setattr(store.fs, "call", refuse)
    with pytest.raises(VersionExistsError):
        store.put_if_absent("L", b"v2")
    with pytest.raises(PreconditionFailedError):
        store.put_if_match("L", b"v2", None)
    with pytest.raises(PreconditionFailedError):
        store.put_if_match("L", b"v2", "123")


def test_ambiguous_commit_is_resolved_by_reading_back(
    endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upload lands but its answer is lost; the retry gets 412; the read-back says won."""
    store = gcs_store(endpoint, bucket)
    upload = store._upload
    attempts: list[str] = []

    def flaky(path: str, data: bytes, generation: str) -> None:
        attempts.append(generation)
        if len(attempts) == 1:
            upload(path, data, generation)
            raise ConnectionResetError("connection reset after sending")
        raise FileExistsError("412 Precondition Failed")  # what real GCS answers now

    monkeypatch.setattr(store, "_upload", flaky)
    store.put_if_absent("m/7.json", b"mine")  # no VersionExistsError: this writer won
    assert store.get("m/7.json") == b"mine"

    attempts.clear()
    token = store.get_with_token("m/7.json")
    assert token is not None
    store.put_if_match("m/7.json", b"next", token[1])  # CAS resolved the same way
    assert store.get("m/7.json") == b"next"
    assert len(attempts) == 2


def test_missing_objects(endpoint: str, bucket: str) -> None:
    store = gcs_store(endpoint, bucket)
    with pytest.raises(ObjectNotFoundError, match="nope"):
        store.get("nope")
    with pytest.raises(ObjectNotFoundError):
        store.get_range("nope", 0, 10)
    with pytest.raises(ObjectNotFoundError):
        store.delete("nope")
    assert store.get_with_token("nope") is None
    assert store.head_token("nope") is None


def test_tokens_are_generations(endpoint: str, bucket: str) -> None:
    store = gcs_store(endpoint, bucket)
    store.put("L", b"v1")
    first = store.get_with_token("L")
    assert first is not None and first[0] == b"v1"
    assert first[1].isdigit()
    assert store.head_token("L") == first[1]
    store.put("L", b"v2")
    second = store.get_with_token("L")
    assert second is not None and second[0] == b"v2" and second[1] != first[1]


def test_token_from_the_download_response(
    endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real GCS sends x-goog-generation with the bytes: one GET, no metadata requests."""
    store = gcs_store(endpoint, bucket)
    store.put("L", b"v1")
    calls: list[str] = []
    call = store.fs.call

    def with_header(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(path)
        from multidict import CIMultiDict  # aiohttp's case-insensitive headers

        headers, body = call(method, path, *args, **kwargs)
        return CIMultiDict({**headers, "X-Goog-Generation": "42"}), body

    monkeypatch.setattr(store.fs, "call", with_header)
    assert store.get_with_token("L") == (b"v1", "42")
    assert len(calls) == 1 and "alt=media" in calls[0]


def test_range_reads(endpoint: str, bucket: str) -> None:
    store = gcs_store(endpoint, bucket)
    data = bytes(range(256)) * 64
    store.put("frames.dsz", data)
    for start, length in [(0, 1), (1000, 3000), (len(data) - 7, 7), (len(data) - 7, 1000)]:
        assert store.get_range("frames.dsz", start, length) == data[start : start + length]


def test_bytes_survive_exactly(endpoint: str, bucket: str) -> None:
    """Every write path keeps every byte (gcsfs's multipart upload through the emulator drops
    a trailing ``\\r``; the store uploads media, or resumable from 50 MiB)."""
    from deltastore.store.gcs import SINGLE_REQUEST_MAX

    store = gcs_store(endpoint, bucket)
    for i, data in enumerate((b"", b"\r", b"x\r", b"\r\n", b"--==0==--\r\n", bytes(range(256)))):
        store.put("p", data)
        assert store.get("p") == data
        store.put_if_absent(f"c/{i}", data)
        assert store.get(f"c/{i}") == data
    big = bytes(range(256)) * (SINGLE_REQUEST_MAX // 256) + b"\r"
    store.put("big", big)
    assert store.get("big") == big


def test_listing(endpoint: str, bucket: str) -> None:
    store = gcs_store(endpoint, bucket)
    other = gcs_store(endpoint, bucket)  # another prefix of the same bucket
    other.put("manifests/00000000000000000009.json", b"x")
    keys = [f"manifests/{v:020d}.json" for v in (1, 2, 3, 10)] + ["LATEST", "versions/1/a.dsz"]
    for key in keys:
        store.put(key, b"x")
    assert store.list() == sorted(keys)
    assert store.list("manifests/") == sorted(k for k in keys if k.startswith("manifests/"))
    after = store.list_after("manifests/", "manifests/00000000000000000002.json")
    assert after == ["manifests/00000000000000000003.json", "manifests/00000000000000000010.json"]
    assert store.list_after("manifests/", "manifests/00000000000000000010.json") == []
    assert store.list_after("nothing/", "nothing/a") == []


def test_permanent_errors_fail_fast(
    endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = gcs_store(endpoint, bucket)
    calls: list[str] = []

    def forbidden(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(method)
        raise OSError(f"Forbidden: {path}\nanonymous caller does not have storage.objects.create")

    monkeypatch.setattr(store.fs, "call", forbidden)
    with pytest.raises(StoreError, match=r"put_if_absent m/1.json .*Forbidden"):
        store.put_if_absent("m/1.json", b"x")
    assert calls == ["POST"]  # not retried


def test_missing_bucket_is_named_not_an_empty_store(endpoint: str) -> None:
    from deltastore.errors import BucketNotFoundError

    bucket = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    store = GCSStore(f"gs://{bucket}/p", options(endpoint), unsafe_commits=True)
    for op in (
        lambda: store.get("k"),
        lambda: store.list(),
        lambda: store.list_after("manifests/", "manifests/1"),
        lambda: store.head_token("LATEST"),
        lambda: store.put("k", b"v"),
        lambda: store.put_if_absent("m/1.json", b"v"),
    ):
        with pytest.raises(BucketNotFoundError, match=f"bucket '{bucket}' .* does not exist"):
            op()


def test_an_empty_bucket_is_an_empty_store(endpoint: str, bucket: str) -> None:
    store = gcs_store(endpoint, bucket)
    assert store.list() == [] and store.list_after("manifests/", "manifests/1") == []
    with pytest.raises(ObjectNotFoundError):
        store.get("k")


def test_transient_errors_are_retried(endpoint: str, bucket: str) -> None:
    from gcsfs.retry import HttpError

    store = gcs_store(endpoint, bucket)
    assert store.transient(HttpError({"code": 503, "message": "backend error"}))
    assert store.transient(HttpError({"code": 429, "message": "rate limit"}))
    assert store.transient(TimeoutError())
    assert not store.transient(HttpError({"code": 400, "message": "bad"}))
    assert not store.transient(FileExistsError("412"))
    assert not store.transient(FileNotFoundError("404"))
    assert not store.transient(OSError("Forbidden: 403"))


def test_gcsfs_does_not_retry_inside_a_request(endpoint: str, bucket: str) -> None:
    """Only RetryPolicy retries; gcsfs's nested retries would hide an ambiguous commit."""
    store = gcs_store(endpoint, bucket)
    assert store.fs._request.__func__ is type(store.fs)._request.__wrapped__


def test_bucket_is_required() -> None:
    with pytest.raises(StoreError, match="bucket"):
        GCSStore("gs://", {"token": "anon"})
