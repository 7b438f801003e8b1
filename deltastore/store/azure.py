"""Azure Blob Storage through adlfs (and the Azure SDK it is built on).

URL: ``az://container/prefix`` (also ``abfs://`` and ``abfss://``, including the
``abfs://container@account.dfs.core.windows.net/prefix`` form, which supplies the account
name). ``storage_options`` go to ``adlfs.AzureBlobFileSystem``: ``connection_string``,
``account_name`` with ``account_key`` / ``sas_token`` / ``credential``, ``account_host``...

Guarantees:

* Commit (:meth:`put_if_absent`): Put Blob with ``If-None-Match: *``; the service answers 409
  ``BlobAlreadyExists`` to every writer but one (-> :class:`VersionExistsError`). Azure Blob
  Storage and Azurite both enforce it atomically. The SDK's own retries are off (and off for
  this request in particular) so that an ambiguous attempt (timeout, connection reset) reaches
  :class:`FsspecStore`'s retry loop, which reads the object back to learn whether it won,
  instead of the SDK's retry reporting the writer's own blob as another writer's.
* ``LATEST`` (:meth:`put_if_match`): Put Blob with ``If-Match: <ETag>`` (412
  ``ConditionNotMet`` -> :class:`PreconditionFailedError`); :meth:`get_with_token` returns the
  ETag of the very response that carried the bytes (a chunked download pins it with If-Match).
* Reads: ranged Get Blob; no fsspec instance or listing cache, so a poller never sees stale
  state. :meth:`check_conditional_writes` probes once that the service enforces
  ``If-None-Match`` (an Azure-compatible server that ignored it would let two writers commit
  the same version) and raises :class:`StoreError` if it does not.

Retries: 429 and 5xx responses, connection errors and timeouts are retried with the store's
:class:`RetryPolicy`, the only retry layer: the SDK's own retries (15-80 s backoffs) are off.
With a ``timeout``, the SDK's ``connection_timeout`` and ``read_timeout`` are capped by it.

A container that does not exist (``ContainerNotFound``) raises :class:`BucketNotFoundError`.
``unsafe_commits`` is accepted as on S3 and GCS; Azure Blob Storage and Azurite enforce the
preconditions, so there it changes nothing.

Thread-safe: adlfs runs its async Azure client on fsspec's event-loop thread; every call here,
from any thread, is submitted to that loop and waited for.
"""

from __future__ import annotations

import asyncio
import builtins
import re
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from deltastore.errors import (
    DeltastoreError,
    PreconditionFailedError,
    StoreError,
    VersionExistsError,
)
from deltastore.store.base import split_options, validate_key
from deltastore.store.fsspec_store import (
    FsspecStore,
    RetryPolicy,
    listed_keys,
    request_timeouts,
)

T = TypeVar("T")

_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
# Container names: 3-63 lowercase letters, digits and single hyphens, starting and ending
# with a letter or digit.
_CONTAINER = re.compile(r"[a-z0-9](?:[a-z0-9]|-(?=[a-z0-9])){2,62}")
# The directory marker adlfs writes on its own uploads; kept so adlfs lists our blobs alike.
_FILE_METADATA = {"is_directory": "false"}


def _http_error(exc: BaseException) -> Any:
    """The azure-core ``HttpResponseError`` behind ``exc`` (adlfs re-raises some), or None.

    The chain stops at deltastore's own errors: an error raised while one of those was being
    handled (a read-back after a lost precondition) is not caused by the HTTP error below it."""
    from azure.core.exceptions import HttpResponseError

    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, HttpResponseError):
            return cur
        cur = cur.__cause__ or cur.__context__
        if isinstance(cur, DeltastoreError):
            return None
    return None


