"""S3Store against a moto server over HTTP: the conformance suite and S3's commit rules."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from deltastore.errors import StoreError, VersionExistsError
from deltastore.store import open_store
from deltastore.store.s3 import S3Store
from deltastore.testing.conformance import StoreTests
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


def test_timeouts_and_retries_are_deltastores(endpoint: str, bucket: str) -> None:
    """botocore and s3fs retry nothing (RetryPolicy does); ``timeout`` caps the per-request
    connect and read timeouts and replaces the policy's total."""
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

    store = S3Store(f"s3://{bucket}/t", {**CREDENTIALS, "endpoint_url": endpoint, "timeout": 2})
    assert store.fs.retries == 1
    config = store.fs.config_kwargs
    assert config["retries"] == {"total_max_attempts": 1, "mode": "standard"}
    assert (config["connect_timeout"], config["read_timeout"]) == (2, 2)
    assert store.retry.total_seconds == 2
    assert store.list() == []  # the client works with that config
    default = s3_store(endpoint, bucket)
    assert (default.fs.config_kwargs["connect_timeout"], default.retry.total_seconds) == (5, 120)
    for exc in (
        EndpointConnectionError(endpoint_url=endpoint),
        ConnectTimeoutError(endpoint_url=endpoint),
        ReadTimeoutError(endpoint_url=endpoint),
    ):
        assert store.transient(exc), exc


def test_missing_bucket_is_named_without_an_extra_request(endpoint: str) -> None:
    """``NoSuchBucket`` says it: no HeadBucket is needed to tell it from a missing key."""
    from deltastore.errors import BucketNotFoundError

    name = f"no-such-bucket-{uuid.uuid4().hex[:8]}"
    store = S3Store(f"s3://{name}/p", {**CREDENTIALS, "endpoint_url": endpoint})
    store._bucket_exists = lambda: pytest.fail("not needed")  # type: ignore[method-assign]
    for op in (lambda: store.put("k", b"v"), lambda: store.get("k")):
        with pytest.raises(BucketNotFoundError, match=f"bucket '{name}'"):
            op()
