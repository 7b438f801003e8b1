"""Checkpoint folders: publish a safetensors checkpoint, keep a folder in sync in place.

:func:`publish_checkpoint` reads a ``.safetensors`` file or HF-style folder through memory maps
(never all in RAM) and publishes it, as a delta against ``parent`` (checked against the store's
newest version), against the publisher's saved state in ``state_dir``, or as an anchor.

:func:`pull_checkpoint` brings a folder to a committed version: an empty folder is created
from the newest anchor; an existing one is updated in place through writable memory maps (no
second copy on disk or in RAM). The folder's version and per-tensor Adler-32 live in the
sidecar ``.deltastore.json``, replaced atomically after each version is written and flushed,
so a failed pull leaves the folder at its last recorded version, loadable by safetensors.

A pull that writes first creates the marker ``.deltastore.pending`` ("a pull is under way")
and removes it after the sidecar is written. A process killed meanwhile leaves the marker and
possibly tensors at several versions (or half written). The next pull then finds where each
tensor is by its Adler-32 (compared with the manifests of the recorded version and of the
chain to the target; the sidecar and the marker are not trusted for that), advances the
tensors at an older version with a :class:`Subscriber` over just those tensors, rebuilds the
tensors at no version from the newest anchor at or below the target, checks every tensor
against the target, and only then writes the sidecar (:class:`FolderRepair`). Without the
marker (a folder changed by hand) a mismatch is an error unless ``repair=True``.

A target whose tensor table differs from the folder's (a tensor added, removed, reshaped or
retyped) is built as new files in the staging folder ``.deltastore.next`` beside the old ones,
from the newest anchor at or below it; the old files stay valid until the new ones are complete
and durable, then they are switched (see :mod:`deltastore.checkpoint.state`). A folder whose
recorded state does not fit the store's chain (another state of its version, after a
publisher race) is brought back onto it from the newest anchor at or below the target, with a
warning.

Ctrl-C (a ``KeyboardInterrupt`` in the main thread) never leaves the files ahead of the
sidecar: it is held back from the start of a version's write phase until the version is
recorded (:mod:`deltastore.checkpoint.interrupts`). Files created by a pull get their disk
blocks before they are written through memory maps, so a full disk or quota raises
:class:`~deltastore.errors.DiskFullError` (the files being created removed, the folder at its
recorded version) instead of killing the process with SIGBUS.

Not safe to run two pulls into the same folder at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

from deltastore.checkpoint.interrupts import DeferredSignals
from deltastore.checkpoint.safetensors import (
    INDEX_NAME,
    CheckpointError,
    MappedCheckpoint,
    create_checkpoint,
    locate,
    table_of,
)
from deltastore.checkpoint.state import (
    PENDING,
    SIDECAR,
    SIDECAR_FORMAT,
    STAGING,
    FolderRepair,
    FolderState,
    begin,
    commit_switch,
    end,
    few_names,
    finish_switch,
    fsync_files,
    n_tensors,
    no_room_to_switch,
    not_recorded,
    read_state,
    switch_files,
    write_json,
)
from deltastore.errors import (
    ChainError,
    DiskFullError,
    ManifestNotFoundError,
    ObjectNotFoundError,
    StoreError,
    TensorMismatchError,
)
from deltastore.format.checksum import adler32
from deltastore.format.manifest import Manifest, state_digest
from deltastore.layout.boxes import Layout
from deltastore.progress import ProgressFn
from deltastore.publish.publisher import Publisher, PublishReport
from deltastore.store import open_store
from deltastore.store.registry import store_url
from deltastore.store.space import no_room
from deltastore.sync.lease import default_reader_id
from deltastore.sync.poll import PollSchedule
from deltastore.sync.subscriber import Subscriber, SyncReport
from deltastore.tensors.dtypes import host_words
from deltastore.tensors.host import HostTensor, Tensors
from deltastore.tensors.tables import table_of_manifest

log = logging.getLogger(__name__)


def default_state_dir(url: str) -> Path:
    """Per-store publisher state folder under the user's cache (``$XDG_CACHE_HOME``), named
    by a hash of :func:`~deltastore.store.registry.store_url` (a local folder: its resolved
    path), so that every spelling of one store shares one state."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = hashlib.sha256(store_url(url).encode()).hexdigest()[:16]
    return cache / "deltastore" / "publisher" / name


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
    tensors = MappedCheckpoint(locate(src)).host
    if parent is not None and not anchor:
        pub.attach(MappedCheckpoint(locate(parent)).host)
    return pub.publish(tensors, version=version, anchor=True if anchor else None, progress=progress)


