"""S3 (and S3-compatible services) through s3fs.

Commit: ``PutObject`` with ``If-None-Match: *`` (412 -> :class:`VersionExistsError`; 409
``ConditionalRequestConflict`` -> retried). ``LATEST``: ``PutObject`` with ``If-Match: <ETag>``.
Some S3-compatible servers ignore these headers; :meth:`S3Store.check_conditional_writes`
probes once (creates a probe key twice) and the publisher refuses to commit on a store that
failed the probe unless ``unsafe_commits=True`` was passed.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from deltastore.errors import PreconditionFailedError, StoreError, VersionExistsError
from deltastore.store.fsspec_store import FsspecStore, RetryPolicy

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


class S3Store(FsspecStore):
    """Store at ``s3://bucket/prefix``. ``storage_options`` go to ``s3fs.S3FileSystem``."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        unsafe_commits: bool = False,
    ) -> None:
        try:
            import s3fs
        except ImportError:
            raise StoreError(
                "s3:// stores need the s3 extra: pip install 'deltastore[s3]'"
            ) from None
        options = dict(storage_options or {})
        fs = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False, **options)
        root = url.split("://", 1)[1].strip("/")
        if not root:
            raise StoreError(f"{url}: an S3 store URL names a bucket: s3://bucket[/prefix]")
        super().__init__(url, fs, root, retry=retry)
        self.unsafe_commits = unsafe_commits

    def transient(self, exc: BaseException) -> bool:
        info = _client_error(exc)
        if info is not None:
            return info[0] in _TRANSIENT_CODES or info[1] in _TRANSIENT_STATUS
        return super().transient(exc)

    def _create(self, path: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            raise VersionExistsError(f"{path} already exists in store {self.url}") from None
        except OSError as exc:
            if _precondition_failed(exc):
                raise VersionExistsError(f"{path} already exists in store {self.url}") from None
            raise

    def _read_with_token(self, path: str) -> tuple[bytes, str]:
        # HEAD, GET, HEAD: the ETag names the bytes read only if it did not change meanwhile.
        for _ in range(5):
            before = self.fs.info(path, refresh=True)["ETag"]
            data = bytes(self.fs.cat_file(path))
            if self.fs.info(path, refresh=True)["ETag"] == before:
                return data, str(before)
        raise StoreError(f"{path} in store {self.url} keeps changing; try again")

    def _replace_if(self, path: str, data: bytes, token: str) -> None:
        try:
            self.fs.pipe_file(path, data, IfMatch=token)
        except OSError as exc:
            if _precondition_failed(exc):
                raise PreconditionFailedError(
                    f"{path} in store {self.url} changed since it was read; read it again"
                ) from None
            raise

    def list_after(self, prefix: str, start_after: str) -> list[str]:
        """``ListObjectsV2`` with ``StartAfter``: a poll costs one request, not a full listing."""
        bucket, _, root = self.root.partition("/")
        base = f"{root}/" if root else ""
        keys: list[str] = []
        token: str | None = None
        while True:
            args: dict[str, Any] = {
                "Bucket": bucket,
                "Prefix": base + prefix,
                "StartAfter": base + start_after,
            }
            if token:
                args["ContinuationToken"] = token
            page: dict[str, Any] = self._call(
                "list", prefix, partial(self.fs.call_s3, "list_objects_v2", **args)
            )
            keys += [o["Key"][len(base) :] for o in page.get("Contents", [])]
            token = page.get("NextContinuationToken")
            if not token:
                return sorted(k for k in keys if not any(s.startswith(".") for s in k.split("/")))
