"""Retention: delete committed versions no reader needs (``gc --keep N``), honouring leases.

What is kept (format v1, section 4.3):

- the newest ``keep`` committed versions;
- every version from the oldest unexpired lease's up (``leases/<reader>.json``; a lease counts
  as live until ``grace_s`` seconds after its ``expires``, for clock skew between readers and
  gc);
- for every kept version, what reaching it from an anchor needs: the versions on its chain
  down to the newest anchor on it (an anchor version, or a delta with a usable anchor copy
  ``anchors/<v>.json``), so every kept version stays reachable from an anchor.

Everything else is deleted, oldest version first, and for each version its manifest first,
then its anchor copy, then its data objects (those no kept manifest or copy references): a
reader never finds a committed manifest whose objects are gone, and a gc killed at any point
leaves at most orphans (``gc --orphans`` removes them) and versions that are no longer
reachable and go in the next run. Expired leases are removed after the versions; a lease
that cannot be parsed is reported and kept (it may be a newer deltastore's).

A gc does not see a lease written after it read the leases: a reader that starts following
during a gc may find its versions gone, and then recovers from the newest anchor. Versions
committed during a gc are above the newest it saw and are never deleted by it.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timezone

from deltastore.catalog.chain import ChainReader
from deltastore.errors import DeltastoreError, ManifestError, ObjectNotFoundError
from deltastore.format.keys import (
    DATA_PREFIX,
    LEASE_PREFIX,
    anchor_key,
    manifest_key,
    reader_of_lease_key,
)
from deltastore.format.lease import LEASE_GRACE_S, parse_lease
from deltastore.format.manifest import Manifest
from deltastore.store import Store

log = logging.getLogger(__name__)

#: Seconds after its ``expires`` that a lease still counts as live (clock skew; spec
#: section 11.1).
DEFAULT_LEASE_GRACE_S = LEASE_GRACE_S

_VERSION_FOLDER = re.compile(r"versions/([0-9]{20})/")


@dataclass(frozen=True)
class LeaseInfo:
    """A lease found: its key, reader, version and expiry (None when it does not parse),
    whether it is live, and what is wrong with it (None: nothing)."""

    key: str
    reader: str | None
    version: int | None
    expires: str | None
    live: bool
    problem: str | None = None


@dataclass(frozen=True)
class DeletedVersion:
    """A committed version retention deletes: its number, kind, whether it has an anchor
    copy, its stored bytes (frames of its manifest and copy) and its keys, in delete order."""

    version: int
    kind: str
    copy: bool
    bytes: int
    keys: tuple[str, ...]


@dataclass(frozen=True)
class RetentionReport:
    """What retention kept and deleted (or, with ``dry_run``, would delete)."""

    keep: int
    #: The versions kept, ascending.
    kept: tuple[int, ...]
    #: Stored bytes of the kept versions' frames (manifests and copies).
    kept_bytes: int
    #: Why the oldest kept version is kept (``"newest N"``, ``"lease of READER"``, ``"anchor of
    #: version V"``); None when nothing is kept.
    oldest_kept_because: str | None
    deleted: tuple[DeletedVersion, ...]
    leases: tuple[LeaseInfo, ...]
    #: Expired lease keys removed (or that would be).
    expired_removed: tuple[str, ...]

    @property
    def deleted_bytes(self) -> int:
        return sum(d.bytes for d in self.deleted)


def retain(
    store: Store,
    keep: int,
    *,
    dry_run: bool = False,
    grace_s: float = DEFAULT_LEASE_GRACE_S,
    now: datetime | None = None,
) -> RetentionReport:
    """Delete the committed versions of ``store`` that neither the newest ``keep`` versions
    nor a live lease need (module docstring); ``dry_run``: delete nothing. Raises
    :class:`ManifestError` (deleting nothing) when a manifest needed to decide cannot be read,
    and the store's error when a delete fails (what was deleted before stays deleted, in the
    safe order)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a positive number of versions, got {keep!r}")
    if not grace_s >= 0:
        raise ValueError(f"grace_s must be 0 or more, got {grace_s!r}")
    now = now or datetime.now(timezone.utc)
    reader = ChainReader(store, cache=0)
    versions = reader.versions()
    copies = set(reader.anchor_versions())
    leases = _leases(store, now, grace_s)
    if not versions:
        return RetentionReport(keep, (), 0, None, (), tuple(leases), ())
    listed = set(versions)
    top = versions[-keep:]
    floors = [(top[0], f"newest {keep}")]
    floors += [
        (lease.version, f"lease of {lease.reader}")
        for lease in leases
        if lease.live and lease.version is not None
    ]
    floor, because = min(floors)
    manifests: dict[int, Manifest] = {}
    usable: dict[int, Manifest] = {}  # usable anchor copies by version

    def manifest(v: int) -> Manifest:
        if v not in manifests:
            m = manifests[v] = reader.manifest(v)
            if v in copies and m.kind == "delta" and (c := reader.usable_copy(m)) is not None:
                usable[v] = c
        return manifests[v]

    kept = {v for v in versions if v >= floor}
    needed: set[int] = set()  # the anchor copies kept: where a chain end's walk stops
    try:
        # where fresh readers of the newest versions start: the newest copy at or below each
        stops = [_walk(top[0], manifest, usable, listed, kept, through=True)]
        for v in sorted(kept, reverse=True):  # and every chain end's anchor
            m = manifest(v)
            if m.kind == "delta" and m.parent is not None and m.parent.version not in kept:
                stops.append(_walk(v, manifest, usable, listed, kept))
        needed.update(v for v in stops if v is not None)
    except DeltastoreError as exc:
        raise ManifestError(
            f"{exc}; retention deletes nothing while a kept version's chain cannot be read: "
            "run `deltastore verify` and repair or inspect it first"
        ) from exc
    needed |= {v for v in usable if v >= top[0]}  # where fresh readers of the newest start
    oldest = min(kept)
    if oldest < floor:
        because = f"anchor of version {floor} ({because})"
    doomed = [v for v in versions if v not in kept]
    # copies no reader starts from: of kept versions (a lease's range) and of no version
    dropped = sorted(v for v in copies if (v in kept and v not in needed) or v not in listed)
    keep_manifests = [*(manifests[v] for v in kept), *(usable[v] for v in needed)]
    deleted = _delete_plan(store, reader, doomed, dropped, copies, keep_manifests)
    if not dry_run:
        for d in deleted:
            for key in d.keys:
                with contextlib.suppress(ObjectNotFoundError):  # removed meanwhile
                    store.delete(key)
    expired = tuple(x.key for x in leases if not x.live and x.problem is None)
    if not dry_run:
        for key in expired:
            with contextlib.suppress(ObjectNotFoundError):
                store.delete(key)
    kept_bytes = sum(manifests[v].payload_bytes for v in kept)
    kept_bytes += sum(usable[v].payload_bytes for v in needed)
    return RetentionReport(
        keep, tuple(sorted(kept)), kept_bytes, because, tuple(deleted), tuple(leases), expired
    )