def _write_state(dest: Path, m: Manifest) -> None:
    body = {
        "format": SIDECAR_FORMAT,
        "version": m.version,
        "state_digest": m.state_digest,
        "adler32": {n: e.adler32 for n, e in m.tensors.items()},
    }
    write_json(dest, SIDECAR, body)


def checksums(tensors: Tensors) -> dict[str, int]:
    """Adler-32 of each tensor's bytes (host or torch tensors; one read of every tensor, one at
    a time)."""
    return {name: adler32(host_words(t)) for name, t in tensors.items()}


class FolderSync:
    """A subscriber over a checkpoint folder; keeps the mapping open between pulls.

    ``repair``: what a pull does with a folder whose tensors are not all at its recorded
    version. ``None`` (default): repair it when a pull was interrupted there (the marker
    ``.deltastore.pending`` exists), else raise :class:`TensorMismatchError`; ``True``: always
    repair; ``False``: never. :attr:`last_repair` says what the last repair found and did.
    A target with another tensor table than the folder's is built beside it and switched
    for it (see the module docstring). ``subscriber_options`` go to every
    :class:`Subscriber` the folder uses (the folder's, a rebuild's, a repair's); they share one
    ``reader_id``, hence one lease (default: one :func:`~deltastore.sync.lease.default_reader_id`
    per ``FolderSync``).
    """

    def __init__(
        self,
        url: str,
        dest: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        repair: bool | None = None,
        **subscriber_options: Any,
    ) -> None:
        self.dest = Path(dest)
        # one reader id for every subscriber of this folder (the folder's, a rebuild's, a
        # repair's), so that they keep one lease and leave none behind
        subscriber_options.setdefault("reader_id", default_reader_id())
        self._url, self._opts, self._sub_opts = url, storage_options, subscriber_options
        self._repair = repair
        # Ctrl-C held back from a version's first write until its record (see _recorded)
        self._signals = DeferredSignals()
        self._ckpt: MappedCheckpoint | None = None
        self._sub: Subscriber[HostTensor] | None = None
        self._state: FolderState | None = None
        self._checked = self._reopen = False
        self.last_repair: FolderRepair | None = None
        self._open()

    def _open(self) -> None:
        """Finish a switch to new files that a pull committed, then map the folder."""
        self._ckpt = self._sub = None
        self._checked = False
        if self.dest.is_dir():
            with self._signals.held():  # a switch is finished whole (or not started)
                finish_switch(self.dest)
        self._state = read_state(self.dest)
        if self._state is not None:
            self._ckpt = MappedCheckpoint(locate(self.dest), writable=True)
            # its state: once checked
            self._sub = self._subscriber(self._ckpt.host, recorded=True)
        elif self.dest.exists() and any(self.dest.iterdir()) and not (self.dest / PENDING).exists():
            raise CheckpointError(
                f"{self.dest} is not empty and holds no {SIDECAR}: pull into an empty or new "
                "folder (deltastore only updates folders it created)"
            )
        self._reopen = False

    @property
    def version(self) -> int | None:
        """The version the folder is at (None: not created yet)."""
        return self._state.version if self._state is not None else None

    def latest(self) -> int | None:
        """Newest committed version in the store."""
        return (self._sub or self._probe()).latest()

    def _subscriber(
        self,
        tensors: MutableMapping[str, HostTensor] | None,
        version: int | None = None,
        names: list[str] | None = None,
        *,
        recorded: bool = False,
    ) -> Subscriber[HostTensor]:
        """A subscriber over ``tensors``; ``recorded``: one whose versions :meth:`_recorded`
        records, so Ctrl-C is held back from the start of each write phase (its ``pause``
        hook, before the caller's) until the version is recorded."""
        opts = dict(self._sub_opts)
        if names is not None:  # hold and sync only these tensors
            opts["layout"] = Layout.identity(names)
        if recorded:
            user_pause = opts.get("pause")

            def pause() -> None:
                self._signals.hold()
                if user_pause is not None:
                    user_pause()

            opts["pause"] = pause
        return Subscriber(
            self._url, storage_options=self._opts, tensors=tensors, version=version, **opts
        )

    def _probe(self) -> Subscriber[HostTensor]:
        """A subscriber without tensors, for reading manifests (with the keys given)."""
        keys = ("signing_key", "trusted_keys")
        extra = {k: v for k, v in self._sub_opts.items() if k in keys}
        return Subscriber(self._url, storage_options=self._opts, **extra)

    def _target(self, version: int | None) -> tuple[Subscriber[HostTensor], int]:
        probe = self._sub or self._probe()
        target = probe.latest() if version is None else version
        if target is None:
            raise ManifestNotFoundError(f"store {probe.store.url} holds no committed version yet")
        return probe, target

    def pull(self, version: int | None = None, *, progress: ProgressFn | None = None) -> SyncReport:
        """Bring the folder to ``version`` (default: newest); see the module docstring."""
        if self._reopen:  # a switch this object committed (or its reopening) was left undone
            self._open()
        if self._sub is None:
            return self._create(version, progress)
        sub, ckpt, state = self._sub, self._ckpt, self._state
        if ckpt is None or state is None:  # pragma: no cover - set together with _sub
            raise CheckpointError("folder is not open")
        _, target = self._target(version)
        goal = sub.manifest(target)
        new_table = table_of(ckpt.host) != table_of_manifest(goal)
        if not self._checked:
            bad = self._differing(ckpt, state)
            if bad:
                if not (self._repair or (self._repair is None and (self.dest / PENDING).exists())):
                    raise TensorMismatchError(
                        f"{self.dest}: the files differ from its recorded version "
                        f"{state.version} in {n_tensors(len(bad))} (Adler-32 mismatch: "
                        f"{few_names(tuple(bad))}): the folder was changed by something other "
                        "than a pull; pull into a new folder"
                    )
                if new_table:  # the new files are built from an anchor whatever these hold
                    return self._rewrite(goal, progress)
                return self._repair_to(ckpt, target, progress)
            sub._hold(state.version, state.state_digest, state.adler32)
            self._checked = True
        if new_table:
            return self._rewrite(goal, progress)
        if target == state.version and goal.state_digest == state.state_digest:
            return sub.sync(target, progress=progress)
        return self._recorded(
            ckpt,
            state.version,
            target,
            lambda rec: sub.sync(target, progress=progress, on_version=rec),
        )

    def _differing(self, ckpt: MappedCheckpoint, state: FolderState) -> list[str]:
        """Tensors whose content is not the recorded state's (one read of every tensor); the
        names, dtypes and shapes are checked too, through the state digest."""
        have = checksums(ckpt.host)
        rows = ((n, d, list(s), have[n]) for n, (d, s) in table_of(ckpt.host).items())
        if state_digest(rows) == state.state_digest:
            return []
        names = set(have) | set(state.adler32)
        bad = sorted(n for n in names if have.get(n) != state.adler32.get(n))
        return bad or sorted(have)  # the same checksums, other dtypes or shapes

    def _rewrite(self, goal: Manifest, progress: ProgressFn | None) -> SyncReport:
        """Bring the folder to ``goal``, whose tensor table is not the folder's: build its
        files in the staging folder from the newest anchor at or below it, make them durable,
        then switch them for the folder's (the old ones stay valid until then)."""
        t_start = time.perf_counter()
        recorded = self._state.version if self._state is not None else None
        if recorded is not None and goal.version < recorded:
            raise ChainError(
                f"{self.dest} is at version {recorded}, newer than the requested "
                f"{goal.version}: a folder does not go back; pull that version into a new folder"
            )
        stage = self.dest / STAGING
        shutil.rmtree(stage, ignore_errors=True)
        try:
            with self._signals.held():
                begin(self.dest, recorded, goal.version)
            stage.mkdir()
            try:
                files = create_checkpoint(stage, table_of_manifest(goal))
                ckpt = MappedCheckpoint(files, writable=True)
                report = self._subscriber(ckpt.host).sync(goal.version, progress=progress)
                with no_room(stage, f"the new files of version {goal.version}"):
                    ckpt.flush()
                    fsync_files(stage)
                    _write_state(stage, goal)
            except DiskFullError as exc:
                raise no_room_to_switch(self.dest, exc, recorded, goal.version) from None
            log.info(
                "%s: version %d has another tensor table: new files built",
                self.dest,
                goal.version,
            )
            with self._signals.held():  # the commit point, and this object knowing of it
                commit_switch(self.dest, recorded, goal.version)
                self._reopen = True
        except BaseException:
            with self._signals.held():
                if switch_files(self.dest) is None:  # not committed: the folder is unchanged
                    shutil.rmtree(stage, ignore_errors=True)
                    end(self.dest)
            raise
        self._open()  # finishes the switch; a later pull does if this fails
        if self._sub is None or self._state is None:  # pragma: no cover - the switch wrote both
            raise CheckpointError(f"{self.dest}: the switch to version {goal.version} failed")
        self._sub._hold(self._state.version, self._state.state_digest, self._state.adler32)
        self._checked = True
        return dataclasses.replace(
            report, from_version=recorded, total_s=time.perf_counter() - t_start
        )

    def _recorded(
        self,
        ckpt: MappedCheckpoint,
        recorded: int | None,
        target: int,
        sync: Callable[[Callable[[Manifest], None]], SyncReport],
    ) -> SyncReport:
        """Run ``sync`` between the pending marker's creation and removal; each version it
        applies is flushed, then recorded in the sidecar. The marker stays when recording
        failed (the files may then be ahead of the sidecar: the next pull repairs them).

        Ctrl-C (SIGINT, and SIGTERM where Python handles it) is held back from the start of a
        version's write phase (the subscriber's ``pause`` hook, see :meth:`_subscriber`) or of
        its record until the sidecar is replaced (:class:`DeferredSignals`): an interrupt
        lands before the first write (the subscriber writes nothing, or rolls a failed write
        back) or after the record, so the files are always at the recorded version."""
        unrecorded = False

        def record(m: Manifest) -> None:
            nonlocal unrecorded
            self._signals.hold()  # already held when the version went through a write phase
            unrecorded = True
            try:
                with no_room(self.dest, f"the record of version {m.version}"):
                    ckpt.flush()
                    _write_state(self.dest, m)
            except DiskFullError as exc:
                raise not_recorded(self.dest, exc, m.version) from None
            self._state = FolderState(
                m.version, m.state_digest, {n: e.adler32 for n, e in m.tensors.items()}
            )
            unrecorded = False
            self._signals.release()  # a Ctrl-C held back is raised here, once recorded

        try:
            with self._signals.held():
                begin(self.dest, recorded, target)
            report = sync(record)
        except BaseException:
            if not unrecorded:  # the subscriber left the files at the recorded version
                end(self.dest)
            self._signals.release()
            raise
        with self._signals.held():
            end(self.dest)
        return report

    def _create(self, version: int | None, progress: ProgressFn | None) -> SyncReport:
        probe, target = self._target(version)
        m = probe.manifest(target)
        table = {n: (e.dtype, tuple(e.shape)) for n, e in m.tensors.items()}
        existed = self.dest.exists()
        if (self.dest / PENDING).exists():  # the first pull into this folder was interrupted
            try:
                locs = locate(self.dest)
            except CheckpointError:
                locs = {}
            if {n: (loc.dtype, loc.shape) for n, loc in locs.items()} == table:
                return self._repair_to(MappedCheckpoint(locs, writable=True), target, progress)
            for child in self.dest.iterdir():  # files for another table, or half created
                if child.name.endswith(".safetensors") or child.name == INDEX_NAME:
                    child.unlink()
        try:
            self.dest.mkdir(parents=True, exist_ok=True)
            begin(self.dest, None, target)
            ckpt = MappedCheckpoint(create_checkpoint(self.dest, table), writable=True)
        except BaseException:
            with self._signals.held():
                self._remove_created(existed)
            raise
        sub = self._subscriber(ckpt.host, recorded=True)
        try:
            return self._recorded(
                ckpt, None, target, lambda rec: sub.sync(target, progress=progress, on_version=rec)
            )
        except BaseException:
            with self._signals.held():
                if read_state(self.dest) is None:
                    self._remove_created(existed)  # nothing usable was written: leave no debris
            raise
        finally:
            self._state = read_state(self.dest)
            if self._state is not None:  # at least one version was recorded
                self._ckpt, self._sub, self._checked = ckpt, sub, True

    def _remove_created(self, existed: bool) -> None:
        if not self.dest.exists():
            return
        if existed:
            for child in self.dest.iterdir():
                if child.is_dir():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        else:
            shutil.rmtree(self.dest, ignore_errors=True)

    # --- repair -------------------------------------------------------------------------

    def _candidates(
        self, probe: Subscriber[HostTensor], goal: Manifest, recorded: int | None
    ) -> list[Manifest]:
        """Versions a tensor of the folder may be at and advance from to ``goal``: the chain
        from ``goal`` back to the recorded version or the first anchor, and the recorded
        version when that anchor is above it (an anchor applies to any state)."""
        out, m = [goal], goal
        while (
            m.kind == "delta"
            and m.parent is not None
            and (recorded is None or m.version > recorded)
        ):
            try:
                m = probe.manifest(m.parent.version)
            except ManifestNotFoundError:
                break
            out.append(m)
        if (
            recorded is not None
            and recorded not in {c.version for c in out}
            and out[-1].kind == "anchor"
            and out[-1].version > recorded
        ):
            with contextlib.suppress(ManifestNotFoundError):
                m = probe.manifest(recorded)
                if table_of_manifest(m) == table_of_manifest(goal):  # else: rebuilt
                    out.append(m)
        return out

    def _repair_to(
        self, ckpt: MappedCheckpoint, target: int, progress: ProgressFn | None
    ) -> SyncReport:
        """Bring a folder whose tensors are at several versions, or at none, to ``target``."""
        t_start = time.perf_counter()
        state = read_state(self.dest)
        recorded = state.version if state is not None else None
        if recorded is not None and target < recorded:
            raise ChainError(
                f"{self.dest} was recorded at version {recorded}, newer than the requested "
                f"{target}, and its tensors are not all at that version: pull a version at or "
                f"above {recorded} to repair it"
            )
        probe = self._probe()
        goal = probe.manifest(target)
        if table_of(ckpt.host) != {n: (e.dtype, tuple(e.shape)) for n, e in goal.tensors.items()}:
            raise TensorMismatchError(
                f"{self.dest} holds other tensors (names, dtypes or shapes) than version "
                f"{target}; it cannot be repaired in place: pull into a new folder"
            )
        candidates = self._candidates(probe, goal, recorded)
        found: dict[int, list[str]] = {}
        rebuilt: list[str] = []
        for name, value in checksums(ckpt.host).items():
            want = goal.tensors[name]
            at = [
                c.version
                for c in candidates
                if (e := c.tensors.get(name)) is not None
                and (e.adler32, e.dtype, e.shape) == (value, want.dtype, want.shape)
            ]
            (found.setdefault(max(at), []) if at else rebuilt).append(name)
        if not (self.dest / PENDING).exists():
            begin(self.dest, recorded, target)
        groups: list[tuple[list[str], int | None]] = [
            (names, v) for v, names in sorted(found.items()) if v != target
        ]
        groups += [(rebuilt, None)] if rebuilt else []
        runs = [
            (
                names,
                self._subscriber({n: ckpt.host[n] for n in names}, v, names).sync(
                    target, progress=progress
                ),
            )
            for names, v in groups
        ]
        anchor = runs[-1][1].applied[0] if rebuilt else None
        ckpt.flush()
        sub = self._subscriber(ckpt.host, target, recorded=True)
        t_verify = time.perf_counter()
        sub.verify()  # every tensor at the target before anything is recorded
        verify_s = time.perf_counter() - t_verify
        # what was fetched and changed: the frames of each group's tensors only (read before
        # the state is recorded, so nothing can fail once the folder is repaired)
        held = [probe.manifest(v).tensors[n] for names, r in runs for v in r.applied for n in names]
        with self._signals.held(), no_room(self.dest, f"version {target}"):
            _write_state(self.dest, goal)
            end(self.dest)
        self._ckpt, self._sub, self._checked = ckpt, sub, True
        self._state = FolderState(
            target, goal.state_digest, {n: e.adler32 for n, e in goal.tensors.items()}
        )
        self.last_repair = FolderRepair(
            recorded,
            target,
            {v: tuple(names) for v, names in sorted(found.items())},
            tuple(rebuilt),
            anchor,
        )
        log.warning("%s: %s", self.dest, self.last_repair.summary())
        reports = [r for _, r in runs]
        applied = tuple(sorted({v for r in reports for v in r.applied}))
        return SyncReport(
            version=target,
            from_version=recorded,
            applied=applied,
            kind="anchor"
            if any(r.kind == "anchor" for r in reports)
            else "delta"
            if applied
            else "none",
            changed_elements=sum(e.changed for e in held),
            total_elements=goal.total_elements,
            payload_bytes=sum(f.length for e in held for f in e.frames),
            dense_bytes=goal.dense_bytes,
            frames=sum(len(e.frames) for e in held),
            fetch_s=sum(r.fetch_s for r in reports),
            decode_s=sum(r.decode_s for r in reports),
            verify_s=sum(r.verify_s for r in reports) + verify_s,
            pause_s=sum(r.pause_s for r in reports),
            total_s=time.perf_counter() - t_start,
        )


