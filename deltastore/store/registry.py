"""The store registry: which backend serves a store URL (by its scheme).

- a plain path or ``file://``: :class:`~deltastore.store.local.LocalStore`;
- ``s3://``, ``s3a://``: :class:`~deltastore.store.s3.S3Store` (s3fs);
- ``gs://``, ``gcs://``: :class:`~deltastore.store.gcs.GCSStore` (gcsfs);
- ``az://``, ``abfs://``, ``abfss://``: :class:`~deltastore.store.azure.AzureStore` (adlfs).

A cloud backend's module is imported when a URL first asks for it, so opening a local store
imports none of them. Thread-safe (no state of its own).
"""

from __future__ import annotations

import os
from typing import Any

from deltastore.errors import StoreError
from deltastore.store.base import OWN_OPTIONS, Store, split_options
from deltastore.store.local import LocalStore


def local_root(url: str | os.PathLike[str]) -> str | None:
    """The folder of a local store URL (a plain path or ``file://``) as given, or None for a
    URL of another scheme."""
    url = os.fspath(url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    return rest if scheme == "file" else None


def store_url(url: str | os.PathLike[str]) -> str:
    """The store's name as :func:`open_store` gives it (:attr:`Store.url`), without opening
    it: a local folder's resolved absolute path (``~`` expanded, ``..`` and symbolic links
    resolved), so that every spelling of one folder names one store; other URLs unchanged."""
    root = local_root(url)
    return LocalStore(root).url if root is not None else os.fspath(url)


def open_store(
    url: str | os.PathLike[str] | Store, storage_options: dict[str, Any] | None = None
) -> Store:
    """Open the store at ``url``: a plain path or ``file://`` URL (a :class:`Store` passes through).

    A local folder is named by its resolved path (:func:`store_url`).

    ``storage_options`` are for fsspec backends, except deltastore's own (any store takes
    them): ``timeout`` (seconds: the bound of each store operation, retries included; no-op
    for a local store) and ``unsafe_commits`` (see :attr:`Store.unsafe_commits`). A local
    store takes no other option.
    """
    if isinstance(url, Store):
        return url
    url = os.fspath(url)
    root = local_root(url)
    if root is not None:
        options, _, _ = split_options(storage_options)  # checked; no-ops on a local folder
        if options:
            raise StoreError(
                f"a local store takes no storage options (got {sorted(options)}; "
                f"it takes only {', '.join(OWN_OPTIONS)})"
            )
        return LocalStore(root)  # its url: the resolved folder (store_url)
    scheme = url.partition("://")[0]
    if scheme in ("s3", "s3a"):
        from deltastore.store.s3 import S3Store

        return S3Store(url, storage_options)
    if scheme in ("az", "abfs", "abfss"):
        from deltastore.store.azure import AzureStore

        return AzureStore(url, storage_options)
    if scheme in ("gs", "gcs"):
        from deltastore.store.gcs import GCSStore

        return GCSStore(url, storage_options)
    raise StoreError(
        f"store URL scheme {scheme!r} is not supported; use a local folder, file://, s3://, "
        "gs:// or az://"
    )
