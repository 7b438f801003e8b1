"""Checkpoint folders: publish a safetensors checkpoint, keep a folder in sync in place.

:func:`publish_checkpoint` reads a ``.safetensors`` file or HF-style folder through memory maps
(never all in RAM) and publishes it, as a delta against ``parent`` (checked against the store's
newest version), against the publisher's saved state in ``state_dir``, or as an anchor.

:func:`pull_checkpoint` brings a folder to a committed version: an empty folder is created
from the newest anchor; an existing one is updated in place through writable memory maps (no
second copy on disk or in RAM). The folder's version and per-tensor Adler-32 live in the
sidecar ``.deltastore.json``, replaced atomically after each version is written and flushed,
so a failed pull leaves the folder at its last recorded version, loadable by safetensors.

Not safe to run two pulls into the same folder at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltastore.checkpoint import (
    CheckpointError,
    MappedCheckpoint,
    create_checkpoint,
    locate,
)
from deltastore.errors import ManifestNotFoundError, ObjectNotFoundError, StoreError
from deltastore.manifest import Manifest
from deltastore.progress import ProgressFn
from deltastore.publisher import Publisher, PublishReport
from deltastore.store import open_store
from deltastore.subscriber import Subscriber, SyncReport

log = logging.getLogger(__name__)

SIDECAR = ".deltastore.json"
SIDECAR_FORMAT = 1


def default_state_dir(url: str) -> Path:
    """Per-store publisher state folder under the user's cache (``$XDG_CACHE_HOME``)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "deltastore" / "publisher" / hashlib.sha256(url.encode()).hexdigest()[:16]


def publish_checkpoint(
    url: str,
    src: str | os.PathLike[str],
    *,
    version: int,
    parent: str | os.PathLike[str] | None = None,
    anchor: bool = False,
    state_dir: str | os.PathLike[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: ProgressFn | None = None,
    **publisher_options: Any,
) -> PublishReport:
    """Publish the checkpoint at ``src`` as ``version``.

    With ``parent`` (the checkpoint of the store's newest version), the delta is computed
    against it after checking it against that manifest (:class:`TensorMismatchError` if it
    differs). Otherwise the publisher state saved in ``state_dir`` (default
    :func:`default_state_dir`) is the parent; with none, an anchor is written. ``anchor=True``
    always writes an anchor.
    """
    store = open_store(url, storage_options)
    folder = Path(state_dir) if state_dir is not None else default_state_dir(store.url)
    pub = Publisher(store, snapshot="disk", state_dir=folder, **publisher_options)
    tensors = MappedCheckpoint(locate(src)).tensors
    if parent is not None and not anchor:
        pub.attach(MappedCheckpoint(locate(parent)).tensors)
    return pub.publish(tensors, version=version, anchor=True if anchor else None, progress=progress)


@dataclass(frozen=True)
class FolderState:
    """Content of a folder's sidecar: the version it is at and its per-tensor Adler-32."""

    version: int
    state_digest: str
    adler32: dict[str, int]


def read_state(dest: str | os.PathLike[str]) -> FolderState | None:
    """The folder's recorded state, or None when it has no sidecar."""
    path = Path(dest) / SIDECAR
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc}); pull into a new folder") from None
    try:
        if meta["format"] != SIDECAR_FORMAT:
            raise CheckpointError(f"{path} has format {meta['format']!r}; upgrade deltastore")
        return FolderState(int(meta["version"]), str(meta["state_digest"]), dict(meta["adler32"]))
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path} is malformed; pull into a new folder") from None


