"""S3Store against a moto server over HTTP: the conformance suite and S3's commit rules."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from deltastore.errors import StoreError, VersionExistsError
from deltastore.store import open_store
from deltastore.store.s3 import S3Store
from tests.conformance import StoreTests
from tests.servers import moto_server

pytest.importorskip("s3fs")

CREDENTIALS = {"key": "testing", "secret": "testing"}


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_server() as url:
        yield url


@pytest.fixture(scope="module")
def bucket(endpoint: str) -> str:
    import boto3

    name = f"deltastore-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=name)
    return name


def s3_store(endpoint: str, bucket: str) -> S3Store:
    options = {**CREDENTIALS, "endpoint_url": endpoint}
    store = open_store(f"s3://{bucket}/{uuid.uuid4().hex[:8]}", options)
    assert isinstance(store, S3Store)
    return store


class TestS3Store(StoreTests):
    @pytest.fixture
    def store(self, endpoint: str, bucket: str) -> S3Store:
        return s3_store(endpoint, bucket)

    @pytest.mark.skip(
        reason="moto's If-None-Match check is not atomic under contention; "
        "exclusivity races run against the local store (see docs/stores.md)"
    )
    def test_put_if_absent_race_has_one_winner(self, store: S3Store) -> None:  # type: ignore[override]
        raise AssertionError("not run")

    @pytest.mark.skip(reason="moto's If-Match check is not atomic under contention")
    def test_compare_and_swap_loses_no_update(self, store: S3Store) -> None:  # type: ignore[override]
        raise AssertionError("not run")


def test_second_writer_gets_version_exists(endpoint: str, bucket: str) -> None:
    a, b = s3_store(endpoint, bucket), None
    b = S3Store(a.url, {**CREDENTIALS, "endpoint_url": endpoint})
    a.put_if_absent("manifests/00000000000000000001.json", b"writer a")
    with pytest.raises(VersionExistsError):
        b.put_if_absent("manifests/00000000000000000001.json", b"writer b")
    assert b.get("manifests/00000000000000000001.json") == b"writer a"


def test_probe_accepts_moto(endpoint: str, bucket: str) -> None:
    assert s3_store(endpoint, bucket).check_conditional_writes() is True


def test_probe_refuses_a_server_that_ignores_if_none_match(
    endpoint: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = s3_store(endpoint, bucket)
    monkeypatch.setattr(store, "_create", lambda path, data: store.fs.pipe_file(path, data))
    with pytest.raises(StoreError, match="If-None-Match"):
        store.check_conditional_writes()
    store.unsafe_commits = True
    assert store.check_conditional_writes() is False


def test_permanent_errors_fail_fast(endpoint: str, bucket: str) -> None:
    store = S3Store(
        f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}", {**CREDENTIALS, "endpoint_url": endpoint}
    )
    with pytest.raises(StoreError):
        store.put("k", b"v")


def test_bucket_is_required() -> None:
    with pytest.raises(StoreError, match="bucket"):
        S3Store("s3://", CREDENTIALS)


def test_large_objects_go_multipart_and_failed_exclusive_uploads_are_aborted(
    endpoint: str, bucket: str
) -> None:
    """Above 2 x 50 MiB s3fs uploads in parts; an exclusive multipart upload that loses must
    not leave its parts behind (they would be billed and never cleaned up)."""
    import boto3

    store = s3_store(endpoint, bucket)
    data = bytes(range(256)) * ((101 << 20) // 256)
    store.put("big/object", data)
    assert store.get_range("big/object", 77 << 20, 1000) == data[77 << 20 : (77 << 20) + 1000]
    store.put_if_absent("big/manifest", data)
    with pytest.raises(VersionExistsError):
        store.put_if_absent("big/manifest", data[::-1])
    assert store.get_range("big/manifest", 0, 16) == data[:16]
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
    assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
