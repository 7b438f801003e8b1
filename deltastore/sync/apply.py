"""The apply pipeline of a version, shared by the local and the layout paths: stage -> verify ->
write.

Both paths turn decoded changes (:class:`~deltastore.format.codecs.Changes`, from the one codec
dispatch :meth:`~deltastore.format.codecs.FrameDecoder.changes`) into updates of local tensors,
verify every tensor against the manifest, and only then write, all or nothing:

1. *Stage* (reads only, O(changed)): :func:`stage_at` / :func:`stage_run` gather the old words
   where changes land and compute the new ones (the new words, or old XOR mask);
   :func:`contribution` turns changed words into their Adler-32 contribution (:class:`Sums`),
   which :meth:`Sums.shift` moves from a frame to its whole tensor and :meth:`Sums.weighted`
   weighs per copy of a replicated element. :class:`Update` records what a write will change.
2. *Verify*: :class:`Totals` adds the contributions per tensor (one vector, so that ranks add
   theirs with one all-reduce); :func:`verify_tensors` compares each tensor's Adler-32 after the
   update with the manifest and raises one :class:`~deltastore.errors.IntegrityError`.
3. *Write*: :func:`write_phase` calls the pause hook, scatters every update all or nothing
   (:func:`deltastore.tensors.words.write_all`: a scatter that fails, even halfway, rolls back
   every write started), lets the layout path agree with the other ranks, and calls the resume
   hook whatever happens.

The local path (:func:`deltastore.sync.stage.stage_frame`, driven by
:class:`~deltastore.sync.subscriber.Subscriber`) stages per frame on worker threads and checks
each frame's Adler-32 too; the layout path (:class:`deltastore.sync.ranks.LayoutSync`) routes
and exchanges changes between ranks first, stages per received segment, and agrees across
ranks before and after writing.

Adler-32 sums are those of :mod:`deltastore.format.checksum` (mod 65521, bytes of little-endian
words). Staging and verification functions are pure and thread-safe; the write phase runs on
one thread, with nothing else touching the tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from deltastore.errors import IntegrityError, RankError
from deltastore.format.checksum import (
    MOD,
    adler32,
    apply_delta,
    combine_frames,
    delta_sums,
    shift_to_outer,
)
from deltastore.format.dtypes import itemsize
from deltastore.format.manifest import Manifest
from deltastore.sync.fetch import FrameTask
from deltastore.sync.priority import Priority, lower_current_thread
from deltastore.tensors import words
from deltastore.tensors.dtypes import flat_words
from deltastore.tensors.host import Tensors, Words
from deltastore.tensors.words import Write

Hook = Callable[[], None] | None
_NOWHERE = np.zeros(0, dtype=np.int64)
#: A run (or a delta frame, :mod:`deltastore.sync.ranks`) where at least 1/DENSE of the words
#: change is staged whole (:func:`stage_dense`): past that density the per-element routing,
#: gather and checksum cost more than reading, summing and writing the whole run. The staged
#: run holds its old and new words (2 x its bytes; the changed words alone would hold at
#: least 1/DENSE x (position + 2 words)).
DENSE = 8


@dataclass(frozen=True)
class Hooks:
    """Called around the write phase: ``pause`` before the first write (e.g. to pause an
    engine's generation), ``resume`` after the last one, also when writing failed."""

    pause: Hook = None
    resume: Hook = None


@dataclass(frozen=True)
class Sums:
    """The Adler-32 contribution ``(da, db)`` (each mod 65521) of changed bytes of a buffer:
    the checksum after the change is :meth:`applied_to` the one before it."""

    da: int = 0
    db: int = 0

    @classmethod
    def from_zeros(cls, adler: int, nbytes: int) -> Sums:
        """The sums that take ``nbytes`` zero bytes to bytes whose Adler-32 is ``adler``."""
        return cls(((adler & 0xFFFF) - 1) % MOD, ((adler >> 16) - nbytes) % MOD)

    def __add__(self, other: Sums) -> Sums:
        return Sums((self.da + other.da) % MOD, (self.db + other.db) % MOD)

    def shift(self, inner_bytes: int, inner_offset: int, outer_bytes: int) -> Sums:
        """The sums of a frame of ``inner_bytes`` bytes starting ``inner_offset`` bytes into an
        ``outer_bytes``-byte tensor, as sums of the tensor
        (:func:`~deltastore.format.checksum.shift_to_outer`)."""
        return Sums(*shift_to_outer(self.da, self.db, inner_bytes, inner_offset, outer_bytes))

    def within(self, inner_bytes: int, inner_offset: int, outer_bytes: int) -> Sums:
        """The inverse of :meth:`shift`: sums of an ``outer_bytes``-byte tensor whose changes
        all lie in its ``inner_bytes`` bytes from ``inner_offset``, as sums of that frame."""
        back = (outer_bytes - inner_offset - inner_bytes) % MOD
        return Sums(self.da, (self.db - back * self.da) % MOD)

    def weighted(self, weight: int) -> Sums:
        """The sums times ``weight`` (mod 65521; the inverse of an element's copy count)."""
        return Sums(self.da * weight % MOD, self.db * weight % MOD)

    def applied_to(self, adler: int) -> int:
        """The Adler-32 of the buffer after the change, from ``adler`` before it."""
        return apply_delta(adler, self.da, self.db)


@dataclass(frozen=True)
class Update:
    """Staged words of one local tensor (read, not yet written).

    ``local``: the local tensor's name; ``positions``: ascending flat element indices relative
    to element ``start`` of the tensor (int64, int32 (:func:`~deltastore.tensors.words.narrow`),
    or :func:`~deltastore.tensors.words.compact` gaps); ``old`` / ``new``: the unsigned words
    there now and after the write. ``dense``: ``positions`` is unused and ``old`` / ``new``
    cover the run of elements ``[start, start + len(new))`` (:func:`stage_dense`); ``xor``
    (host tensors): ``old`` and ``new`` are both the XOR masks of the run (dense) or of the
    positions (int32/int64; :func:`deltastore.sync.stage.stage_frame`'s native path), written
    and undone by XOR-ing them in place."""

    local: str
    start: int
    positions: np.ndarray
    old: np.ndarray
    new: np.ndarray
    dense: bool = False
    xor: bool = False


def stage_at(
    local: Words, at: np.ndarray, values: np.ndarray, *, xor: bool
) -> tuple[np.ndarray, np.ndarray]:
    """``(old, new)`` words at the flat positions ``at`` of ``local`` (a tensor's 1-D words):
    ``values`` (unsigned words, one per position) are the new words, or XOR masks (``xor``)."""
    old = words.gather(local, at, values.dtype)
    return old, (old ^ values if xor else values)


def stage_run(
    local: Words, start: int, values: np.ndarray, *, xor: bool
) -> tuple[np.ndarray, np.ndarray]:
    """``(old, new)`` words of the run ``[start, start + values.size)`` of ``local``, as
    :func:`stage_at` (one contiguous read)."""
    old = words.gather_range(local, start, values.size, values.dtype)
    return old, (old ^ values if xor else values)


def stage_dense(
    local: str,
    dest: Words,
    at: int,
    values: np.ndarray,
    offset: int,
    nbytes: int,
    *,
    xor: bool,
    sums: bool = True,
) -> tuple[Update, Sums]:
    """Stage the run ``[at, at + values.size)`` of ``dest`` (the words of local tensor
    ``local``) taking ``values`` (new words, or XOR masks: ``xor``), whose first element lies
    at element ``offset`` of an ``nbytes``-byte global tensor: the :class:`Update` and the
    Adler-32 contribution to that tensor. ``sums`` False: the contribution is not computed
    (zero). Reads only; thread-safe (per-thread scratch buffers).

    A run where at least 1/:data:`DENSE` of the words change is staged whole
    (:func:`run_sums`): in host words as its XOR masks (the given ones, or old XOR new; written
    by an in-place XOR and undone by the same XOR: no copy of the run is kept), on a device as
    its old words (for the restore) and new ones. A sparser run stages only its changed words
    (:func:`contribution`)."""
    size = values.dtype.itemsize
    host = words.host_view(dest)
    if host is not None:  # host words: staged as XOR masks either way
        old = host.view(values.dtype)[at : at + values.size]
        masks = values if xor else np.bitwise_xor(old, values)
        if np.count_nonzero(masks) * DENSE >= values.size:
            total = Sums()
            if sums:
                new = np.bitwise_xor(old, masks, out=_scratch(values.dtype, values.size))
                total = run_sums(old, new, offset * size, nbytes)
            return Update(local, at, _NOWHERE, masks, masks, True, True), total
        ch = np.flatnonzero(masks)
        update = Update(local, 0, ch + at, old[ch], old[ch] ^ masks[ch])
    else:  # a device: the old words come back as a copy
        old, new = stage_run(dest, at, values, xor=xor)
        diff = values != 0 if xor else old != new
        if np.count_nonzero(diff) * DENSE >= values.size:
            update = Update(local, at, _NOWHERE, old, new, True)
            return update, run_sums(old, new, offset * size, nbytes) if sums else Sums()
        ch = np.flatnonzero(diff)
        update = Update(local, 0, ch + at, old[ch], new[ch])
    return update, contribution(ch + offset, update.old, update.new, nbytes) if sums else Sums()


_local = threading.local()


def _scratch(dtype: type[np.generic] | np.dtype[Any], count: int) -> np.ndarray:
    """A reused buffer of ``count`` elements of ``dtype``, per thread (grown as needed)."""
    dt = np.dtype(dtype)
    bufs: dict[str, np.ndarray] = _local.__dict__.setdefault("bufs", {})
    buf = bufs.get(dt.str)
    if buf is None or buf.size < count:
        buf = bufs[dt.str] = np.empty(max(count, 1 << 20), dtype=dt)
    return buf[:count]


def run_sums(old: np.ndarray, new: np.ndarray, offset: int, nbytes: int) -> Sums:
    """Adler-32 contribution to an ``nbytes``-byte tensor of the run of words starting
    ``offset`` bytes into it changing from ``old`` to ``new`` (same length, unsigned words):
    the difference of the run's own Adler-32 after and before, moved to the tensor
    (:meth:`Sums.shift`). O(run) at zlib's speed; equal to :func:`contribution` of the run's
    changed words, cheaper when many of them change."""
    a0, a1 = adler32(old), adler32(new)
    run = Sums(((a1 & 0xFFFF) - (a0 & 0xFFFF)) % MOD, ((a1 >> 16) - (a0 >> 16)) % MOD)
    return run.shift(old.nbytes, offset, nbytes)


def contribution(
    positions: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    nbytes: int,
    weights: np.ndarray | None = None,
) -> Sums:
    """Adler-32 contribution of words at element ``positions`` (int, ascending) of an
    ``nbytes``-byte buffer changing from ``old`` to ``new``, each weighted by ``weights`` (int64
    in ``[0, 65521)``) if given (:func:`~deltastore.format.checksum.delta_sums`, O(changed))."""
    return Sums(*delta_sums(positions, old, new, nbytes, weights))


class Totals:
    """Adler-32 contributions per tensor, added up: ``vector[2 i]`` / ``vector[2 i + 1]`` hold
    tensor ``i``'s dA / dB (int64, reduced mod 65521 when read), so that the contributions of
    several ranks add up with one all-reduce of the vector. ``counting`` False: nothing is
    added (a full version, verified frame by frame); callers skip computing sums then. Not
    thread-safe."""

    def __init__(self, tensors: int, *, counting: bool = True) -> None:
        self.vector = np.zeros(2 * tensors, dtype=np.int64)
        self.counting = counting

    def add(self, tensor: int, sums: Sums) -> None:
        if self.counting:
            self.vector[2 * tensor] += sums.da
            self.vector[2 * tensor + 1] += sums.db

    def adler(self, tensor: int, base: int, vector: np.ndarray | None = None) -> int:
        """Tensor ``tensor``'s Adler-32 after its changes, from ``base`` before them; from
        ``vector`` (this layout, e.g. all-reduced over ranks) instead of this one's if given."""
        v = self.vector if vector is None else vector
        return Sums(int(v[2 * tensor]) % MOD, int(v[2 * tensor + 1]) % MOD).applied_to(base)


def frame_totals(m: Manifest, tasks: Sequence[FrameTask], adlers: Sequence[int]) -> dict[str, int]:
    """Each tensor's Adler-32 combined, in order, from the Adler-32 ``adlers[i]`` of the frame
    of ``tasks[i]`` (a version's frames in tensor and element order, covering each tensor: an
    anchor); 1 (no bytes) for a tensor without frames."""
    frames: dict[str, list[tuple[int, int]]] = {name: [] for name in m.tensors}
    for task, value in zip(tasks, adlers, strict=True):
        f = task.frame
        frames[task.name].append((value, (f.stop - f.start) * itemsize(task.entry.dtype)))
    return {name: combine_frames(parts) for name, parts in frames.items()}


def verify_tensors(m: Manifest, got: Mapping[str, int], outcome: str) -> None:
    """Raise :class:`~deltastore.errors.IntegrityError` naming the tensors whose Adler-32 after
    the update (``got``, per tensor name) is not the one ``m`` gives; ``outcome`` ends the
    message (what the failure left behind, e.g. "nothing was written")."""
    bad = [
        f"{name} ({value:08x}, manifest {m.tensors[name].adler32:08x})"
        for name, value in got.items()
        if value != m.tensors[name].adler32
    ]
    if bad:
        raise IntegrityError(
            f"version {m.version}: {len(bad)} tensor(s) would not have the manifest's Adler-32 "
            f"after the update: {', '.join(bad[:4])}; {outcome}"
        )


def writes_of(
    tensors: Tensors,
    updates: Iterable[Update],
    *,
    words: Callable[[Tensors, str], Words] | None = None,
) -> list[Write]:
    """The writes of ``updates`` into the local ``tensors`` (by name; contiguous); updates that
    change nothing are left out. ``words(tensors, name)``: a tensor's flat words (default
    :func:`~deltastore.tensors.dtypes.flat_words`; e.g. a
    :class:`~deltastore.tensors.dtypes.WordViews`)."""

    def flat(name: str) -> Words:
        return flat_words(tensors[name]) if words is None else words(tensors, name)

    return [
        Write(flat(u.local)[u.start :], u.positions, u.old, u.new, u.dense, u.xor)
        for u in updates
        if u.new.size
    ]


def write_phase(
    writes: Sequence[Write],
    hooks: Hooks,
    agree: Callable[[bool], Sequence[int]] | None = None,
    *,
    threads: int | None = None,
    priority: Priority = 0,
) -> None:
    """The write phase: ``hooks.pause``; every write, all or nothing
    (:func:`deltastore.tensors.words.write_all`); ``hooks.resume``, also on error.

    ``threads``: how many threads sparse XOR writes may use
    (:func:`~deltastore.tensors.words.write_all`; None: every CPU); without a pause hook they
    run at ``priority`` (:mod:`deltastore.sync.priority`), with one at the calling thread's.

    ``agree`` (the layout path; a collective every rank enters): called after this rank's writes
    with whether they failed (then already rolled back), returns the ranks that failed. If any
    did, this rank raises its own error, or restores its old words and raises
    :class:`~deltastore.errors.RankError`: every rank ends at the old version or all at the new
    one. Without ``agree`` a failed write is rolled back and its error re-raised."""
    if hooks.pause is not None:
        hooks.pause()
    try:
        error: Exception | None = None
        try:
            # no pause: whatever runs beside the sync keeps running, and so do the writes at
            # the sync's priority; paused, they run at the calling thread's
            lower = None if hooks.pause is not None or not priority else priority
            words.write_all(
                writes, threads, None if lower is None else partial(lower_current_thread, lower)
            )
        except Exception as exc:
            if agree is None:
                raise
            error = exc
        failed = agree(error is not None) if agree is not None else ()
        if error is not None:
            raise error
        if failed:
            words.restore_all(writes)
            raise RankError(
                f"rank(s) {list(failed)} failed to write; every rank restored its tensors"
            )
    finally:
        if hooks.resume is not None:
            hooks.resume()


__all__ = [
    "DENSE",
    "Hooks",
    "Sums",
    "Totals",
    "Update",
    "contribution",
    "frame_totals",
    "run_sums",
    "stage_at",
    "stage_dense",
    "stage_run",
    "verify_tensors",
    "write_phase",
    "writes_of",
]
