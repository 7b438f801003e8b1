"""Google Cloud Storage through gcsfs (the JSON API over HTTP).

Guarantees (on real GCS, which is strongly consistent for object reads, writes and listings):

- Commit: ``put_if_absent`` is one single-request upload with ``ifGenerationMatch=0``; GCS
  answers 412 to every writer but the first (:class:`VersionExistsError`).
- ``LATEST``: the change token is the object's *generation*, taken from the same response as
  the bytes (``x-goog-generation``), and ``put_if_match`` uploads with
  ``ifGenerationMatch=<generation>`` (412 -> :class:`PreconditionFailedError`), so a slow
  publisher can never move ``LATEST`` backwards.
- Ambiguous writes: a conditional upload that failed after it may have reached GCS (timeout,
  reset, 5xx) and then answers 412 on retry is resolved by reading the object back: if it
  holds exactly our bytes, this writer won.
- Retries: :class:`RetryPolicy` is the only retry loop. gcsfs's own per-request retries are
  turned off for this store's filesystem: nested, they would multiply attempts and time past
  the policy's bounds, and would hide the transient failure of a conditional upload, so a
  writer whose commit landed would be told it lost. With a ``timeout``, each request's connect
  and socket-read timeouts (``requests_timeout``) are capped by it.
- A bucket that does not exist raises :class:`BucketNotFoundError` (one metadata GET of the
  bucket, after a 404 or an empty listing).

Not enforced everywhere: ``gcp-storage-emulator`` ignores every generation precondition;
:meth:`GCSStore.check_conditional_writes` detects this with a probe (create one key twice) and
refuses commits there unless ``unsafe_commits=True`` (one publisher only).

The store always uses gcsfs's JSON-API filesystem (``gcsfs.core.GCSFileSystem``), whatever
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` says, so it never probes a gRPC endpoint; zonal
(Rapid storage) buckets, which need gRPC, are not supported.

Thread-safe: gcsfs runs requests on fsspec's event-loop thread; any thread may call.
"""

from __future__ import annotations

import asyncio
import json
import types
from functools import partial
from typing import Any
from urllib.parse import quote

