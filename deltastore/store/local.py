"""A store in a local (or NFS-mounted) folder.

Commits follow docs/spec/format-v1.md, section 4.2: write a temp file in the destination
folder, fsync it, ``os.link`` it to the final name (which fails if the name exists: atomic
create-if-absent, unlike ``pipe_file(mode="create")``), fsync the folder. Replacements use
``os.replace``. The compare-and-swap of :meth:`LocalStore.put_if_match` holds an
``fcntl.flock`` on ``<root>/.deltastore.lock``. Temp and lock files start with ``.`` and are
never keys. A delete removes the folders it leaves empty, up to the root; a writer makes a
folder again when such a delete removed it under it (spec section 2).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import xxhash

from deltastore.errors import (
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
    StoreFullError,
    VersionExistsError,
)
from deltastore.store.base import Store, access_denied, validate_key
from deltastore.store.space import disk_full, is_disk_full


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: How often a writer creates its folder again when a delete removed it meanwhile.
_FOLDER_RACE_RETRIES = 16


def _create(tmp: Path) -> BinaryIO:
    """Open the new file ``tmp`` for writing (``x``: never an existing one), creating its
    folders first. A delete removes the folders it empties (:meth:`LocalStore.delete`), so a
    folder made here can be gone before the file is created in it: then it is made again,
    up to :data:`_FOLDER_RACE_RETRIES` times. Once the file exists, its folder is not empty
    and no delete removes it."""
    for _ in range(_FOLDER_RACE_RETRIES):
        try:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            return open(tmp, "xb")
        except FileNotFoundError:  # a delete removed a folder on the way: make it again
            continue
    tmp.parent.mkdir(parents=True, exist_ok=True)
    return open(tmp, "xb")


class LocalStore(Store):
    """Store rooted at a folder; created on first write. Thread- and process-safe."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().resolve()  # one name per folder: no "..", no link
        self.url = str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    @contextlib.contextmanager
    def _errors(self, op: str, key: str, needed: int | None = None) -> Iterator[None]:
        try:
            yield
        except FileNotFoundError:
            raise ObjectNotFoundError(f"{key} not found in store {self.url}") from None
        except OSError as exc:
            if isinstance(exc, StoreError):
                raise
            if is_disk_full(exc):  # as the message of a full folder, and a StoreError
                raise disk_full(
                    self.root,
                    exc,
                    needed=needed,
                    what=f"{key} of store {self.url}",
                    todo="free space in the store's file system, then write again",
                    cls=StoreFullError,
                ) from None
            if isinstance(exc, PermissionError):
                raise access_denied(op, key, self.url, exc) from exc
            raise StoreError(f"{op} {key} in store {self.url} failed: {exc}") from exc

    def get(self, key: str) -> bytes:
        path = self._path(key)
        with self._errors("get", key):
            return path.read_bytes()

    def get_range(self, key: str, start: int, length: int) -> bytes:
        path = self._path(key)
        with self._errors("get_range", key), open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            fh.seek(start)
            return fh.read(max(0, min(length, size - start)))

    def _write_temp(self, path: Path, data: bytes) -> Path:
        """``data`` in a new durable temp file beside ``path``; removed again on error."""
        tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex}"
        try:
            with _create(tmp) as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        with self._errors("put", key, len(data)):
            tmp = self._write_temp(path, data)
            try:
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            _fsync_dir(path.parent)

    def put_if_absent(self, key: str, data: bytes) -> None:
        path = self._path(key)
        with self._errors("put_if_absent", key, len(data)):
            tmp = self._write_temp(path, data)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise VersionExistsError(
                    f"{key} already exists in store {self.url}: another writer created it first"
                ) from None
            finally:
                tmp.unlink(missing_ok=True)
            _fsync_dir(path.parent)

    def get_with_token(self, key: str) -> tuple[bytes, str] | None:
        try:
            data = self.get(key)
        except ObjectNotFoundError:
            return None
        return data, xxhash.xxh3_128_hexdigest(data)

    def put_if_match(self, key: str, data: bytes, token: str | None) -> None:
        validate_key(key)
        with self._errors("put_if_match", key):
            self.root.mkdir(parents=True, exist_ok=True)
            with open(self.root / ".deltastore.lock", "a+b") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                current = self.get_with_token(key)
                if (current[1] if current else None) != token:
                    raise PreconditionFailedError(
                        f"{key} in store {self.url} changed since it was read; read it again"
                    )
                self.put(key, data)

    def list(self, prefix: str = "") -> list[str]:
        if prefix:
            validate_key(prefix.rstrip("/"))
        base = self.root / prefix if prefix.endswith("/") or not prefix else self.root
        keys: list[str] = []
        with self._errors("list", prefix):
            if not base.is_dir():
                return []
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                rel = Path(dirpath).relative_to(self.root).as_posix()
                for name in filenames:
                    if not name.startswith("."):
                        key = name if rel == "." else f"{rel}/{name}"
                        if key.startswith(prefix):
                            keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        """Remove ``key``, then each folder above it that is now empty, up to (not including)
        the store root: retention leaves no empty ``versions/<v>/`` folder behind (spec
        section 2). A folder a writer is using holds its temp file, so it is never empty; one
        removed just after a writer made it is made again by the writer (:func:`_create`)."""
        path = self._path(key)
        with self._errors("delete", key):
            path.unlink()
        folder = path.parent
        while folder != self.root and self.root in folder.parents:
            try:
                folder.rmdir()
            except OSError:  # not empty (a writer's file), gone already, or not ours to remove
                return
            folder = folder.parent
