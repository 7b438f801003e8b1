"""Garbage collection of orphans: data objects that no committed manifest references.

A publish that fails or is killed before its manifest is created, or loses a race for its
version, leaves its data objects under ``versions/<v:020d>/`` (readers ignore them, format
v1 section 3.2). :func:`find_orphans` lists them and :func:`gc` removes them. An orphan is

- a key under ``versions/`` that no committed manifest names in a frame's ``object``, or
- a local store's temporary file (``.tmp-*`` under the root, ``manifests/`` or
  ``versions/``), left by a process killed in the middle of a write.

What is never removed: an object a committed manifest references (every manifest is read;
if one cannot be parsed or names another version than its key, nothing is removed and
:class:`ManifestError` is raised), manifests, ``LATEST``, and anything outside ``versions/``
except the local temporary files. What is kept
because a publish may still be writing it (``min_age_s``, default one hour; 0 removes these
too):

- on a store that gives object ages (a local folder): every orphan modified less than
  ``min_age_s`` seconds ago, whatever its version;
- on a store that does not (S3, GCS, Azure through the :class:`Store` interface): every
  orphan not under the folder of a version at or below the newest committed one.

Except, on every store and whatever their age or version: the parts of a sharded writers' run
that can never be committed (that run gave the version up or a restart abandoned it: its
``abort.json``; or a newer run superseded it, :mod:`deltastore.publish.runs`) and the data
objects those parts name are removed; the abort marker stays while its version is above the
newest committed one.

The remaining window: a publisher writing version ``v`` checks the chain head right before
its manifest create and gives up when a newer version exists. Only if another publisher
commits past ``v`` *and* a gc (on a store without ages, or with ``min_age_s`` shorter than
the stall) removes ``v``'s objects, both between that check and the create, does it commit a
manifest that names deleted objects. Run gc on object stores when no publisher is stalled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltastore.catalog.chain import ChainReader, Damaged
from deltastore.errors import ManifestError, ObjectNotFoundError, StoreError
from deltastore.format.keys import DATA_PREFIX, MANIFEST_PREFIX
from deltastore.maintenance.retention import DEFAULT_LEASE_GRACE_S, RetentionReport, retain
from deltastore.publish.parts import parse_part
from deltastore.publish.runs import RUN_ABORT_KEY, abort_key, current_run, group_parts
from deltastore.store import LocalStore, Store, open_store

#: Orphans younger than this many seconds are kept by default: a publish may be writing them.
DEFAULT_MIN_AGE_S = 3600.0

_VERSION_FOLDER = re.compile(r"versions/([0-9]{20})/")
_TEMP_PREFIX = ".tmp-"


@dataclass(frozen=True)
class Orphan:
    """An object no committed manifest references."""

    #: Store key; for a local temporary file, its path relative to the store root.
    key: str
    #: Version of the ``versions/<v:020d>/`` folder it lies in (None: not in one).
    version: int | None
    #: Whether it is a local store's temporary file (not a key).
    temporary: bool
    #: Size in bytes (None when the store does not tell).
    size: int | None
    #: Seconds since it was last modified (None when the store does not tell).
    age_s: float | None
    #: Why :func:`gc` keeps it (a publish may be in flight); None when it is removed.
    kept: str | None


@dataclass(frozen=True)
class GcReport:
    """What :func:`gc` found and removed (or, with ``dry_run``, would remove)."""

    store: str
    #: Newest committed version (None: the store has none).
    newest: int | None
    #: Committed manifests read.
    manifests: int
    #: Distinct objects they reference.
    referenced: int
    #: Every orphan found, removed or kept, sorted by key.
    orphans: tuple[Orphan, ...]
    #: Keys (and temporary file paths) removed, or that would be with ``dry_run``.
    removed: tuple[str, ...]
    dry_run: bool
    min_age_s: float
    #: What ``keep=N`` retention kept and deleted (None: not asked for).
    retention: RetentionReport | None = None

    @property
    def kept(self) -> tuple[Orphan, ...]:
        """Orphans kept because a publish may still be writing them."""
        return tuple(o for o in self.orphans if o.kept is not None)

    @property
    def removed_bytes(self) -> int:
        """Bytes of the removed orphans whose size is known."""
        gone = set(self.removed)
        return sum(o.size or 0 for o in self.orphans if o.key in gone)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["removed_bytes"] = self.removed_bytes
        if self.retention is not None:
            out["retention"]["deleted_bytes"] = self.retention.deleted_bytes
        return out


@dataclass(frozen=True)
class _Scan:
    newest: int | None
    manifests: int
    referenced: int
    orphans: list[Orphan]


def find_orphans(
    url: str | os.PathLike[str] | Store,
    *,
    min_age_s: float = DEFAULT_MIN_AGE_S,
    storage_options: dict[str, Any] | None = None,
) -> list[Orphan]:
    """Every orphan of the store, sorted by key; :attr:`Orphan.kept` says which :func:`gc`
    with the same ``min_age_s`` would keep. Removes nothing."""
    return _scan(open_store(url, storage_options), min_age_s).orphans


def gc(
    url: str | os.PathLike[str] | Store,
    *,
    orphans: bool = False,
    keep: int | None = None,
    dry_run: bool = False,
    min_age_s: float = DEFAULT_MIN_AGE_S,
    lease_grace_s: float = DEFAULT_LEASE_GRACE_S,
    storage_options: dict[str, Any] | None = None,
) -> GcReport:
    """Collect the store's garbage; with ``dry_run``, remove nothing and report what would be.

    ``keep=N``: delete the committed versions that neither the newest ``N`` versions nor a
    live reader lease need (:func:`deltastore.maintenance.retention.retain`; leases count
    until ``lease_grace_s`` seconds after they expire), manifests before their objects, oldest
    first. ``orphans=True``: then remove the orphans, except those kept by ``min_age_s``; an
    orphan that disappears meanwhile is skipped. At least one of the two is required."""
    if not orphans and keep is None:
        raise ValueError(
            "nothing to collect: pass keep=N and/or orphans=True (CLI: --keep N, --orphans)"
        )
    store = open_store(url, storage_options)
    retention = (
        None if keep is None else retain(store, keep, dry_run=dry_run, grace_s=lease_grace_s)
    )
    removed: list[str] = []
    scan = _scan(store, min_age_s) if orphans else _Scan(None, 0, 0, [])
    for orphan in scan.orphans:
        if orphan.kept is None:
            if not dry_run:
                _remove(store, orphan)
            removed.append(orphan.key)
    return GcReport(
        store=store.url,
        newest=scan.newest,
        manifests=scan.manifests,
        referenced=scan.referenced,
        orphans=tuple(scan.orphans),
        removed=tuple(removed),
        dry_run=dry_run,
        min_age_s=min_age_s,
        retention=retention,
    )


def _scan(store: Store, min_age_s: float) -> _Scan:
    if not min_age_s >= 0:
        raise ValueError(f"min_age_s must be 0 or more, got {min_age_s!r}")
    versions: set[int] = set()
    referenced: set[str] = set()
    reader = ChainReader(store)
    _read_manifests(reader, versions, referenced)
    keys = store.list(DATA_PREFIX)
    root = store.root if isinstance(store, LocalStore) else None
    temps = _temp_files(root) if root is not None else []
    # Versions committed while the objects were listed reference some of them: read again.
    _read_manifests(reader, versions, referenced)
    newest = max(versions, default=None)
    dead = _dead_run_keys(store, keys, newest)
    now = time.time()
    found: list[Orphan] = []
    for key, temporary in [(k, False) for k in keys if k not in referenced] + temps:
        size = age = None
        if root is not None:
            try:
                st = (root / key).stat()
            except FileNotFoundError:
                continue  # removed meanwhile
            size, age = st.st_size, max(0.0, now - st.st_mtime)
        match = _VERSION_FOLDER.match(key)
        version = int(match.group(1)) if match else None
        kept = None if key in dead else _kept(version, age, newest, min_age_s)
        found.append(Orphan(key, version, temporary, size, age, kept))
    found.sort(key=lambda o: o.key)
    return _Scan(newest, len(versions), len(referenced), found)


def _dead_run_keys(store: Store, keys: list[str], newest: int | None) -> set[str]:
    """Keys that can never be part of a commit, whatever their age and version: the parts of
    sharded writers' runs that were aborted or abandoned for a version (its ``abort.json``) or
    superseded by a newer run (:mod:`deltastore.publish.runs`), and the data objects those
    parts name. An abort marker itself stays while its version is above ``newest`` (it is what
    refuses a late commit with a clear error)."""
    present = set(keys)
    folders = {(v, r): parts for (v, r), parts in group_parts(keys).items() if r is not None}
    for key in keys:
        m = RUN_ABORT_KEY.match(key)
        if m is not None:
            folders.setdefault((int(m.group(1)), m.group(2)), [])
    if not folders:
        return set()
    current = current_run(store)
    dead: set[str] = set()
    for (version, run), parts in folders.items():
        marker = abort_key(version, run)
        if marker not in present and (current is None or run == current):
            continue  # a live run's parts: the age rules apply
        if marker in present and newest is not None and version <= newest:
            dead.add(marker)
        for key in parts:
            dead.add(key)
            try:
                part = parse_part(store.get(key), key=key)
            except (ObjectNotFoundError, ManifestError):
                continue  # gone meanwhile, or unreadable: the part key goes, its objects age
            tensors = [*part.tensors.values(), *(part.anchor_copy or {}).values()]
            dead.update(f.object for t in tensors for f in t.frames)
    return dead


def _read_manifests(reader: ChainReader, versions: set[int], referenced: set[str]) -> None:
    """Add the committed versions not in ``versions`` and the objects they reference; raise
    when one of them cannot be read (its objects are unknown: nothing may be removed)."""
    chain = reader.read_all(_refuse, skip=versions)
    for version, manifest in chain.manifests.items():
        versions.add(version)
        referenced.update(manifest.objects)
    for copy in chain.copies.values():  # an anchor copy's objects are never orphans
        referenced.update(copy.objects)


def _refuse(damaged: Damaged) -> None:
    """Stop gc at a manifest that cannot be read: a missing one raises the store's error
    (:class:`ObjectNotFoundError`), any other a :class:`ManifestError` that says so."""
    if isinstance(damaged.error, ObjectNotFoundError):
        raise damaged.error
    raise ManifestError(
        f"{damaged.error}; gc removes nothing while a committed manifest cannot be read (the "
        "objects it references are unknown): repair or inspect it first"
    ) from damaged.error


def _kept(version: int | None, age: float | None, newest: int | None, min_age: float) -> str | None:
    if min_age <= 0:
        return None
    if age is not None:
        return f"younger than {min_age:g} s: a publish may be writing it" if age < min_age else None
    if version is None or newest is None or version > newest:
        return (
            "not below the newest committed version and the store gives no ages: a publish "
            "may be writing it (min age 0 removes it)"
        )
    return None


def _temp_files(root: Path) -> list[tuple[str, bool]]:
    """A local store's ``.tmp-*`` files: in the root, ``manifests/`` and under ``versions/``."""
    folders = [root, root / MANIFEST_PREFIX]
    folders += [Path(d) for d, _, _ in os.walk(root / DATA_PREFIX)]
    return sorted(
        (path.relative_to(root).as_posix(), True)
        for folder in folders
        if folder.is_dir()
        for path in folder.iterdir()
        if path.name.startswith(_TEMP_PREFIX) and path.is_file()
    )


def _remove(store: Store, orphan: Orphan) -> None:
    if orphan.temporary and isinstance(store, LocalStore):
        try:
            (store.root / orphan.key).unlink(missing_ok=True)
        except OSError as exc:
            raise StoreError(f"removing {orphan.key} in store {store.url} failed: {exc}") from exc
        return
    with contextlib.suppress(ObjectNotFoundError):  # removed meanwhile
        store.delete(orphan.key)


__all__ = ["DEFAULT_MIN_AGE_S", "GcReport", "Orphan", "find_orphans", "gc"]
