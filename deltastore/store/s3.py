"""S3 (and S3-compatible services) through s3fs.

Commit: ``PutObject`` with ``If-None-Match: *`` (412 -> :class:`VersionExistsError`; 409
``ConditionalRequestConflict`` -> retried). ``LATEST``: ``PutObject`` with ``If-Match: <ETag>``.
Some S3-compatible servers ignore these headers; :meth:`S3Store.check_conditional_writes`
probes once (creates a probe key twice) and the publisher refuses to commit on a store that
failed the probe unless ``unsafe_commits=True`` was passed.

Retries: :class:`RetryPolicy` is the only retry layer. s3fs's own retry loop and botocore's
retries are turned off (they added 7-17 s of silent retries before an unreachable endpoint
was reported); botocore's connect and read timeouts are capped by the store's ``timeout``.
A missing bucket (``NoSuchBucket``) raises :class:`BucketNotFoundError`.
"""

from __future__ import annotations

import builtins
from functools import partial
from typing import Any

from fsspec.asyn import sync

from deltastore.errors import PreconditionFailedError, StoreError, VersionExistsError
from deltastore.store.base import split_options, validate_key
from deltastore.store.fsspec_store import (
    FsspecStore,
    RetryPolicy,
    listed_keys,
    request_timeouts,
)

_TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
    "ConditionalRequestConflict",
}
_TRANSIENT_STATUS = {409, 429, 500, 502, 503, 504}


def _client_error(exc: BaseException) -> tuple[str, int] | None:
    """(error code, HTTP status) of the botocore ClientError behind an s3fs error (followed
    through ``__cause__`` only: an unrelated error being handled is not a cause)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            err = response.get("Error", {})
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return str(err.get("Code", "")), int(status or 0)
        cur = cur.__cause__
    return None


def _precondition_failed(exc: BaseException) -> bool:
    info = _client_error(exc)
    if info is not None:
        return info[0] == "PreconditionFailed" or info[1] == 412
    return "pre-condition" in str(exc) or "precondition" in str(exc).lower()


def _botocore_config(options: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """``config_kwargs`` for botocore: no retries of its own (``RetryPolicy`` retries), connect
    and read timeouts (s3fs's defaults, 5 s and 15 s) capped by ``timeout``; what the caller
    gave in ``config_kwargs`` is kept, its timeouts capped too."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    connect, read = request_timeouts(
        timeout, config.get("connect_timeout", 5.0), config.get("read_timeout", 15.0)
    )
    config["connect_timeout"], config["read_timeout"] = connect, read
    return config