def _disable_sdk_retries(fs: Any) -> None:
    """Make the store's :class:`RetryPolicy` the only retry layer.

    The Azure SDK's default policy retries 3 times with 15-80 s backoffs, below and on top of
    ours: a refused connection took 82 s per attempt here, so ``RetryPolicy.total_seconds``
    could not bound anything. Every client adlfs makes (``get_blob_client``, ...) shares the
    service client's policy object. SDKs without that attribute keep their own retries."""
    policy = getattr(getattr(fs.service_client, "_config", None), "retry_policy", None)
    for name in ("total_retries", "connect_retries", "read_retries", "status_retries"):
        if isinstance(getattr(policy, name, None), int):
            setattr(policy, name, 0)


class AzureStore(FsspecStore):
    """Store at ``az://container/prefix``. ``storage_options`` go to
    ``adlfs.AzureBlobFileSystem`` (``account_name``, ``account_key``, ``connection_string``,
    ``sas_token``, ``credential``...), except deltastore's own ``timeout`` and
    ``unsafe_commits``. The container must exist."""

    consistent_listing = True  # strongly consistent listings

    bucket_kind = "container"

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
            import adlfs
        except ImportError:
            raise StoreError(
                "az:// stores need the azure extra: pip install 'deltastore[azure]'"
            ) from None
        options, timeout, unsafe_commits = split_options(
            storage_options, timeout=timeout, unsafe_commits=unsafe_commits
        )
        if timeout is not None:
            connect, read = request_timeouts(
                timeout,
                options.get("connection_timeout") or 20.0,
                options.get("read_timeout") or 60.0,
            )
            options["connection_timeout"], options["read_timeout"] = connect, read
        for name, value in adlfs.AzureBlobFileSystem._get_kwargs_from_urls(url).items():
            options.setdefault(name, value)
        root = adlfs.AzureBlobFileSystem._strip_protocol(url).split("?", 1)[0].strip("/")
        container = root.split("/", 1)[0]
        if not container:
            raise StoreError(
                f"{url}: an Azure store URL names a container: az://container[/prefix]"
            )
        if not _CONTAINER.fullmatch(container):
            raise StoreError(
                f"{url}: invalid Azure container name {container!r}: 3-63 lowercase letters, "
                "digits and single hyphens, starting and ending with a letter or digit"
            )
        fs = adlfs.AzureBlobFileSystem(
            skip_instance_cache=True, use_listings_cache=False, **options
        )
        _disable_sdk_retries(fs)
        super().__init__(url, fs, root, retry=retry, unsafe_commits=unsafe_commits, timeout=timeout)

    # --- plumbing -----------------------------------------------------------------------

    def _run(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any) -> T:
        """Run a coroutine on the filesystem's event loop (safe from any thread)."""
        from fsspec.asyn import sync

        result: T = sync(self.fs.loop, fn, *args)
        return result

    def _blob(self, path: str) -> Any:
        container, blob, _ = self.fs.split_path(path)
        return self.fs.service_client.get_blob_client(container=container, blob=blob)

    def _timeouts(self) -> dict[str, Any]:
        """The ``timeout``/``connection_timeout``/``read_timeout`` options given to adlfs."""
        return dict(getattr(self.fs, "_timeout_kwargs", None) or {})

    def transient(self, exc: BaseException) -> bool:
        from azure.core.exceptions import (
            IncompleteReadError,
            ServiceRequestError,
            ServiceResponseError,
        )

        if isinstance(exc, ServiceRequestError | ServiceResponseError | IncompleteReadError):
            return True
        if isinstance(exc, ConnectionError | TimeoutError):
            return True
        if isinstance(exc, asyncio.TimeoutError):  # not TimeoutError before Python 3.11
            return True
        http = _http_error(exc)
        if http is not None:
            return (http.status_code or 0) in _TRANSIENT_STATUS
        return super().transient(exc)

    def _says_bucket_missing(self, exc: BaseException) -> bool:
        http = _http_error(exc)
        return http is not None and getattr(http, "error_code", None) == "ContainerNotFound"

    def _bucket_exists(self) -> bool | None:
        """Get Container Properties: 404 -> False."""
        from azure.core.exceptions import ResourceNotFoundError

        async def properties() -> None:
            async with self.fs.service_client.get_container_client(self.bucket) as cc:
                await cc.get_container_properties(**self._timeouts())

        try:
            self._run(properties)
        except ResourceNotFoundError:
            return False
        return True

    # --- backend hooks ------------------------------------------------------------------

    def _create(self, path: str, data: bytes) -> None:
        from azure.core.exceptions import ResourceExistsError, ResourceModifiedError

        async def create() -> None:
            async with self._blob(path) as bc:
                # overwrite=False sends If-None-Match: *; retry_total=0: see the module doc.
                await bc.upload_blob(
                    data,
                    overwrite=False,
                    metadata=_FILE_METADATA,
                    retry_total=0,
                    **self._timeouts(),
                )

        try:
            self._run(create)
        except (ResourceExistsError, ResourceModifiedError):
            raise VersionExistsError(f"{path} already exists in store {self.url}") from None

    def _read_with_token(self, path: str) -> tuple[bytes, str]:
        from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError

        async def read() -> tuple[bytes, str]:
            async with self._blob(path) as bc:
                try:
                    stream = await bc.download_blob(**self._timeouts())
                except ResourceNotFoundError as exc:
                    if getattr(exc, "error_code", None) == "BlobNotFound":
                        raise FileNotFoundError(path) from None
                    raise  # ContainerNotFound: a configuration error, not a missing key
                data = bytes(await stream.readall())
                return data, str(stream.properties.etag)

        # A download in several chunks pins the first response's ETag with If-Match; a blob
        # replaced in between fails with 412: read it again.
        for _ in range(5):
            try:
                return self._run(read)
            except ResourceModifiedError:
                continue
        raise StoreError(f"{path} in store {self.url} keeps changing; try again")

    def list(self, prefix: str = "") -> builtins.list[str]:
        """List Blobs pages of 5,000 names (adlfs's ``find`` adds a Get Blob Properties of the
        prefix, and another listing when it finds nothing)."""
        keys = self._list_blobs(prefix)
        if not keys:  # an empty store, or no container at all
            self._raise_if_bucket_missing(None, probe=True)
        return keys

    def list_after(self, prefix: str, start_after: str) -> builtins.list[str]:
        """The keys under ``prefix`` after ``start_after``: Azure lists no range after a key,
        so the whole prefix is listed (one request per 5,000 keys) and filtered here."""
        return [k for k in self._list_blobs(prefix) if k > start_after]

    def _list_blobs(self, prefix: str) -> builtins.list[str]:
        """Sorted keys under ``prefix`` (a folder placeholder blob is not a key)."""
        if prefix:
            validate_key(prefix.rstrip("/"))
        container, _, root = self.root.partition("/")
        base = f"{root}/" if root else ""

        async def names() -> builtins.list[str]:
            async with self.fs.service_client.get_container_client(container) as cc:
                return [
                    b.name
                    async for b in cc.list_blobs(
                        name_starts_with=base + prefix, include=["metadata"], **self._timeouts()
                    )
                    if (b.metadata or {}).get("is_directory") != "true"
                ]

        found = self._call("list", prefix or "/", lambda: self._run(names))
        return listed_keys((n[len(base) :] for n in found), prefix)

    def _replace_if(self, path: str, data: bytes, token: str) -> None:
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError

        async def replace() -> None:
            async with self._blob(path) as bc:
                await bc.upload_blob(
                    data,
                    overwrite=True,
                    etag=token,
                    match_condition=MatchConditions.IfNotModified,
                    metadata=_FILE_METADATA,
                    retry_total=0,
                    **self._timeouts(),
                )

        try:
            self._run(replace)
        except (ResourceModifiedError, ResourceNotFoundError) as exc:
            if getattr(exc, "error_code", None) == "ContainerNotFound":
                raise  # a configuration error; a deleted blob means the token is stale
            raise PreconditionFailedError(
                f"{path} in store {self.url} changed since it was read; read it again"
            ) from None