from deltastore.errors import (
    ObjectNotFoundError,
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

#: Objects this large go through gcsfs's resumable upload (its default chunk size).
SINGLE_REQUEST_MAX = 50 * 2**20


class GCSStore(FsspecStore):
    """Store at ``gs://bucket/prefix``. ``storage_options`` go to ``gcsfs.GCSFileSystem``
    (``project``, ``token``, ``endpoint_url``, ``requester_pays``, ``requests_timeout``...),
    except deltastore's own ``timeout`` and ``unsafe_commits``."""

    consistent_listing = True  # strongly consistent listings

    precondition = "ifGenerationMatch"

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
            from gcsfs.core import GCSFileSystem
        except ImportError:
            raise StoreError(
                "gs:// stores need the gcs extra: pip install 'deltastore[gcs]'"
            ) from None
        root = url.split("://", 1)[1].strip("/")
        if not root:
            raise StoreError(f"{url}: a GCS store URL names a bucket: gs://bucket[/prefix]")
        options, timeout, unsafe_commits = split_options(
            storage_options, timeout=timeout, unsafe_commits=unsafe_commits
        )
        if timeout is not None and "requests_timeout" not in options:
            import aiohttp

            connect, read = request_timeouts(timeout, 30.0, 300.0)
            options["requests_timeout"] = aiohttp.ClientTimeout(
                total=None, sock_connect=connect, sock_read=read
            )
        fs = GCSFileSystem(skip_instance_cache=True, use_listings_cache=False, **options)
        # One retry loop (ours): call gcsfs's request without its retry decorator.
        single = getattr(type(fs)._request, "__wrapped__", None)
        if single is not None:
            fs._request = types.MethodType(single, fs)
        super().__init__(url, fs, root, retry=retry, unsafe_commits=unsafe_commits, timeout=timeout)
        self._generation_header: bool | None = None  # does the service send x-goog-generation?

    # --- errors -------------------------------------------------------------------------

    def transient(self, exc: BaseException) -> bool:
        """429, 408, 5xx, connection errors and timeouts; never 404 or 412."""
        if isinstance(exc, FileNotFoundError | FileExistsError):
            return False
        if isinstance(exc, asyncio.TimeoutError):  # not TimeoutError on Python 3.10
            return True
        from gcsfs.retry import is_retriable

        return bool(is_retriable(exc)) or super().transient(exc)

    def _bucket_exists(self) -> bool | None:
        """Metadata GET of the bucket: 404 -> False; 403 (exists, not readable) -> True."""
        try:
            self.fs.call("GET", "b/{}", self.bucket, json_out=True)
        except FileNotFoundError:
            return False
        except PermissionError:
            return True
        return True

    # --- requests -----------------------------------------------------------------------

    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, key = path.partition("/")
        return bucket, key

    def _upload(self, path: str, data: bytes, generation: str | None) -> None:
        """One single-request upload, with ``ifGenerationMatch=generation`` unless None;
        FileExistsError on 412. Media upload; an empty object goes as multipart, the one form
        gcp-storage-emulator accepts without a body byte (its multipart parser drops a
        trailing ``\\r`` of the content, so that form is used for nothing else)."""
        from gcsfs.checkers import get_consistency_checker

        bucket, key = self._split(path)
        if data:
            body, content_type, upload_type = data, "application/octet-stream", "media"
        else:
            body = (
                b"--==0==\nContent-Type: application/json; charset=UTF-8\n\n"
                + json.dumps({"name": key}).encode()
                + b"\n--==0==\nContent-Type: application/octet-stream\n\n\n--==0==--"
            )
            content_type, upload_type = 'multipart/related; boundary="==0=="', "multipart"
        checker = get_consistency_checker(self.fs.consistency)
        out = self.fs.call(
            "POST",
            f"{self.fs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o",
            uploadType=upload_type,
            name=key,
            ifGenerationMatch=generation,
            headers={"Content-Type": content_type},
            data=body,
            json_out=True,
        )
        checker.update(data)
        checker.validate_json_response(out)

    def put(self, key: str, data: bytes) -> None:
        """A single-request upload below 50 MiB (see :meth:`_upload`), gcsfs's resumable
        upload above."""
        if len(data) >= SINGLE_REQUEST_MAX:
            super().put(key, data)
            return
        path = self._path(key)
        self._call("put", key, lambda: self._upload(path, data, None))

    def _generation(self, path: str) -> str:
        """The object's current generation (one metadata GET); FileNotFoundError if absent."""
        bucket, key = self._split(path)
        meta = self.fs.call("GET", "b/{}/o/{}", bucket, key, json_out=True)
        return str(meta["generation"])

    # --- backend hooks ------------------------------------------------------------------

    def _create(self, path: str, data: bytes) -> None:
        try:
            self._upload(path, data, "0")
        except FileExistsError:
            raise VersionExistsError(f"{path} already exists in store {self.url}") from None

    def _read_with_token(self, path: str) -> tuple[bytes, str]:
        if self._generation_header is not False:
            # One GET: the bytes and the generation they belong to come in the same response.
            headers, data = self.fs.call("GET", self.fs.url(path))
            generation = headers.get("x-goog-generation")
            if generation:
                self._generation_header = True
                return bytes(data), str(generation)
            self._generation_header = False
        # A service without the header: generation, read pinned to it, generation again.
        for _ in range(5):
            before = self._generation(path)
            try:
                data = self.fs.cat_file(path, generation=before)
            except FileNotFoundError:
                continue  # replaced between the two requests; the next round says if deleted
            if self._generation(path) == before:
                return bytes(data), before
        raise StoreError(f"{path} in store {self.url} keeps changing; try again")

    def _replace_if(self, path: str, data: bytes, token: str) -> None:
        try:
            self._upload(path, data, token)
        except FileExistsError:
            raise PreconditionFailedError(
                f"{path} in store {self.url} changed since it was read; read it again"
            ) from None

    def head_token(self, key: str) -> str | None:
        """The generation of ``key`` from one metadata GET (the token :meth:`get_with_token`
        gives), or None when missing."""
        path = self._path(key)
        try:
            return self._call("head", key, lambda: self._generation(path))
        except ObjectNotFoundError:
            return None

    def _token_of(self, info: dict[str, Any]) -> str:
        return str(info["generation"])

    def list_after(self, prefix: str, start_after: str) -> list[str]:
        """``objects.list`` with ``startOffset``: a poll lists only keys after ``start_after``
        (services that ignore ``startOffset``, like the emulator, are filtered here)."""
        if prefix:
            validate_key(prefix.rstrip("/"))
        bucket, _, root = self.root.partition("/")
        base = f"{root}/" if root else ""
        keys: list[str] = []
        page_token: str | None = None
        while True:
            page: dict[str, Any] = self._call(
                "list",
                prefix or "/",
                partial(
                    self.fs.call,
                    "GET",
                    "b/{}/o",
                    bucket,
                    prefix=base + prefix,
                    startOffset=base + start_after,
                    pageToken=page_token,
                    fields="items(name),nextPageToken",
                    json_out=True,
                ),
            )
            keys += [o["name"][len(base) :] for o in page.get("items") or []]
            page_token = page.get("nextPageToken")
            if not page_token:
                return listed_keys(keys, prefix, start_after)
