"""``deltastore mirror``: replicate a store's versions into another store, one fetch per cluster.

A cluster's followers read a mirror near them (an NFS share, a MinIO, a regional bucket)
instead of the trainer's store across regions: the origin then serves each version once per
mirror, not once per follower, and sees one poll per mirror. Followers of a mirror need
nothing new: a mirror is a store like any other, and mirrors chain (region -> cluster -> rack).

For each version ``v`` the destination lacks, in version order, the destination receives the
commit protocol's writes in the commit protocol's order (format v1, section 4.2):

1. every data object of ``v``'s manifest and of its anchor copy (read whole from the source,
   every frame in it checked: its length, XXH3-64 and, when recorded, BLAKE3; then written);
   an object the destination already holds (a run stopped before this version's commit) is
   read back from the destination and kept when its frames check out, so a restarted mirror
   resumes without fetching it from the source again;
2. the anchor copy ``anchors/<v>.json``, then the manifest ``manifests/<v>.json``, each with
   create-if-absent and exactly the source's bytes (an existing object with other bytes is a
   fork: :class:`ForkError`); signatures are checked on reading them when keys are held
   (``trusted_keys``), so a destination never holds a version a keyed reader would reject;
3. ``LATEST``, by compare-and-swap, never backwards.

A destination whose newest version is not the source's version of that number (someone
else writes it) is a :class:`ForkError`. A frame that fails its checks stops the pass at that
version (:class:`IntegrityError`, or :class:`FrameError` for a truncated one): nothing of its
manifest is written, earlier versions stay. A later pass reads the damaged version again, and
skips it as soon as the source has an anchor (or anchor copy) after it. A run stopped between
a manifest and ``LATEST`` has its ``LATEST`` brought forward by the next run's first pass.
When the next version the destination needs is gone from the source (retention there), the
mirror jumps to the next anchor or anchor copy after the
destination's head. A fresh destination starts at the source's oldest version that starts a
chain (an anchor, or a version with an anchor copy), at the newest such version at or below
``since``, or (``anchor_first``) at the newest one.

Several mirrors of one source into one destination may run at once: the destination's
create-if-absent decides, and they write the same bytes. The mirror keeps a lease on the
source (``leases/<reader_id>.json``) on the destination's head, as a reader would; retention
on the destination is the destination's own (``gc --keep`` there, its readers' leases).

Not thread-safe: one thread drives a :class:`Mirror`; its copies run on worker threads of
its own (``max_workers``), each holding at most one data object in memory.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from deltastore.catalog.chain import ChainReader
from deltastore.errors import (
    ChainError,
    DeltastoreError,
    ForkError,
    FrameError,
    IntegrityError,
    ManifestError,
    ManifestNotFoundError,
    ObjectNotFoundError,
    StoreError,
)
from deltastore.format.keys import (
    ANCHOR_PREFIX,
    LATEST_KEY,
    anchor_key,
    data_prefix,
    manifest_key,
)
from deltastore.format.manifest import Frame, Manifest, parse_latest
from deltastore.format.signing import (
    FROM_ENV,
    KeyOption,
    TrustOption,
    resolve_trust,
)
from deltastore.publish.commit import conditional_writes, replicate_version
from deltastore.store import Store, open_store
from deltastore.sync.fetch import check_stored
from deltastore.sync.lease import DEFAULT_LEASE_TTL_S, LeaseKeeper
from deltastore.sync.poll import PollSchedule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MirrorReport:
    """One pass of :meth:`Mirror.run_once`. Sizes in bytes, times in seconds."""

    #: Versions whose manifest this pass wrote to the destination, ascending.
    copied: tuple[int, ...] = ()
    #: The destination's newest version after the pass (None: it holds none).
    newest: int | None = None
    #: Data objects written, and those skipped because the destination had them (a resume).
    objects_copied: int = 0
    objects_skipped: int = 0
    bytes_copied: int = 0
    #: Versions reached through an anchor or anchor copy because the versions before them
    #: were missing (retention at the source) or damaged (a skipped version).
    jumped: tuple[int, ...] = ()
    seconds: float = 0.0


@dataclass
class _Tally:
    copied: list[int] = field(default_factory=list)
    jumped: list[int] = field(default_factory=list)
    objects: int = 0
    skipped: int = 0
    nbytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, nbytes: int) -> None:
        with self.lock:
            self.objects += 1
            self.nbytes += nbytes


@dataclass(frozen=True)
class _Version:
    """A source version to copy: its manifest and anchor copy, with their exact bytes."""

    version: int
    manifest: Manifest
    body: bytes
    copy: Manifest | None
    copy_body: bytes | None

    @property
    def starts_chain(self) -> bool:
        return self.manifest.kind == "anchor" or self.copy is not None


class Mirror:
    """Copies the versions of store ``source`` into store ``dest`` (see the module
    docstring). ``storage_options`` / ``dest_storage_options``: of each store's filesystem.
    ``trusted_keys`` / ``signing_key``: the keys every source manifest and anchor copy must
    be signed with (as :class:`~deltastore.Subscriber`'s; default: the environment's, none
    when unset). ``unsafe_commits``: mirror into a store that ignores create-if-absent, each
    manifest read back after its create (one mirror per destination then)."""

    def __init__(
        self,
        source: str | os.PathLike[str] | Store,
        dest: str | os.PathLike[str] | Store,
        *,
        storage_options: dict[str, Any] | None = None,
        dest_storage_options: dict[str, Any] | None = None,
        trusted_keys: TrustOption = FROM_ENV,
        signing_key: KeyOption = FROM_ENV,
        since: int | None = None,
        anchor_first: bool = False,
        reader_id: str | None = None,
        lease_ttl: float | None = DEFAULT_LEASE_TTL_S,
        max_workers: int = 4,
        unsafe_commits: bool = False,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers!r}")
        if since is not None and anchor_first:
            raise ValueError("give since or anchor_first, not both")
        self.source = open_store(source, storage_options)
        self.dest = open_store(dest, dest_storage_options)
        self._src = ChainReader(self.source, keys=resolve_trust(trusted_keys, signing_key))
        self._dst = ChainReader(self.dest)
        self._since, self._anchor_first = since, anchor_first
        self._lease = LeaseKeeper(self.source, reader_id, lease_ttl)
        self._workers = max_workers
        self._unsafe = unsafe_commits
        self._enforced: bool | None = None  # does the destination enforce create-if-absent
        self._bad: set[int] = set()  # source versions whose frames failed
        self._settled = False  # LATEST checked against the destination's head
        self._read_cache: dict[str, bytes] = {}  # this pass's source manifests and copies

    # --- one pass ---------------------------------------------------------------------

    def run_once(self) -> MirrorReport:
        """Copy every source version the destination lacks (see the module docstring); the
        first damaged version raises, after the versions before it are copied."""
        t0 = time.perf_counter()
        tally = _Tally()
        self._read_cache.clear()
        head = self._dst.latest()
        if head is not None:
            self._lease.hold(head)
            if not self._settled:  # LATEST of a run stopped between a manifest and it
                self._settle_latest(head)
                self._settled = True
        listed = self._src.versions_after(head)  # an idle poll: this one request
        copies = self._src.copies_after(head) if listed else set()
        for item in self._plan(head, listed, copies, tally):
            self._lease.hold(item.version)
            try:
                self._copy(item, tally)
                self._bad.discard(item.version)
            except (IntegrityError, FrameError, ManifestError) as exc:
                self._bad.add(item.version)
                raise type(exc)(
                    f"source version {item.version} cannot be mirrored: {exc}; nothing of it "
                    "was committed at the destination (the versions before it were). The "
                    "mirror goes on from the next anchor or anchor copy the source publishes"
                ) from exc
            head = item.version
        return MirrorReport(
            tuple(tally.copied), head, tally.objects, tally.skipped, tally.nbytes,
            tuple(tally.jumped), time.perf_counter() - t0,
        )  # fmt: skip

    def _plan(
        self, head: int | None, listed: list[int], copies: set[int], tally: _Tally
    ) -> list[_Version]:
        """The versions to copy, ascending: each extends the previous one's chain, or
        starts a chain (an anchor, or a version with an anchor copy); versions that do
        neither are skipped up to the next start after them. :class:`ForkError` when the
        destination's newest version is not the source's version of that number."""
        todo = self._past_damage(list(listed), copies)
        if head is None:
            todo = self._start(todo, copies)
        out: list[_Version] = []
        prev = head
        digest = self._dst.manifest(head).state_digest if head is not None else None
        i = 0
        while i < len(todo):
            item = self._read(todo[i], todo[i] in copies)
            parent = item.manifest.parent
            extends = (
                parent is not None and parent.version == prev and parent.state_digest == digest
            )
            if not extends and out == [] and head is not None:
                self._check_same(head)  # a destination someone else wrote
            if not extends and not item.starts_chain:
                later = self._first_start(todo[i + 1 :], copies)
                if later is None:
                    log.warning(
                        "source version %d does not extend the destination's version %s and "
                        "no anchor or anchor copy follows it yet; waiting for one",
                        item.version,
                        prev,
                    )
                    break
                i = todo.index(later)
                continue
            if not extends and prev is not None:
                tally.jumped.append(item.version)
            out.append(item)
            prev, digest = item.version, item.manifest.state_digest
            i += 1
        return out

    def _past_damage(self, todo: list[int], copies: set[int]) -> list[int]:
        """``todo`` from past the newest version that failed its checks, when an anchor or
        anchor copy follows it (that start is where the copy goes on); else as it is: the
        damaged version is tried again (a damaged read may not be damaged data)."""
        bad = max((v for v in todo if v in self._bad), default=None)
        if bad is None:
            return todo
        start = self._first_start([v for v in todo if v > bad], copies)
        if start is None:
            return todo
        log.warning("skipping the damaged source version %d: going on from version %d", bad, start)
        return todo[todo.index(start) :]

    def _start(self, todo: list[int], copies: set[int]) -> list[int]:
        """The source versions a fresh destination copies: from the first that starts a
        chain (default), the newest at or below ``since``, or the newest (``anchor_first``)."""
        if self._since is None and not self._anchor_first:
            first = next((v for v in todo if v in copies or self._read(v, False).starts_chain),
                         None)  # fmt: skip
            return todo[todo.index(first) :] if first is not None else []
        pool = todo if self._since is None else [v for v in todo if v <= self._since]
        start = self._newest_anchor(pool, [v for v in pool if v in copies])
        if start is None:
            where = "" if self._since is None else f" at or below version {self._since}"
            raise ChainError(
                f"store {self.source.url} has no anchor or anchor copy{where} to start a "
                "mirror from: give another --since, or publish an anchor"
            )
        return todo[todo.index(start) :]

    def _first_start(self, versions: Sequence[int], copies: set[int]) -> int | None:
        """The oldest of ``versions`` that starts a chain (an anchor copy, else reading
        manifests oldest first until an anchor)."""
        for v in versions:
            if v in copies or self._read(v, False).manifest.kind == "anchor":
                return v
        return None

    def _check_same(self, version: int) -> None:
        """Raise :class:`ForkError` unless the destination's manifest of ``version`` holds
        the source's bytes (when the source still has it)."""
        try:
            theirs = self.source.get(manifest_key(version))
        except ObjectNotFoundError:
            return  # deleted at the source by retention: nothing to compare
        if self.dest.get(manifest_key(version)) != theirs:
            raise ForkError(
                f"version {version} in store {self.dest.url} is not the source's: the "
                "destination was written by someone else (a publisher, or a mirror of another "
                "source); mirror into a store of its own"
            )

    def _newest_anchor(self, versions: Sequence[int], with_copies: Sequence[int]) -> int | None:
        """The newest of ``versions`` that starts a chain (reading manifests newest first
        until an anchor, unless a version with a copy is newer)."""
        floor = max(with_copies, default=None)
        for v in reversed(versions):
            if floor is not None and v <= floor:
                return floor
            if self._read(v, False).manifest.kind == "anchor":
                return v
        return floor

    def _read(self, version: int, has_copy: bool) -> _Version:
        """Source version ``version``: manifest and (``has_copy``) anchor copy, exact bytes,
        each parsed, validated, signature-checked and naming ``version``."""
        body = self._get(manifest_key(version))
        m = self._src.take_manifest(version, body)
        copy = copy_body = None
        if has_copy:
            try:
                copy_body = self._get(anchor_key(version))
                copy = self._src.check_copy(version, copy_body)
            except ObjectNotFoundError:
                copy_body = None  # deleted by the source's retention meanwhile
            except DeltastoreError as exc:  # a damaged copy is not mirrored (readers skip it)
                log.warning("%s of the source is not mirrored: %s", anchor_key(version), exc)
                copy = copy_body = None
        return _Version(version, m, body, copy, copy_body)

    def _get(self, key: str) -> bytes:
        """A source manifest or anchor copy's bytes (read once per pass)."""
        cached = self._read_cache.get(key)
        if cached is not None:
            return cached
        try:
            data = self.source.get(key)
        except ObjectNotFoundError:
            if key.startswith(ANCHOR_PREFIX):
                raise
            raise ManifestNotFoundError(
                f"{key} is gone from store {self.source.url} (retention there?); the next pass "
                "goes on from the newest anchor or anchor copy"
            ) from None
        self._read_cache[key] = data
        return data

    # --- copying one version ----------------------------------------------------------

    def _copy(self, item: _Version, tally: _Tally) -> None:
        """Objects, then the anchor copy, then the manifest, then ``LATEST``."""
        v = item.version
        frames: dict[str, list[Frame]] = {}
        for m in (item.manifest, item.copy):
            for t in m.tensors.values() if m is not None else ():
                for f in t.frames:
                    frames.setdefault(f.object, []).append(f)
        present = set(self.dest.list(data_prefix(v)))
        keys = sorted(frames)
        with ThreadPoolExecutor(min(self._workers, max(len(keys), 1))) as pool:
            done = [pool.submit(self._place, k, frames[k], k in present, tally) for k in keys]
            errors = [f.exception() for f in done]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        copy_body = item.copy_body if item.copy is not None else None
        replicate_version(self.dest, v, item.body, copy_body, enforced=self._enforce())
        self._dst.note(v)
        tally.copied.append(v)
        log.info("mirrored version %d (%d objects)", v, len(keys))

    def _settle_latest(self, head: int) -> None:
        """Bring the destination's ``LATEST`` to ``head`` when it is behind (a run stopped
        after a manifest's create, before ``LATEST``); one read when it is not."""
        try:
            behind = parse_latest(self.dest.get(LATEST_KEY)).version < head
        except ObjectNotFoundError:
            behind = True
        except DeltastoreError:
            behind = True  # damaged: replaced
        if behind:
            body = self.dest.get(manifest_key(head))
            replicate_version(self.dest, head, body, None, enforced=self._enforce())

    def _enforce(self) -> bool:
        """Whether the destination enforces create-if-absent (asked once)."""
        if self._enforced is None:
            self._enforced = conditional_writes(self.dest, unsafe_commits=self._unsafe)
        return self._enforced

    def _place(self, key: str, frames: list[Frame], present: bool, tally: _Tally) -> None:
        """Make the destination hold data object ``key`` with ``frames`` intact: one it
        already holds (a run stopped before this version's commit) is read back from it and
        kept when every frame checks out; otherwise it is copied from the source."""
        if present:
            try:
                _check_frames(self.dest.get(key), frames)
            except (DeltastoreError, ValueError) as exc:
                log.warning("%s at the destination is damaged (%s); copied again", key, exc)
            else:
                with tally.lock:
                    tally.skipped += 1
                return
        self._copy_object(key, frames, tally)

    def _copy_object(self, key: str, frames: list[Frame], tally: _Tally) -> None:
        """Read ``key`` whole from the source, check each of its ``frames``, write it."""
        try:
            data = self.source.get(key)
        except ObjectNotFoundError:
            raise ObjectNotFoundError(
                f"{key}, a data object of a committed version, is missing from store "
                f"{self.source.url}"
            ) from None
        _check_frames(data, frames)
        self.dest.put(key, data)
        tally.add(len(data))

    # --- following ----------------------------------------------------------------------

    def watch(
        self,
        *,
        stop: threading.Event | None = None,
        interval: float = 5.0,
        max_interval: float = 60.0,
        on_report: Callable[[MirrorReport], None] | None = None,
    ) -> None:
        """Run :meth:`run_once` until ``stop`` is set, waiting between passes as ``pull
        --watch`` does (:class:`~deltastore.sync.poll.PollSchedule`). A damaged source
        version or a store error is logged and retried; the damaged version is skipped once
        an anchor or anchor copy follows it."""
        stop = stop or threading.Event()
        schedule = PollSchedule(interval, max_interval)
        while not stop.is_set():
            try:
                report = self.run_once()
                if report.copied:
                    schedule.found()
                    if on_report is not None:
                        on_report(report)
                else:
                    schedule.idle()
            except (IntegrityError, FrameError, ManifestError, ChainError) as exc:
                schedule.failed()
                log.warning("%s", exc)
            except StoreError as exc:
                schedule.failed()
                log.warning("store error, retrying in about %.1f s: %s", schedule.wait, exc)
            stop.wait(schedule.delay())

    def close(self) -> None:
        """Release the lease on the source (best effort)."""
        self._lease.release()

    def __enter__(self) -> Mirror:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_frames(data: bytes, frames: Sequence[Frame]) -> None:
    """Raise unless each of ``frames`` is whole in ``data`` (their object) with its XXH3-64
    and, when recorded, its BLAKE3."""
    view = memoryview(data)
    for f in frames:
        check_stored(f, view[f.offset : f.offset + f.length])


def mirror(
    source: str | os.PathLike[str] | Store, dest: str | os.PathLike[str] | Store, **options: Any
) -> MirrorReport:
    """One pass of :class:`Mirror` (``options`` are its keyword options), then close."""
    with Mirror(source, dest, **options) as m:
        return m.run_once()


__all__ = ["Mirror", "MirrorReport", "mirror"]
