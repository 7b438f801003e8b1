"""Publisher: detects what changed since the last version, encodes frames, commits a version.

Call order: ``Publisher(url)``, optionally :meth:`Publisher.attach` (continue an existing
chain after a restart), then :meth:`Publisher.publish` once per version with strictly
increasing version numbers. Not thread-safe: one thread publishes at a time.

The publisher keeps a *snapshot* of the last published words (``snapshot="memory"``: one copy
of the model in host memory) to compute XOR deltas; it is updated in O(changed) only after a
version is committed, so a failed publish leaves the publisher at the previous version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from deltastore.catalog.chain import ChainReader
from deltastore.errors import (
    ChainError,
    ManifestNotFoundError,
    ObjectNotFoundError,
    TensorMismatchError,
    VersionOrderError,
)
from deltastore.format.checksum import adler32, combine_frames
from deltastore.format.codecs import CODEC_SETS, MAX_FRAME_BYTES, CodecSet
from deltastore.format.keys import DATA_PREFIX, data_prefix, manifest_key
from deltastore.format.manifest import (
    MAX_DIMS,
    MAX_ELEMENTS,
    NAME_PATTERN,
    Frame,
    Manifest,
    Parent,
    TensorEntry,
    parse_manifest,
)
from deltastore.format.ratios import SizeRatios
from deltastore.format.signing import FROM_ENV, Ed25519Key, KeyOption, resolve_keys, verify_manifest
from deltastore.progress import ProgressFn, Ticker
from deltastore.publish.commit import (
    Committed,
    chain_costs,
    check_head,
    check_version_number,
    commit_version,
    conditional_writes,
    head_version,
    stored_bytes,
)
from deltastore.publish.encode import FrameEncoders, FrameJob
from deltastore.publish.policy import AnchorCosts, AnchorPolicy
from deltastore.publish.snapfree import SnapshotFreeStats
from deltastore.publish.snapshot import (
    DiskSnapshot,
    HeldChange,
    MemorySnapshot,
    TensorState,
    TensorSums,
    WriterState,
    row_range,
)
from deltastore.publish.upload import PackWriter, Uploads, copy_object_bytes
from deltastore.store import Store, open_store
from deltastore.store.counting import CountingStore, critical_path
from deltastore.tensors.dtypes import CastWords, dtype_name, host_words
from deltastore.tensors.host import Tensors
from deltastore.tensors.tables import check_table, raise_if_mismatched

if TYPE_CHECKING:
    import torch

    from deltastore.publish.snapfree_prepare import Prepared
    from deltastore.publish.snapfree_writer import SnapshotFree

log = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 16 << 20
DEFAULT_MAX_OBJECT_BYTES = 64 << 20
#: Default frame size of ``snapshot="none"`` (512 Ki bf16 elements): a frame's entries and
#: their encoding are held at once, about 40 bytes per element of the frame where every
#: element changes, so frames bound the publisher's memory (20 MiB per encoder thread).
SNAPSHOT_FREE_FRAME_BYTES = 1 << 20


@dataclass(frozen=True)
class PublishReport(SizeRatios):
    """What one :meth:`Publisher.publish` did. Times in seconds, sizes in bytes."""

    version: int
    kind: Literal["anchor", "delta"]
    parent: int | None
    changed_elements: int
    total_elements: int
    payload_bytes: int
    dense_bytes: int
    frames: int
    codecs: dict[str, int]
    detect_s: float
    encode_s: float
    upload_s: float
    total_s: float
    #: Why this version is an anchor or has an anchor copy (None: a plain delta), e.g.
    #: ``"first version"``, ``"forced"``, ``"cost: ..."`` (the anchor policy's rule).
    anchor_reason: str | None = None
    #: Stored bytes of the version's anchor copy (``anchors/``), written beside its delta;
    #: None when none was written (an anchor version's own size is ``payload_bytes``).
    anchor_copy_bytes: int | None = None
    #: What the snapshot-free path did (``snapshot="none"``; None otherwise).
    snapshot_free: SnapshotFreeStats | None = None
    #: Store requests the publish made, how many of them ran one after the other
    #: (:func:`~deltastore.store.counting.critical_path`), and how many of those came after
    #: the last data object was stored (the head check, the commit, ``LATEST``).
    requests: int = 0
    round_trips: int = 0
    commit_round_trips: int = 0


@dataclass
class Pending:
    """Everything of a publish that takes effect only once the manifest is committed."""

    entries: dict[str, TensorEntry] = field(default_factory=dict)
    frame_adler: dict[str, list[int]] = field(default_factory=dict)
    updates: list[HeldChange] = field(default_factory=list)
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    codecs: dict[str, int] = field(default_factory=dict)
    #: The anchor copy's tensor entries (full frames), when one was encoded.
    copy_entries: dict[str, TensorEntry] | None = None
    detect_s: float = 0.0
    encode_s: float = 0.0
    upload_s: float = 0.0


def table_entry(name: str, dtype: torch.dtype | str, shape: Sequence[int]) -> tuple[str, list[int]]:
    """``(dtype name, shape)`` of a tensor to publish (``dtype``: torch's, or a host tensor's
    format name), checked against the format's limits."""
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name) or not _utf8(name):
        raise TensorMismatchError(
            f"tensor name {name!r} is not allowed: 1-1024 characters, no control characters"
        )
    if len(shape) > MAX_DIMS or math.prod(shape) > MAX_ELEMENTS:
        raise TensorMismatchError(
            f"{name}: shape {list(shape)} is over the format's limits "
            f"({MAX_DIMS} dims, {MAX_ELEMENTS} elements)"
        )
    return dtype_name(dtype), list(shape)


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        return False
    return True