def _write_state(dest: Path, m: Manifest) -> None:
    body = {
        "format": SIDECAR_FORMAT,
        "version": m.version,
        "state_digest": m.state_digest,
        "adler32": {n: e.adler32 for n, e in m.tensors.items()},
    }
    tmp = dest / f".{SIDECAR}.{uuid.uuid4().hex}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(body, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, dest / SIDECAR)
    fd = os.open(dest, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FolderSync:
    """A subscriber over a checkpoint folder; keeps the mapping open between pulls."""

    def __init__(
        self,
        url: str,
        dest: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        **subscriber_options: Any,
    ) -> None:
        self.dest = Path(dest)
        self._url, self._opts, self._sub_opts = url, storage_options, subscriber_options
        self._ckpt: MappedCheckpoint | None = None
        self._sub: Subscriber | None = None
        state = read_state(self.dest)
        if state is not None:
            self._ckpt = MappedCheckpoint(locate(self.dest), writable=True)
            self._sub = Subscriber(
                url,
                storage_options=storage_options,
                tensors=self._ckpt.tensors,
                version=state.version,
                **subscriber_options,
            )
        elif self.dest.exists() and any(self.dest.iterdir()):
            raise CheckpointError(
                f"{self.dest} is not empty and holds no {SIDECAR}: pull into an empty or new "
                "folder (deltastore only updates folders it created)"
            )

    @property
    def version(self) -> int | None:
        """The version the folder is at (None: not created yet)."""
        return self._sub.version if self._sub is not None else None

    def latest(self) -> int | None:
        """Newest committed version in the store."""
        return (self._sub or Subscriber(self._url, storage_options=self._opts)).latest()

    def pull(self, version: int | None = None, *, progress: ProgressFn | None = None) -> SyncReport:
        """Bring the folder to ``version`` (default: newest); see the module docstring."""
        if self._sub is None:
            return self._create(version, progress)
        ckpt = self._ckpt
        if ckpt is None:  # pragma: no cover - set together with _sub
            raise CheckpointError("folder is not open")

        def record(m: Manifest) -> None:
            ckpt.flush()
            _write_state(self.dest, m)

        return self._sub.sync(version, progress=progress, on_version=record)

    def _create(self, version: int | None, progress: ProgressFn | None) -> SyncReport:
        probe = Subscriber(self._url, storage_options=self._opts)
        target = probe.latest() if version is None else version
        if target is None:
            raise ManifestNotFoundError(f"store {probe.store.url} holds no committed version yet")
        m = probe.manifest(target)
        existed = self.dest.exists()
        try:
            ckpt = MappedCheckpoint(
                create_checkpoint(
                    self.dest, {n: (e.dtype, tuple(e.shape)) for n, e in m.tensors.items()}
                ),
                writable=True,
            )
        except BaseException:
            self._remove_created(existed)
            raise
        sub = Subscriber(
            self._url, storage_options=self._opts, tensors=ckpt.tensors, **self._sub_opts
        )

        def record(applied: Manifest) -> None:
            ckpt.flush()
            _write_state(self.dest, applied)

        try:
            return sub.sync(target, progress=progress, on_version=record)
        except BaseException:
            if read_state(self.dest) is None:
                self._remove_created(existed)  # nothing usable was written: leave no debris
            raise
        finally:
            if read_state(self.dest) is not None:  # at least one version was recorded
                self._ckpt, self._sub = ckpt, sub

    def _remove_created(self, existed: bool) -> None:
        if not self.dest.exists():
            return
        if existed:
            for child in self.dest.iterdir():
                child.unlink()
        else:
            shutil.rmtree(self.dest, ignore_errors=True)


def pull_checkpoint(
    url: str,
    dest: str | os.PathLike[str],
    *,
    version: int | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: ProgressFn | None = None,
    **subscriber_options: Any,
) -> SyncReport:
    """Bring the checkpoint folder ``dest`` to ``version`` (default: the newest)."""
    folder = FolderSync(url, dest, storage_options=storage_options, **subscriber_options)
    return folder.pull(version, progress=progress)


def watch_checkpoint(
    url: str,
    dest: str | os.PathLike[str],
    *,
    interval: float = 5.0,
    max_interval: float = 60.0,
    stop: threading.Event | None = None,
    on_report: Callable[[SyncReport], None] | None = None,
    storage_options: dict[str, Any] | None = None,
    **subscriber_options: Any,
) -> None:
    """Poll the store and pull each new version into ``dest`` until ``stop`` is set.

    Waits ``interval`` seconds (±20% jitter) between polls; transient store errors back off
    exponentially up to ``max_interval``. Other errors propagate.
    """
    stop = stop or threading.Event()
    folder = FolderSync(url, dest, storage_options=storage_options, **subscriber_options)
    delay = interval
    while not stop.is_set():
        try:
            latest = folder.latest()
            if latest is not None and latest != folder.version:
                report = folder.pull(latest)
                if on_report is not None:
                    on_report(report)
            delay = interval
        except StoreError as exc:
            if isinstance(exc, ObjectNotFoundError) and not isinstance(exc, ManifestNotFoundError):
                raise  # a committed version lost a data object: retrying cannot help
            delay = min(max_interval, delay * 2)
            log.warning("store error, retrying in %.1f s: %s", delay, exc)
        stop.wait(delay * random.uniform(0.8, 1.2))


__all__ = [
    "FolderState",
    "FolderSync",
    "default_state_dir",
    "publish_checkpoint",
    "pull_checkpoint",
    "read_state",
    "watch_checkpoint",
]