class S3Store(FsspecStore):
    """Store at ``s3://bucket/prefix``. ``storage_options`` go to ``s3fs.S3FileSystem``
    (``key``, ``secret``, ``token``, ``profile``, ``endpoint_url``, ``client_kwargs``...),
    except deltastore's own ``timeout`` and ``unsafe_commits``."""

    consistent_listing = True  # strongly consistent listings

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        unsafe_commits: bool = False,
        timeout: float | None = None,
    ) -> None:
        try:
            import s3fs
        except ImportError:
            raise StoreError(
                "s3:// stores need the s3 extra: pip install 'deltastore[s3]'"
            ) from None
        options, timeout, unsafe_commits = split_options(
            storage_options, timeout=timeout, unsafe_commits=unsafe_commits
        )
        options["config_kwargs"] = _botocore_config(options, timeout)
        fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **options)
        fs.retries = 1  # s3fs's own retry loop: one attempt (RetryPolicy retries)
        root = url.split("://", 1)[1].strip("/")
        if not root:
            raise StoreError(f"{url}: an S3 store URL names a bucket: s3://bucket[/prefix]")
        super().__init__(url, fs, root, retry=retry, unsafe_commits=unsafe_commits, timeout=timeout)

    def transient(self, exc: BaseException) -> bool:
        """Throttling and 5xx answers, 409 ``ConditionalRequestConflict``, and what s3fs
        itself would retry: connection errors and timeouts (botocore's included), truncated
        or unparsable responses."""
        info = _client_error(exc)
        if info is not None:
            return info[0] in _TRANSIENT_CODES or info[1] in _TRANSIENT_STATUS
        from s3fs.core import S3_RETRYABLE_ERRORS

        if isinstance(exc, S3_RETRYABLE_ERRORS):
            return True
        from botocore.exceptions import (  # type: ignore[import-untyped]
            ConnectionError as BotocoreConnectionError,
        )

        if isinstance(exc, BotocoreConnectionError):  # EndpointConnectionError, timeouts
            return True
        return super().transient(exc)

    def _says_bucket_missing(self, exc: BaseException) -> bool:
        info = _client_error(exc)
        return info is not None and info[0] == "NoSuchBucket"

    def _bucket_exists(self) -> bool | None:
        """``HeadBucket``: 404 -> False; 403 (exists, not ours to HEAD) -> True."""
        try:
            self.fs.call_s3("head_bucket", Bucket=self.bucket)
        except FileNotFoundError:
            return False
        except PermissionError:
            return True
        return True

    def _create(self, path: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            raise VersionExistsError(f"{path} already exists in store {self.url}") from None
        except OSError as exc:
            if _precondition_failed(exc):
                raise VersionExistsError(f"{path} already exists in store {self.url}") from None
            raise

    def get(self, key: str) -> bytes:
        """One ``GetObject`` (s3fs's own ``cat_file`` sends a ``HeadObject`` first, to decide
        whether to read in concurrent ranges)."""
        path = self._path(key)
        return self._call("get", key, lambda: self._get_object(path)[0])

    def _read_with_token(self, path: str) -> tuple[bytes, str]:
        """One ``GetObject``: the bytes and the ETag of exactly those bytes come in the same
        response."""
        return self._get_object(path)

    def _get_object(self, path: str) -> tuple[bytes, str]:
        """The object's bytes and ETag from one ``GetObject`` (s3fs translates the service's
        errors: a missing key is a ``FileNotFoundError``); the body is read on s3fs's loop."""
        bucket, key, _ = self.fs.split_path(path)
        resp = self.fs.call_s3("get_object", Bucket=bucket, Key=key)
        body = resp["Body"]
        try:
            data: bytes = sync(self.fs.loop, body.read)  # one buffer, not copied again
        finally:
            body.close()
        return data, str(resp["ETag"])

    def _replace_if(self, path: str, data: bytes, token: str) -> None:
        try:
            self.fs.pipe_file(path, data, IfMatch=token)
        except OSError as exc:
            if _precondition_failed(exc):
                raise PreconditionFailedError(
                    f"{path} in store {self.url} changed since it was read; read it again"
                ) from None
            raise

    def list(self, prefix: str = "") -> builtins.list[str]:
        """``ListObjectsV2`` pages (s3fs's ``find`` adds a ``HeadObject`` and a delimited
        listing to tell a folder from a file)."""
        keys = self._list_objects(prefix, None)
        if not keys:  # an empty store, or no bucket at all
            self._raise_if_bucket_missing(None, probe=True)
        return keys

    def list_after(self, prefix: str, start_after: str) -> builtins.list[str]:
        """``ListObjectsV2`` with ``StartAfter``: a poll costs one request, not a full listing."""
        return self._list_objects(prefix, start_after)

    def _list_objects(self, prefix: str, start_after: str | None) -> builtins.list[str]:
        """Sorted keys under ``prefix`` (after ``start_after``), one request per 1,000 keys."""
        if prefix:
            validate_key(prefix.rstrip("/"))
        bucket, _, root = self.root.partition("/")
        base = f"{root}/" if root else ""
        keys: builtins.list[str] = []
        token: str | None = None
        while True:
            args: dict[str, Any] = {"Bucket": bucket, "Prefix": base + prefix}
            if start_after is not None:
                args["StartAfter"] = base + start_after
            if token:
                args["ContinuationToken"] = token
            page: dict[str, Any] = self._call(
                "list", prefix or "/", partial(self.fs.call_s3, "list_objects_v2", **args)
            )
            keys += [o["Key"][len(base) :] for o in page.get("Contents", [])]
            token = page.get("NextContinuationToken")
            if not token:
                return listed_keys(keys, prefix)
