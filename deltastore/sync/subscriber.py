"""Subscriber: brings local tensors to a committed version, in place, verified before writing.

Call order: ``Subscriber(url, tensors=..., version=...)``, then :meth:`Subscriber.latest` /
:meth:`Subscriber.sync` as often as wanted. One thread calls ``sync`` at a time; internally
frames are fetched and decoded on a pool of ``max_workers`` threads with at most
``max_inflight_bytes`` of stored frames in flight, each frame decoded as soon as it arrives.

Per version: fetch + decode every frame into staged changes (O(changed): positions, old and new
words), verify per-frame and per-tensor Adler-32, and only then write (the *pause*): scatters
of the new words. A failure before the pause leaves the tensors untouched; a failure during it
is rolled back from the gathered old words. The tensors are at the old version or the new one,
never in between.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, cast

import numpy as np

from deltastore.catalog.chain import ChainReader, Plan
from deltastore.errors import (
    ChainError,
    FrameError,
    IntegrityError,
    ManifestError,
    ManifestNotFoundError,
    ObjectNotFoundError,
    TensorMismatchError,
    WrongParentError,
)
from deltastore.format.chain import State
from deltastore.format.checksum import adler32
from deltastore.format.codecs import MAX_FRAME_BYTES, FrameDecoder
from deltastore.format.dtypes import itemsize, word_dtype
from deltastore.format.manifest import Manifest
from deltastore.format.ratios import SizeRatios
from deltastore.format.signing import FROM_ENV, KeyOption, TrustOption, resolve_trust
from deltastore.kernels import warm_in_background
from deltastore.layout.boxes import Layout
from deltastore.progress import ProgressFn
from deltastore.store import Store, open_store
from deltastore.store.counting import CountingStore, critical_path
from deltastore.sync.apply import Hooks, Sums, frame_totals, verify_tensors, write_phase, writes_of
from deltastore.sync.fetch import Fetcher, FrameTask, Timer, frame_tasks
from deltastore.sync.group import Group
from deltastore.sync.lease import DEFAULT_LEASE_TTL_S, LeaseKeeper
from deltastore.sync.priority import Priority, check_priority
from deltastore.sync.ranks import LayoutSync
from deltastore.sync.stage import Staged, check_frames, stage_batch, stage_frame
from deltastore.tensors.dtypes import WordViews, dtype_from_name, dtype_name, flat_words
from deltastore.tensors.host import TensorT
from deltastore.tensors.tables import (
    Table,
    check_contents,
    check_table,
    delta_changes_table,
    raise_if_mismatched,
    table_changed,
    table_of_manifest,
)
from deltastore.tensors.words import host_view, scatter_range

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncReport(SizeRatios):
    """What one :meth:`Subscriber.sync` did. Times in seconds, sizes in bytes.

    ``fetch_s`` and ``decode_s`` are summed over worker threads (they overlap in wall time);
    ``verify_s`` and ``pause_s`` are wall time; ``pause_s`` is the time tensors were written.
    ``kind`` is ``"anchor"`` when a full version was applied, ``"delta"`` when only deltas
    were, ``"none"`` when the tensors already were at the target. ``path`` is the catch-up
    path chosen by stored bytes (:meth:`deltastore.catalog.chain.ChainReader.plan`):
    ``"deltas"`` from the held version, ``"anchor"`` from the newest anchor (copy) at or below
    the target, ``"none"``; ``path_bytes`` its stored bytes as planned and ``other_bytes``
    those of the path not taken (None: there was none, or it was not priced).
    ``requests``: the store requests the sync made (this rank's); ``round_trips``: how many
    of them ran one after the other (:func:`~deltastore.store.counting.critical_path`): what
    a link's latency is paid for.
    """

    version: int
    from_version: int | None
    applied: tuple[int, ...]
    kind: Literal["anchor", "delta", "none"]
    changed_elements: int
    total_elements: int
    payload_bytes: int
    dense_bytes: int
    frames: int
    fetch_s: float
    decode_s: float
    verify_s: float
    pause_s: float
    total_s: float
    path: Literal["none", "deltas", "anchor"] = "none"
    path_bytes: int = 0
    other_bytes: int | None = None
    requests: int = 0
    round_trips: int = 0


class Subscriber(Generic[TensorT]):
    """Keeps ``tensors`` at a committed version of the store at ``url``.

    ``tensors`` + ``version``: tensors already at ``version``; checked once against its
    manifest (Adler-32 of every tensor) before the first delta is applied. ``tensors`` alone:
    preallocated buffers of unknown content, filled from the newest anchor by the first sync.
    Neither: the first sync allocates tensors on ``device`` from the newest anchor. Handed-over
    tensors are torch's (CPU or device) or :class:`~deltastore.tensors.host.HostTensor` s
    (numpy words, e.g. over a memory-mapped file: a subscriber of those never imports torch);
    the tensors a subscriber allocates are torch's.

    A version that changes the tensor table (a tensor added, removed, reshaped or retyped; an
    anchor) is followed by a subscriber that allocated its tensors: it allocates new ones
    (:attr:`tensors` is then a new mapping). Tensors the caller handed over are never
    reallocated: :meth:`sync` raises :class:`~deltastore.errors.TableChangedError` before
    fetching anything. When the state the tensors hold does not fit the store's chain (the
    store holds another state of their version, or the target does not descend from it),
    :meth:`sync` goes back to the newest anchor at or below the target, logs a warning, and
    applies it in place (verified before writing, like any version).

    ``layout``: the tensors are the engine's local tensors, holding boxes of the global ones as
    the :class:`~deltastore.layout.boxes.Layout` says (TP shards, fused, stacked, renamed); changes
    are applied in those coordinates and frames no box touches are not fetched. ``group``: a
    ``torch.distributed`` process group of the engine's ranks (each with its own layout and
    tensors); the ranks split the frames, exchange decoded changes, verify together and write
    only when every rank verified. With a group, every rank calls :meth:`sync` and
    :meth:`verify` together (they are collectives); the target of ``sync()`` is rank 0's.
    ``pause`` / ``resume``: called around the write phase (e.g. to pause the engine's
    generation); ``resume`` is called even when writing fails. ``trusted_keys``: the
    writers' :class:`~deltastore.PublicKey` s (several during a key rotation; key text or
    ``@<path>`` also), default ``DELTASTORE_TRUSTED_KEYS``; ``signing_key``: HMAC
    :class:`~deltastore.SigningKey` s of old stores, default ``DELTASTORE_SIGNING_KEY``.
    With any key, every manifest and anchor copy must be signed by one of them for its own
    version, checked before any frame is fetched (:class:`~deltastore.SignatureError`), and
    each frame of an Ed25519-signed version is checked against its BLAKE3 before it is
    decoded (:class:`~deltastore.IntegrityError`). No key (both None or unset): signatures
    are not checked.

    ``reader_id`` / ``lease_ttl``: the subscriber keeps a lease ``leases/<reader_id>.json`` on
    the versions it needs (written before a sync fetches from an older base and after each
    sync, renewed by :meth:`latest` and :meth:`sync` after half of ``lease_ttl`` seconds), so
    that ``gc --keep`` does not delete them; ``lease_ttl=None`` writes no lease. With a group,
    only rank 0 writes it. A lease that cannot be written is logged and changes nothing else.
    Default id: ``<host>-<pid>-<random>``; :meth:`close` removes the lease.

    ``priority``: the CPU priority of the worker threads that fetch, decode and stage
    (:mod:`deltastore.sync.priority`: a nice value 1-19 or ``"idle"``; default 0: the
    priority of the thread calling :meth:`sync`, which keeps its own). ``threads``: how many
    threads decode, stage and write at once (default None: every CPU this process may run on;
    an engine that needs cores for itself passes fewer). The decode-and-apply kernel
    (:mod:`deltastore.kernels.apply`) releases the GIL: a Python thread beside a sync, such as
    an engine's scheduler, keeps running.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | Store,
        *,
        storage_options: dict[str, Any] | None = None,
        tensors: MutableMapping[str, TensorT] | None = None,
        version: int | None = None,
        device: str | torch.device = "cpu",
        max_workers: int = 4,
        max_inflight_bytes: int = 256 << 20,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        layout: Layout | None = None,
        group: Any | None = None,
        pause: Callable[[], None] | None = None,
        resume: Callable[[], None] | None = None,
        trusted_keys: TrustOption = FROM_ENV,
        signing_key: KeyOption = FROM_ENV,
        reader_id: str | None = None,
        lease_ttl: float | None = DEFAULT_LEASE_TTL_S,
        priority: Priority = 0,
        threads: int | None = None,
    ) -> None:
        if version is not None and tensors is None:
            raise ValueError("version= needs tensors=: the tensors that are at that version")
        if max_workers < 1 or max_inflight_bytes < 1 or max_frame_bytes < 1:
            raise ValueError("max_workers, max_inflight_bytes and max_frame_bytes must be positive")
        if threads is not None and threads < 1:
            raise ValueError(f"threads={threads}: give at least 1 (or None: every CPU)")
        self._threads = threads
        self._words = WordViews()  # each tensor's words, made once
        self.store = open_store(url, storage_options)
        self._io = CountingStore(self.store)  # every request of this subscriber, counted
        self._tensors = tensors
        self._version = version
        self._verified = version is None
        self._digest: str | None = None
        self._adler: dict[str, int] = {}
        self._table: Table | None = None  # the table of the version the tensors are at
        self._owned = tensors is None  # allocated here: reallocated when the table changes
        # where tensors allocated here go; the default needs no torch until they are
        self._device: str | torch.device = "cpu" if device == "cpu" else _torch_device(device)
        self._max_frame_bytes = max_frame_bytes
        warm_in_background("deltastore.kernels.batch")
        self._frames = Fetcher(
            self._io, max_workers, max_inflight_bytes, check_priority(priority), threads=threads
        )
        self._group = Group(group)
        self._lease = LeaseKeeper(self._io, reader_id, lease_ttl if self._group.rank == 0 else None)
        self._hooks = Hooks(pause, resume)
        self._layout = None if layout is None and group is None else LayoutSync(layout, self._group)
        self._chain = ChainReader(self._io, keys=resolve_trust(trusted_keys, signing_key))
        if version is not None:  # a poll lists only after it
            self._chain.note(version)

    @property
    def tensors(self) -> MutableMapping[str, TensorT] | None:
        """The tensors kept in sync (None before the first sync of a fresh subscriber)."""
        return self._tensors

    @property
    def version(self) -> int | None:
        """The version the tensors are at (None: unknown / not yet synced)."""
        return self._version

    @property
    def reader_id(self) -> str:
        """The id of this subscriber's lease (``leases/<reader_id>.json``)."""
        return self._lease.reader

    def close(self) -> None:
        """Remove this subscriber's lease (best effort): it stops following the store."""
        self._lease.release()

    # --- store reads --------------------------------------------------------------------

    def versions(self) -> list[int]:
        """Every committed version, ascending (a committed version is one whose manifest exists)."""
        return self._chain.versions()

    def latest(self) -> int | None:
        """Newest committed version, or None when the store has none.

        A poll is one request: a listing of the manifest keys after the newest version
        known (:meth:`deltastore.catalog.chain.ChainReader.latest`; a subscriber that knows
        none reads the ``LATEST`` hint first). Renews the lease when it is due, in the
        background (a second request, once per half ``lease_ttl``).
        """
        newest = self._chain.latest()
        if self._version is not None:
            self._lease.hold_soon(self._version)
        return newest

    def manifest(self, version: int) -> Manifest:
        """The parsed, validated manifest of ``version`` (cached; manifests are immutable),
        signed as the subscriber's keys require (checked before any frame is fetched)."""
        return self._chain.manifest(version)

    # --- sync ---------------------------------------------------------------------------

    def verify(self) -> None:
        """Check every tensor against the current version's manifest (O(model bytes)).

        Raises :class:`TensorMismatchError` when a tensor is not at :attr:`version`.
        """
        if self._version is None or self._tensors is None:
            raise ChainError("nothing to verify: the tensors are at no known version; sync() first")
        m = self.manifest(self._version)
        if self._layout is not None:
            self._tensors = self._layout.bind(m, self._tensors, self._device)
            raise_if_mismatched(self._layout.check(m, self._tensors), m)
        else:
            check_table(self._tensors, m, exact=False)
            check_contents(self._tensors, m)
        self._set_state(m)
        self._verified = True

    def sync(
        self,
        version: int | None = None,
        *,
        progress: ProgressFn | None = None,
        on_version: Callable[[Manifest], None] | None = None,
    ) -> SyncReport:
        """Bring the tensors to ``version`` (default: the newest committed one).

        Applies the chain of versions from the current one (or from the newest anchor at or
        below the target, also when the current state does not fit the store's chain) in
        order; each version is applied whole or not at all. On error the tensors stay at the
        last version fully applied, and :attr:`version` says which. A change of the tensor
        table raises :class:`~deltastore.errors.TableChangedError` first when the tensors are
        the caller's.
        ``progress`` is called (from worker threads, serialized) after each frame, in stored
        bytes; ``on_version`` after each version is applied, with its manifest, before the
        next one starts (e.g. to record the state durably).
        """
        with self._io.window() as calls:
            report = self._sync(version, progress, on_version)
        return dataclasses.replace(report, requests=len(calls), round_trips=critical_path(calls))

    def _sync(
        self,
        version: int | None,
        progress: ProgressFn | None,
        on_version: Callable[[Manifest], None] | None,
    ) -> SyncReport:
        t_start = time.perf_counter()
        if not self._verified:
            self.verify()
        if self._version is not None:  # the held version leased (or renewed) while planning
            self._lease.hold_soon(self._version)
        copies: set[int] | None = None
        target = version
        if version is None and self._group.rank == 0:  # the newest, and the copies above
            target, copies = self._chain.discover(self._version)
        if self._group.world > 1:  # every rank goes to rank 0's target
            target = self._group.broadcast_int(-1 if target is None else target)
            target = None if target < 0 else target
        if target is None:
            raise ManifestNotFoundError(f"store {self.store.url} holds no committed version yet")
        start = self._version
        if start is not None and target < start:
            raise ChainError(
                f"the tensors are at version {start}, newer than the requested {target}"
            )
        plan = self._plan(target, copies)
        timer = Timer(
            progress,
            sum(len(t.frames) for m in plan.steps for t in m.tensors.values()),
            sum(m.payload_bytes for m in plan.steps),
        )
        applied: list[Manifest] = []
        verify_s = pause_s = 0.0
        try:
            replanned = False  # after a planned version's data was gone (retention)
            while True:
                self._check_tables(list(plan.steps))
                base = plan.steps[0].version if plan.path == "anchor" else self._version
                leased = self._lease.version
                if base is not None and (leased is None or base < leased):
                    self._lease.hold(base)  # before fetching: the versions from base up
                done = len(applied)
                try:
                    for m in plan.steps:
                        if m is plan.steps[-1]:  # the lease moves up while its frames come
                            self._lease.hold_soon(m.version)
                        v_s, p_s = self._apply(m, timer)
                        verify_s, pause_s = verify_s + v_s, pause_s + p_s
                        applied.append(m)
                        if on_version is not None:
                            on_version(m)
                    break
                except (ObjectNotFoundError, FrameError, IntegrityError) as exc:
                    if self._group.world > 1 or isinstance(exc, ManifestNotFoundError):
                        raise
                    if plan.copy is not None and len(applied) == done:
                        # the anchor copy's frames failed, verified before any write: the
                        # state is as before; plan again without it (spec section 9.4)
                        self._chain.reject_copy(plan.copy, exc)
                        plan = self._fallback(target, exc)
                        continue
                    if replanned or not isinstance(exc, ObjectNotFoundError):
                        raise
                    # a planned version's data is gone (retention): plan again from here
                    log.warning(
                        "store %s: %s; planning again from version %s",
                        self.store.url,
                        exc,
                        self._version,
                    )
                    replanned = True
                    self._chain.forget(None)
                    plan = self._plan(target)
        except Exception:
            if self._version is not None:  # the lease back to what the tensors hold
                self._lease.hold(self._version)
            raise
        steps = applied
        if steps:
            self._lease.wait()  # written at the version reached
        kind: Literal["anchor", "delta", "none"] = (
            "none" if not steps else "anchor" if any(m.kind == "anchor" for m in steps) else "delta"
        )
        last = steps[-1] if steps else self.manifest(target)  # no store read after applying
        return SyncReport(
            version=target,
            from_version=start,
            applied=tuple(m.version for m in steps),
            kind=kind,
            changed_elements=sum(m.changed_elements for m in steps),
            total_elements=last.total_elements,
            payload_bytes=timer.fetched_bytes,  # with a layout: only the frames it touches
            dense_bytes=last.dense_bytes,
            frames=timer.fetched_frames,
            fetch_s=timer.fetch,
            decode_s=timer.decode,
            verify_s=verify_s,
            pause_s=pause_s,
            total_s=time.perf_counter() - t_start,
            path=plan.path,
            path_bytes=plan.path_bytes,
            other_bytes=plan.other_bytes,
        )

    def _plan(self, target: int, copies: set[int] | None = None) -> Plan:
        """Versions to apply, oldest first (see :meth:`deltastore.catalog.chain.ChainReader.plan`);
        ``copies``: the anchor copies as :meth:`ChainReader.discover` listed them."""
        held = (
            None
            if self._version is None or self._digest is None
            else State(self._version, self._digest, self._adler)
        )
        plan = self._chain.plan(target, held, copies=copies)
        if plan.why is not None:
            log.warning(
                "store %s: %s; recovering from anchor %d, the newest at or below %d",
                self.store.url,
                plan.why,
                plan.steps[0].version,
                target,
            )
        return plan

    def _fallback(self, target: int, failed: Exception) -> Plan:
        """The plan to ``target`` without the anchor copy whose frames just failed
        (``failed``): the chain from the held version, or from an older anchor or copy. When
        there is none, ``failed`` is raised (what was wrong with the copy), after a warning
        that says why no other path exists."""
        try:
            return self._plan(target)
        except (ChainError, ManifestError, ObjectNotFoundError, IntegrityError) as exc:
            log.warning(
                "store %s: no other path to version %d than the failed anchor copy (%s)",
                self.store.url,
                target,
                exc,
            )
            raise failed from exc

    def _check_tables(self, steps: list[Manifest]) -> None:
        """Before anything is fetched: a change of the tensor table along ``steps`` needs an
        anchor, and tensors this subscriber may reallocate."""
        table, held = self._table, self._version
        for m in steps:
            new = table_of_manifest(m)
            if table is not None and new != table:
                if m.kind == "delta":
                    raise delta_changes_table(table, m, held)
                if not self._owned:
                    raise table_changed(table, m, held)
            table, held = new, m.version

    def _hold(self, version: int, digest: str, adler: dict[str, int]) -> None:
        """Take the tensors as being at the state ``digest`` of ``version`` with per-tensor
        Adler-32 ``adler``, as checked by the caller (a folder, against its sidecar); the
        store's manifest of ``version`` may hold another state."""
        if self._tensors is None or self._layout is not None:
            raise ValueError("_hold needs tensors and no layout")
        self._version, self._digest, self._adler = version, digest, dict(adler)
        self._table = {
            n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in self._tensors.items() if n in adler
        }
        self._verified = True

    def _set_state(self, m: Manifest) -> None:
        self._version, self._digest = m.version, m.state_digest
        self._adler = {n: e.adler32 for n, e in m.tensors.items()}
        self._table = table_of_manifest(m)

    def _apply(self, m: Manifest, timer: Timer) -> tuple[float, float]:
        """Apply one version; return (verify seconds, pause seconds)."""
        check_frames(m, self._max_frame_bytes)
        fresh = self._tensors is None or self._version is None
        # a new table (an anchor; only tensors allocated here get so far): new tensors
        realloc = not fresh and self._table is not None and table_of_manifest(m) != self._table
        if self._layout is not None:
            return self._apply_layout(m, timer, fresh=fresh, realloc=realloc)
        if self._tensors is None or fresh or realloc:
            return self._bootstrap(m, timer, allocate=self._tensors is None or realloc), 0.0
        check_table(self._tensors, m, exact=False)
        self._check_parent(m)
        tasks = frame_tasks(m)
        delta = m.kind == "delta"
        tensors = self._tensors

        def batch(
            ts: Sequence[FrameTask], buf: bytes, offsets: Sequence[int], dec: FrameDecoder
        ) -> list[Staged]:
            words = [self._words(tensors, t.name) for t in ts]
            return stage_batch(words, ts, buf, offsets, dec, delta)

        staged = self._frames.run(
            tasks, lambda t, data, dec: self._stage(t, data, dec, delta), timer, batch=batch
        )
        t0 = time.perf_counter()
        if delta:  # incremental from the verified local state, O(changed)
            sums: dict[str, Sums] = {}
            for st in staged:
                sums[st.update.local] = sums.get(st.update.local, Sums()) + st.sums
            got = {n: sums.get(n, Sums()).applied_to(self._adler[n]) for n in m.tensors}
        else:  # a full version: every frame was checked directly; they must add up
            got = frame_totals(m, tasks, [st.frame_adler for st in staged])
        verify_tensors(m, got, "nothing was written")
        writes = writes_of(  # before the pause
            self._tensors, (st.update for st in staged), words=self._words
        )
        t1 = time.perf_counter()
        write_phase(writes, self._hooks, threads=self._threads, priority=self._frames.priority)
        self._set_state(m)
        return t1 - t0, time.perf_counter() - t1

    def _check_parent(self, m: Manifest) -> None:
        """Raise unless the delta ``m`` applies to the local state (the current version), by
        the chain-link rule of :mod:`deltastore.format.chain`."""
        if m.kind != "delta":
            return
        if set(m.tensors) != set(self._adler):
            raise ManifestError(
                f"delta {m.version} names other tensors than its parent; a change of tensor "
                "set needs an anchor: the store was written by a broken publisher"
            )
        if (
            self._version is None
            or self._digest is None
            or not State(self._version, self._digest, self._adler).fits(m)
        ):
            raise WrongParentError(
                f"version {m.version} is a delta on version "
                f"{m.parent.version if m.parent else None}, but the tensors are at "
                f"{self._version} with another state; sync from an anchor instead"
            )

    def _apply_layout(
        self, m: Manifest, timer: Timer, *, fresh: bool, realloc: bool
    ) -> tuple[float, float]:
        """Apply ``m`` through the layout: staged against the known state; ``fresh``: written
        in place, state unknown; ``realloc``: into new tensors (kept only if all verified)."""
        if self._layout is None:  # pragma: no cover - checked by the caller
            raise ChainError("no layout")
        if not fresh and not realloc:
            self._check_parent(m)
        tensors = self._layout.bind(m, None if realloc else self._tensors, self._device)
        if not realloc:  # new tensors replace the held ones only once verified
            self._tensors = tensors
        direct = fresh or realloc
        try:
            out = self._layout.apply(
                self._frames, m, tensors, None if direct else self._adler, timer, self._hooks
            )
        except BaseException:
            if fresh:  # written in place before the check: no known version any more
                self._version = self._digest = None
            raise
        self._tensors = tensors
        self._set_state(m)
        return out

    # --- pipeline -----------------------------------------------------------------------

    def _stage(self, task: FrameTask, data: bytes, dec: FrameDecoder, delta: bool) -> Staged:
        """Turn one fetched frame into changes against the local tensor (reads only; called on
        the fetcher's worker threads)."""
        if self._tensors is None:  # pragma: no cover - guarded by _apply
            raise ChainError("no tensors")
        return stage_frame(self._words(self._tensors, task.name), task, data, dec, delta)

    def _allocate(self, m: Manifest) -> dict[str, torch.Tensor]:
        """New (uninitialized) torch tensors on the subscriber's device for ``m``'s table: the
        only tensors a subscriber allocates (host tensors are always handed over)."""
        import torch

        out: dict[str, torch.Tensor] = {}
        for name, entry in m.tensors.items():
            try:
                out[name] = torch.empty(
                    entry.shape, dtype=dtype_from_name(entry.dtype), device=self._device
                )
            except (RuntimeError, MemoryError) as exc:
                raise TensorMismatchError(f"cannot allocate {name} {entry.shape}: {exc}") from None
        return out

    def _bootstrap(self, m: Manifest, timer: Timer, *, allocate: bool) -> float:
        """Fill tensors from an anchor: into new tensors (``allocate``; they replace the held
        ones only once verified), or into handed-over buffers."""
        if m.kind != "anchor":  # pragma: no cover - _plan only starts fresh state at anchors
            raise ChainError(f"version {m.version} is not an anchor")
        if self._tensors is not None and not allocate:
            check_table(self._tensors, m, exact=False)
            target = self._tensors
        else:
            # a subscriber that allocates holds torch's tensors (its kind's default)
            target = cast("MutableMapping[str, TensorT]", self._allocate(m))
        tasks = frame_tasks(m)

        def fill(task: FrameTask, data: bytes, dec: FrameDecoder) -> int:
            f = task.frame
            dest = flat_words(target[task.name])
            wdt = word_dtype(itemsize(task.entry.dtype))
            host = host_view(dest)
            if host is not None:
                out = host.view(wdt)[f.start : f.stop]
            else:
                out = np.empty(f.stop - f.start, dtype=wdt)
            dec.decode_into(f.codec, data, out)
            got = adler32(out)
            if got != f.adler32:
                raise IntegrityError(
                    f"{task.name}[{f.start}:{f.stop}]: anchor frame decodes to Adler-32 "
                    f"{got:08x}, the manifest says {f.adler32:08x}"
                )
            if host is None:  # on a device
                scatter_range(dest, f.start, out)
            return got

        results = self._frames.run(tasks, fill, timer)
        t0 = time.perf_counter()
        verify_tensors(
            m,
            frame_totals(m, tasks, results),
            "its frames do not add up to the tensor: the manifest is damaged",
        )
        self._tensors = target
        self._set_state(m)
        return time.perf_counter() - t0


def _torch_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` (checked: an unknown device fails here)."""
    import torch

    return torch.device(device)


__all__ = ["Subscriber", "SyncReport"]