def pull_checkpoint(
    url: str,
    dest: str | os.PathLike[str],
    *,
    version: int | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: ProgressFn | None = None,
    repair: bool | None = None,
    **subscriber_options: Any,
) -> SyncReport:
    """Bring the checkpoint folder ``dest`` to ``version`` (default: the newest); ``repair``
    as in :class:`FolderSync`."""
    folder = FolderSync(
        url, dest, storage_options=storage_options, repair=repair, **subscriber_options
    )
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
    repair: bool | None = None,
    **subscriber_options: Any,
) -> None:
    """Poll the store and pull each new version into ``dest`` until ``stop`` is set.

    Each poll is one request. Waits ``interval`` seconds after a new version, 1.5 times
    longer after each poll that finds nothing new and twice as long after a transient store
    error, never more than ``max_interval`` (±20% jitter;
    :class:`~deltastore.sync.poll.PollSchedule`). Other errors propagate. ``repair`` as in
    :class:`FolderSync`.
    """
    stop = stop or threading.Event()
    schedule = PollSchedule(interval, max_interval)
    folder = FolderSync(
        url, dest, storage_options=storage_options, repair=repair, **subscriber_options
    )
    while not stop.is_set():
        try:
            latest = folder.latest()
            if latest is not None and latest != folder.version:
                report = folder.pull(latest)
                if on_report is not None:
                    on_report(report)
                schedule.found()
            else:
                schedule.idle()
        except StoreError as exc:
            if isinstance(exc, ObjectNotFoundError) and not isinstance(exc, ManifestNotFoundError):
                raise  # a committed version lost a data object: retrying cannot help
            schedule.failed()
            log.warning("store error, retrying in about %.1f s: %s", schedule.wait, exc)
        stop.wait(schedule.delay())


__all__ = [
    "PENDING",
    "SIDECAR",
    "FolderRepair",
    "FolderState",
    "FolderSync",
    "checksums",
    "default_state_dir",
    "publish_checkpoint",
    "pull_checkpoint",
    "read_state",
    "watch_checkpoint",
]