class ChainWriter:
    """What :class:`Publisher` and :class:`~deltastore.publish.ShardWriter` share: options, the
    version held (:class:`WriterState`), change detection and frame encoding."""

    #: ``(rank, world)`` of a shard writer; None for a publisher of whole tensors.
    _shard: tuple[int, int] | None = None

    def __init__(
        self,
        url: str | os.PathLike[str] | Store,
        *,
        storage_options: dict[str, Any] | None = None,
        snapshot: Literal["memory", "disk", "none"] = "memory",
        state_dir: str | os.PathLike[str] | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
        zstd_level: int | None = None,
        max_workers: int = 2,
        codecs: CodecSet = "v2",
        signing_key: KeyOption = FROM_ENV,
        unsafe_commits: bool = False,
        anchor_policy: str | AnchorPolicy | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self._snapfree = _snapshot_free(snapshot, optimizer, codecs, state_dir)
        if self._snapfree is not None:
            snapshot = "memory"  # holds the words of snapshot tensors only
            if max_frame_bytes == DEFAULT_MAX_FRAME_BYTES:  # a frame's entries are held whole
                max_frame_bytes = SNAPSHOT_FREE_FRAME_BYTES
        self._policy = AnchorPolicy.parse(anchor_policy)
        self._costs = AnchorCosts()
        if snapshot not in ("memory", "disk") or (snapshot == "disk") != (state_dir is not None):
            raise ValueError("snapshot must be 'memory', or 'disk' together with state_dir")
        if max_workers < 1:
            raise ValueError("max_workers must be positive")
        if codecs not in CODEC_SETS:
            raise ValueError(f"codecs must be one of {', '.join(CODEC_SETS)}, not {codecs!r}")
        if not 8 <= max_frame_bytes <= MAX_FRAME_BYTES or max_object_bytes < 1:
            raise ValueError(
                f"max_frame_bytes must be in [8, {MAX_FRAME_BYTES}] and max_object_bytes >= 1"
            )
        self.store = open_store(url, storage_options)
        self._io = CountingStore(self.store)  # every request of this writer, counted
        self.unsafe_commits = unsafe_commits
        self.token = uuid.uuid4().hex
        self._signing = resolve_keys(signing_key)  # signs with the first; attach checks any
        # an Ed25519 signature binds each frame by its BLAKE3 (spec section 6.7)
        self._frame_digests = bool(self._signing) and isinstance(self._signing[0], Ed25519Key)
        self._max_frame_bytes = max_frame_bytes
        self._max_object_bytes = max_object_bytes
        self._encoders = FrameEncoders(zstd_level, max_workers, codecs)
        snapshots = DiskSnapshot(state_dir) if state_dir is not None else MemorySnapshot()
        self._held = WriterState(self._io, snapshots, max_frame_bytes, self._shard)
        self._held.resume()

    @property
    def version(self) -> int | None:
        """Last version this writer committed or attached to (None before)."""
        return self._held.version

    def _parent(self) -> Parent:
        """The version held, as the parent of a delta on it."""
        held = self._held
        if held.version is None or held.digest is None:
            raise ChainError("this writer holds no version to publish a delta on")
        return Parent(version=held.version, state_digest=held.digest)

    def _frames_of(self, numel: int, size: int) -> list[tuple[int, int]]:
        step = max(1, self._max_frame_bytes // size)
        return [(a, min(a + step, numel)) for a in range(0, numel, step)]

    def _checksums(self, words: np.ndarray) -> TensorSums:
        """Per-frame and whole Adler-32 of ``words`` on this writer's frame grid (one pass)."""
        size = words.dtype.itemsize
        bounds = self._frames_of(words.size, size)
        frames = [adler32(words[a:b]) for a, b in bounds]
        total = combine_frames(
            (fa, (b - a) * size) for fa, (a, b) in zip(frames, bounds, strict=True)
        )
        return TensorSums(frames, total)

    def _copy_reason(self) -> str | None:
        """Why the next delta gets an anchor copy, by the anchor policy (None: it does not).
        A publisher that does not know the newest anchor yet (attached, or restarted from a
        disk snapshot) reads it from the store first: the manifests from its version back
        to the newest anchor copy or anchor (once)."""
        if self._costs.anchor is None and self._held.version is not None:
            self._costs = chain_costs(ChainReader(self._io), self._held.version)
        return self._costs.reason(self._policy, self._costs.last_delta)

    def _account(self, manifest: Manifest, stored: int, copy: Manifest | None) -> None:
        """The anchor policy's account of the committed ``manifest`` (``stored``: what a reader
        fetches for it, frames and manifest) and of its anchor copy, when one was written."""
        if manifest.kind == "anchor":
            self._costs.anchored(manifest.version, stored)
        elif copy is not None:
            self._costs.anchored(manifest.version, stored_bytes(copy), last_delta=stored)
        else:
            self._costs.delta(stored)

    # --- attach -------------------------------------------------------------------------

    def _head_manifest(self, version: int | None) -> Manifest:
        """The manifest of the store's newest version, which ``version`` (if given) must be."""
        head = head_version(self._io)
        if head is None:
            raise ChainError(
                f"store {self.store.url} holds no version to attach to; publish an anchor"
            )
        version = head if version is None else version
        if version != head:
            raise ChainError(
                f"version {version} is not the store's newest ({head}): a publisher continues "
                "the chain from its head only; attach with the tensors of the newest version"
            )
        key = manifest_key(version)
        try:
            manifest = parse_manifest(self._io.get(key), key=key)
        except ObjectNotFoundError:
            raise ManifestNotFoundError(
                f"version {version} is not committed in store {self.store.url}"
            ) from None
        verify_manifest(manifest, self._signing, version=version, name=key)
        return manifest

    # --- publish ------------------------------------------------------------------------

    def _check_version(self, version: int, *, anchor: bool) -> None:
        check_version_number(version)
        held = self._held.version
        if held is not None and version <= held:
            raise VersionOrderError(f"version {version} is not above the last published {held}")
        # the head from this publisher's own state: one listing after it, which does not
        # grow with the run (a full listing of manifests/ only before the first publish)
        head = (
            head_version(self._io)
            if held is None
            else max(ChainReader(self._io).versions_after(held), default=held)
        )
        if head is not None and version <= head:
            raise VersionOrderError(
                f"version {version} is not above the store's newest version {head}; "
                "versions must increase strictly"
            )
        if head is not None and held is not None and head != held:  # forked
            if anchor:  # a forced anchor needs no parent: forget the stale one
                self._held.forget()
                return
            raise ChainError(
                f"the store's newest version is {head} but this publisher is at {held}: "
                "another publisher moved the chain; attach() to the store again (CLI: --parent) "
                "or publish an anchor"
            )

    def _encode(
        self,
        version: int,
        host: Mapping[str, np.ndarray | CastWords],
        specs: Mapping[str, tuple[str, list[int]]],
        parent_state: Mapping[str, TensorState] | None,
        kind: str,
        progress: ProgressFn | None,
        rows: Mapping[str, tuple[int, int]] | None = None,
        *,
        full: bool = False,
    ) -> Pending:
        """Detect and encode the changes of every tensor, upload the data objects.

        Frames are detected and encoded on ``max_workers`` threads and packed in order here
        (uploads overlap the encoding of later frames). ``rows`` places words at dim-0 rows of
        a larger global tensor (``specs`` holds its shape); frames are then cut from the start
        of the words, at global positions. ``full``: also encode every frame's new words, in
        the same pass, into an anchor copy (:attr:`Pending.copy_entries`; its data objects are
        ``<prefix>-anchor-<seq>.dsz``).
        """
        pending = Pending(rows=dict(rows or {}), copy_entries={} if full else None)
        prefix = f"{data_prefix(version)}{self.token[:12]}-"
        uploads = Uploads(self._io, pending)
        packs = PackWriter(uploads, prefix, self._max_object_bytes, self._frame_digests)
        dense = sum(w.nbytes for w in host.values()) if full else 0
        copy_size = copy_object_bytes(self._max_object_bytes, dense)
        copy_packs = PackWriter(uploads, f"{prefix}anchor-", copy_size, self._frame_digests)
        try:
            self._pack(host, specs, parent_state, kind, progress, rows, pending, packs, copy_packs)
        except BaseException:
            uploads.abort()
            raise
        uploads.finish()
        return pending

    def _pack(
        self,
        host: Mapping[str, np.ndarray | CastWords],
        specs: Mapping[str, tuple[str, list[int]]],
        parent_state: Mapping[str, TensorState] | None,
        kind: str,
        progress: ProgressFn | None,
        rows: Mapping[str, tuple[int, int]] | None,
        pending: Pending,
        packs: PackWriter,
        copy_packs: PackWriter,
    ) -> None:
        """The body of :meth:`_encode`: encode on the encoder threads, pack in order."""
        full = pending.copy_entries is not None
        grids = {n: self._frames_of(w.size, w.dtype.itemsize) for n, w in host.items()}
        ticker = Ticker(
            progress, sum(len(g) for g in grids.values()), sum(w.nbytes for w in host.values())
        )

        def jobs() -> Iterator[FrameJob]:
            for name, words in host.items():
                prev = parent_state[name] if parent_state is not None else None
                for i, (a, b) in enumerate(grids[name]):
                    yield FrameJob(
                        words[a:b],
                        None if prev is None else prev.words[a:b],
                        None if prev is None else prev.frame_adler[i],
                        kind == "delta" and prev is not None,
                        full,
                    )

        total = sum(w.size for w in host.values())  # a share of them encoded at once
        # closed here, not by the garbage collector: an encoder pool shut down from a
        # finalizer (after an upload failed) can run inside another thread's start-up and
        # deadlock on threading's own locks
        with contextlib.closing(self._encoders.map(jobs(), words=total)) as results:
            for name, words in host.items():
                prev = parent_state[name] if parent_state is not None else None
                start = row_range(specs[name][1], rows[name])[0] if rows else 0
                frames: list[Frame] = []
                copy_frames: list[Frame] = []
                frame_adler: list[int] = []
                changed_total = 0
                for i, (a, b) in enumerate(grids[name]):
                    out = next(results)
                    pending.detect_s += out.detect_s
                    pending.encode_s += out.encode_s
                    if out.data is not None:
                        obj, offset, b3 = packs.add(out.data)  # may upload a full object
                        frames.append(
                            Frame(
                                start=start + a,
                                stop=start + b,
                                codec=out.codec,
                                object=obj,
                                offset=offset,
                                length=len(out.data),
                                xxh3=out.xxh3,
                                changed=out.changed,
                                adler32=out.adler,
                                parent_adler32=None if prev is None else prev.frame_adler[i],
                                blake3=b3,
                            )
                        )
                        pending.codecs[out.codec] = pending.codecs.get(out.codec, 0) + 1
                    if out.full is not None:
                        obj, offset, b3 = copy_packs.add(out.full.data)
                        entry = out.full.frame(start + a, start + b, obj, offset, out.adler, b3)
                        copy_frames.append(entry)
                    if prev is not None and out.change is not None:
                        pending.updates.append(HeldChange(prev.words[a:b], out.change))
                    frame_adler.append(out.adler)
                    ticker.tick((b - a) * words.dtype.itemsize)
                    changed_total += out.changed
                pending.frame_adler[name] = frame_adler
                total_adler = combine_frames(
                    (fa, (b - a) * words.dtype.itemsize)
                    for fa, (a, b) in zip(frame_adler, grids[name], strict=True)
                )
                pending.entries[name] = TensorEntry(
                    dtype=specs[name][0],
                    shape=specs[name][1],
                    adler32=total_adler,
                    parent_adler32=prev.adler if prev is not None else None,
                    changed=changed_total,
                    frames=frames,
                )
                if pending.copy_entries is not None:
                    # every element of these words (a shard writer's: its rows only)
                    pending.copy_entries[name] = TensorEntry(
                        dtype=specs[name][0],
                        shape=specs[name][1],
                        adler32=total_adler,
                        parent_adler32=None,
                        changed=words.size,
                        frames=copy_frames,
                    )
        packs.flush()
        copy_packs.flush()

    def _report(
        self,
        version: int,
        kind: Literal["anchor", "delta"],
        parent: Parent | None,
        host: Mapping[str, np.ndarray | CastWords],
        pending: Pending,
        t_start: float,
        anchor_reason: str | None = None,
        anchor_copy_bytes: int | None = None,
    ) -> PublishReport:
        """What was published of ``host`` (the words this writer encoded)."""
        entries = pending.entries.values()
        return PublishReport(
            version=version,
            kind=kind,
            parent=parent.version if parent is not None else None,
            changed_elements=sum(e.changed for e in entries),
            total_elements=sum(w.size for w in host.values()),
            payload_bytes=sum(f.length for e in entries for f in e.frames),
            dense_bytes=sum(w.nbytes for w in host.values()),
            frames=sum(len(e.frames) for e in entries),
            codecs=pending.codecs,
            detect_s=pending.detect_s,
            encode_s=pending.encode_s,
            upload_s=pending.upload_s,
            total_s=time.perf_counter() - t_start,
            anchor_reason=anchor_reason,
            anchor_copy_bytes=anchor_copy_bytes,
        )

    def _prepared_report(
        self,
        prep: Prepared,
        version: int,
        t_start: float,
        reason: str | None,
        copy_bytes: int | None,
    ) -> PublishReport:
        """The report of a snapshot-free publish (``prep``): its sizes and stats."""
        report = self._report(
            version, prep.kind, prep.parent, {}, prep.pending, t_start, reason, copy_bytes
        )
        numel, dense = prep.sizes
        return dataclasses.replace(
            report, total_elements=numel, dense_bytes=dense, snapshot_free=prep.stats
        )

    def _adopt(
        self,
        manifest: Manifest,
        host: Mapping[str, np.ndarray],
        pending: Pending,
        *,
        incremental: bool,
        owned: bool = False,
    ) -> None:
        """After ``manifest`` is committed: bring the snapshot to it, in O(changed) for a
        delta. ``owned``: ``host`` holds the caller's own copies, which it gives up (a memory
        snapshot keeps them instead of copying them again). A failure to save only loses the
        parent for next time (logged)."""
        version, digest = manifest.version, manifest.state_digest
        sums = {
            n: TensorSums(pending.frame_adler[n], e.adler32) for n, e in pending.entries.items()
        }
        try:
            if incremental:
                self._held.update(version, digest, pending.updates, sums)
            else:
                specs = {n: (e.dtype, e.shape) for n, e in pending.entries.items()}
                self._held.replace(version, digest, host, specs, sums, pending.rows, owned=owned)
        except OSError as exc:  # committed all the same: only the parent for next time is lost
            log.warning(
                "version %d is committed, but the publisher state could not be saved (%s); "
                "the next publish needs attach() (CLI: --parent) or an anchor",
                version,
                exc,
            )
            self._held.forget()
            self._held.version, self._held.digest = version, digest


class Publisher(ChainWriter):
    """Publishes versions of a set of tensors to a store.

    Keyword options: ``snapshot`` (``"memory"``: the parent's words in RAM; ``"disk"``: in a
    memory-mapped file under ``state_dir``, which also lets a restarted publisher continue
    without :meth:`attach`; ``"none"``, with ``optimizer=`` the ``torch.optim.AdamW`` that steps
    the published parameters: no copy of them, their previous words rebuilt from the optimizer
    state and checked against block digests, float32 parameters published as bfloat16, other
    tensors held as snapshots of their own; construct it before the first ``step()`` to publish,
    publish after every step; see :mod:`deltastore.publish.snapfree_writer` and
    :attr:`PublishReport.snapshot_free`), ``max_frame_bytes`` (dense bytes per frame, default 16
    MiB; 1 MiB with ``snapshot="none"``), ``max_object_bytes`` (bytes per data object, default
    64 MiB), ``zstd_level`` (default None: level 1 for the 0.1.0 codecs, tuned fast parameters
    for the 0.2.0 ones), ``max_workers`` (threads that detect and encode frames, default 2),
    ``codecs`` (``"v2"``, default: each frame in the smallest of all codecs, anchors in
    ``raw-planes``, readable from deltastore 0.2.0; ``"v1"``: only the codecs deltastore 0.1.0
    reads, for older receivers), ``signing_key`` (a :class:`~deltastore.SigningKey` that signs
    every manifest, and that :meth:`attach` requires on the head manifest; default:
    ``DELTASTORE_SIGNING_KEY`` if set; None: unsigned), ``unsafe_commits`` (publish to a store
    whose service ignores create-if-absent preconditions, which is refused otherwise: only one
    publisher may then write to the store; each commit is read back and :class:`ForkError`
    raised when the manifest is not this publisher's; a no-op on stores that enforce them),
    ``anchor_policy`` (when a delta also gets an anchor copy ``anchors/<v>.json`` for fresh
    replicas, written after its commit: ``"cost"``, the default: when the stored bytes of the
    deltas since the newest anchor would exceed its own; ``"cost:K"``, ``"every:N"``,
    ``"never"``, or an :class:`~deltastore.publish.policy.AnchorPolicy`;
    :attr:`PublishReport.anchor_reason` says why).
    """

    def attach(self, tensors: Tensors, *, version: int | None = None) -> int:
        """Continue the chain of an existing store from ``tensors`` at ``version``.

        ``version`` defaults to the newest committed one. The tensors are checked against that
        manifest (names, dtypes, shapes and per-tensor Adler-32) before anything is kept; the
        next publish is then a delta against them. Returns the attached version.
        """
        manifest = self._head_manifest(version)
        if self._snapfree is not None:
            from deltastore.publish.snapfree_prepare import attach

            return attach(self, self._snapfree, tensors, manifest)  # type: ignore[arg-type]
        check_table(tensors, manifest, exact=True)
        host = {n: host_words(tensors[n]) for n in manifest.tensors}
        sums = {name: self._checksums(words) for name, words in host.items()}
        raise_if_mismatched(
            [n for n, s in sums.items() if s.whole != manifest.tensors[n].adler32], manifest
        )
        specs = {n: (e.dtype, e.shape) for n, e in manifest.tensors.items()}
        self._held.replace(manifest.version, manifest.state_digest, host, specs, sums, {})
        return manifest.version

    def publish(
        self,
        tensors: Tensors,
        *,
        version: int,
        anchor: bool | None = None,
        progress: ProgressFn | None = None,
    ) -> PublishReport:
        """Publish ``tensors`` as ``version`` and commit it.

        The first publish (and any publish whose tensor names, dtypes or shapes differ from
        the parent's) is an anchor; ``anchor=True`` forces one, ``anchor=False`` refuses to
        write one. ``progress`` is called after each frame (dense bytes). Tensors must not be
        modified during the call. Raises
        :class:`VersionOrderError` for a version not above the chain head and
        :class:`VersionExistsError` when another writer committed ``version`` first;
        :class:`ChainError` when another writer committed a version on its parent meanwhile;
        :class:`PreconditionsIgnoredError` (before any upload) on a store that ignores
        preconditions, without ``unsafe_commits``; :class:`ForkError` when, with it, the
        committed manifest read back is another publisher's.
        """
        with self._io.window() as calls:
            report = self._publish(tensors, version, anchor, progress)
        data_end = max(
            (c.end for c in calls if c.op == "put" and c.key.startswith(DATA_PREFIX)),
            default=0.0,
        )
        return dataclasses.replace(
            report,
            requests=len(calls),
            round_trips=critical_path(calls),
            commit_round_trips=critical_path(c for c in calls if c.start >= data_end),
        )

    def _publish(
        self,
        tensors: Tensors,
        version: int,
        anchor: bool | None,
        progress: ProgressFn | None,
    ) -> PublishReport:
        t_start = time.perf_counter()
        self._check_version(version, anchor=bool(anchor))
        # before any upload: refuse unsafe commits unless accepted
        enforced = conditional_writes(self._io, unsafe_commits=self.unsafe_commits)
        if self._snapfree is not None:
            return self._publish_snapshot_free(
                tensors, version, anchor, progress, t_start, enforced
            )
        table = {n: table_entry(n, t.dtype, t.shape) for n, t in tensors.items()}
        state = self._held.tensors
        same_table = state is not None and table == {
            n: (s.dtype, s.shape) for n, s in state.items()
        }
        if anchor is False and not same_table:
            raise ChainError(
                "cannot publish a delta: no parent state, or the tensor names/dtypes/shapes "
                "changed; publish an anchor (anchor=True or None)"
            )
        kind: Literal["anchor", "delta"] = "anchor" if anchor or not same_table else "delta"
        parent_state = state if same_table else None
        parent = self._parent() if parent_state is not None else None
        reason = (
            self._copy_reason()
            if kind == "delta"
            else "forced"
            if anchor
            else "first version"
            if state is None
            else "the tensor table changed"
        )
        full = kind == "delta" and reason is not None
        host = {n: host_words(t) for n, t in tensors.items()}
        pending = self._encode(version, host, table, parent_state, kind, progress, full=full)
        committed = self._commit(version, kind, parent, pending, enforced)
        copy = committed.copy
        self._adopt(committed.manifest, host, pending, incremental=parent is not None)
        self._account(committed.manifest, committed.stored_bytes, copy)
        report = self._report(
            version,
            kind,
            parent,
            host,
            pending,
            t_start,
            reason if kind == "anchor" or copy is not None else None,
            None if copy is None else copy.payload_bytes,
        )
        return _logged(report)

    def _commit(
        self,
        version: int,
        kind: Literal["anchor", "delta"],
        parent: Parent | None,
        pending: Pending,
        enforced: bool,
    ) -> Committed:
        """The head check (a zombie publisher stops there), the commit, the anchor copy and
        ``LATEST`` of ``pending``'s entries; their time counts in ``upload_s``."""
        t0 = time.perf_counter()
        committed = commit_version(
            self._io,
            version=version,
            kind=kind,
            parent=parent,
            entries=pending.entries,
            token=self.token,
            signing_key=self._signing[0] if self._signing else None,
            enforced=enforced,
            check=partial(check_head, self._io, version, parent),
            copy_entries=pending.copy_entries,
        )
        pending.upload_s += time.perf_counter() - t0
        return committed

    def _publish_snapshot_free(
        self,
        tensors: Tensors,
        version: int,
        anchor: bool | None,
        progress: ProgressFn | None,
        t_start: float,
        enforced: bool,
    ) -> PublishReport:
        """:meth:`publish` with ``snapshot="none"`` (:mod:`deltastore.publish.snapfree_writer`)."""
        from deltastore.publish.snapfree_prepare import prepare

        sf = self._snapfree
        assert sf is not None
        items = sf.items(tensors, table_entry)  # type: ignore[arg-type]
        state = self._held.tensors
        same = state is not None and {n: it.spec for n, it in items.items()} == {
            n: (s.dtype, s.shape) for n, s in state.items()
        }
        prep = prepare(
            self, sf, items, version=version, same_table=same, anchor=anchor, progress=progress
        )
        committed = self._commit(version, prep.kind, prep.parent, prep.pending, enforced)
        copy = committed.copy
        prep.adopt(self, sf, committed.manifest)
        self._account(committed.manifest, committed.stored_bytes, copy)
        reason = prep.reason if prep.kind == "anchor" or copy is not None else None
        copy_bytes = None if copy is None else copy.payload_bytes
        return _logged(self._prepared_report(prep, version, t_start, reason, copy_bytes))


def _logged(report: PublishReport) -> PublishReport:
    """``report``, after its INFO line."""
    log.info(
        "published v%d (%s): %.3f%% changed, %d payload bytes (%.2f%% of dense)",
        report.version,
        report.kind,
        100 * report.changed_fraction,
        report.payload_bytes,
        100 * report.payload_ratio,
    )
    return report


def _snapshot_free(
    snapshot: str, optimizer: Any, codecs: str, state_dir: Any
) -> SnapshotFree | None:
    """The snapshot-free state of a writer built with ``snapshot="none"`` (else None), after
    checking the options that go with it."""
    if snapshot != "none":
        if optimizer is not None:
            raise ValueError("optimizer= is used with snapshot='none' only")
        return None
    if optimizer is None:
        raise ValueError(
            "snapshot='none' rebuilds the previous words from the optimizer: pass optimizer="
            "(the torch.optim.AdamW that steps the published parameters)"
        )
    if codecs == "v1":
        raise ValueError(
            "snapshot='none' sends the blocks it cannot verify in xor-patch frames, which "
            "readers before deltastore 0.3.0 lack, let alone the 'v1' codecs (deltastore "
            "0.1.0 readers): use codecs='v2', or a snapshot"
        )
    if state_dir is not None:
        raise ValueError("snapshot='none' keeps no state folder: drop state_dir")
    from deltastore.publish.snapfree_writer import SnapshotFree

    return SnapshotFree(optimizer)


__all__ = ["PublishReport", "Publisher"]