def _walk(
    v: int,
    read: Callable[[int], Manifest],
    usable: dict[int, Manifest],
    listed: set[int],
    kept: set[int],
    *,
    through: bool = False,
) -> int | None:
    """Add to ``kept`` the versions on ``v``'s chain down to its newest anchor; return the
    version of that anchor when it is a delta's anchor copy (None: an anchor version, or the
    chain breaks already: a missing parent, and nothing below can help). A parent already in
    ``kept`` is (or will be) walked on its own, so the walk stops there, unless ``through``."""
    while True:
        m = read(v)
        if v in usable:
            return v
        if m.kind == "anchor" or m.parent is None:
            return None
        v = m.parent.version
        if v not in listed or (v in kept and not through):
            return None
        kept.add(v)


def _delete_plan(
    store: Store,
    reader: ChainReader,
    doomed: list[int],
    dropped: list[int],
    copies: set[int],
    kept_manifests: Iterable[Manifest],
) -> list[DeletedVersion]:
    """The keys to delete in the safe order: per doomed version, oldest first, its manifest,
    its anchor copy, then its data objects; then per dropped anchor copy (of a kept version
    no reader starts from, or of a version that is not committed) the copy, then its data
    objects. Never an object that a kept manifest or copy references."""
    if not doomed and not dropped:
        return []
    referenced = frozenset().union(*(m.objects for m in kept_manifests))
    by_version: dict[int, list[str]] = {}
    for key in store.list(DATA_PREFIX):
        match = _VERSION_FOLDER.match(key)
        if match is not None and key not in referenced:
            by_version.setdefault(int(match.group(1)), []).append(key)
    out = []
    for v in doomed:
        size, kind, copy = 0, "?", v in copies
        with contextlib.suppress(DeltastoreError):  # sizes are informational
            m = reader.manifest(v)
            size, kind = m.payload_bytes, m.kind
        if copy:
            with contextlib.suppress(DeltastoreError):
                size += reader.anchor_copy(v).payload_bytes
        keys = [manifest_key(v)] + ([anchor_key(v)] if copy else []) + by_version.get(v, [])
        out.append(DeletedVersion(v, kind, copy, size, tuple(keys)))
    doomed_set = set(doomed)
    for v in dropped:
        if v in doomed_set:
            continue
        objects: list[str] = []
        size = 0
        try:
            c = reader.anchor_copy(v)
            size = c.payload_bytes
            objects = sorted(c.objects - referenced)
        except DeltastoreError:  # damaged: its objects are unknown, they stay (orphans)
            pass
        out.append(DeletedVersion(v, "anchor copy", True, size, (anchor_key(v), *objects)))
    return out


def _leases(store: Store, now: datetime, grace_s: float) -> list[LeaseInfo]:
    out = []
    for key in store.list(LEASE_PREFIX):
        reader = reader_of_lease_key(key)
        if reader is None:
            continue  # not a lease key: not ours to judge
        try:
            lease = parse_lease(store.get(key), key=key)
        except ObjectNotFoundError:
            continue  # released meanwhile
        except ManifestError as exc:
            out.append(LeaseInfo(key, reader, None, None, False, str(exc)))
            continue
        problem = None if lease.reader == reader else f"names reader {lease.reader!r}"
        live = problem is None and not lease.expired(now, grace_s)
        out.append(LeaseInfo(key, reader, lease.version, lease.expires, live, problem))
    return out


__all__ = ["DEFAULT_LEASE_GRACE_S", "DeletedVersion", "LeaseInfo", "RetentionReport", "retain"]
