"""Where a publisher keeps the words of the last published version (its parent for XOR).

``memory``: copies in host RAM. ``disk``: one memory-mapped file ``snapshot.bin`` in a state
folder plus ``state.json`` (version, state digest, per-tensor layout and checksums), so a
restarted publisher continues without re-reading the parent and without a copy in RAM.
A shard writer (``deltastore.publish.sharded``) keeps only its dim-0 row slices of global tensors
(:attr:`TensorState.rows`). :class:`WriterState` is a writer's view of all this: the version it
holds, changed only after a commit.

Update protocol (crash-safe): `begin_update` marks the state dirty, the
caller changes words in place or calls `replace`, then
`commit` records the new clean state atomically. A dirty or missing
``state.json`` means "no saved state". Single writer; not thread-safe.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deltastore.errors import DeltastoreError
from deltastore.format.checksum import adler32
from deltastore.format.dtypes import itemsize, word_dtype
from deltastore.format.keys import manifest_key
from deltastore.format.manifest import parse_manifest
from deltastore.store import Store
from deltastore.store.space import no_room, reserve

log = logging.getLogger("deltastore.publish.publisher")

STATE_FORMAT = 1
#: What to do when the state folder is full (the version is committed all the same).
_TODO = (
    "free space there or give another state folder (CLI: --state-dir); until then the next "
    "publish needs its parent (CLI: --parent) or writes an anchor"
)


def row_range(shape: Sequence[int], rows: tuple[int, int]) -> tuple[int, int]:
    """Flat element range ``[start, stop)`` of dim-0 ``rows`` of a C-order tensor of ``shape``
    (a 0-dim tensor is one row of one element)."""
    per_row = math.prod(shape[1:])
    return rows[0] * per_row, rows[1] * per_row


#: A frame's changes are kept as a bitmap (one bit per element) when more than one element in
#: this many changed, else as uint32 positions (4 bytes per change): the smaller of the two.
BITMAP_DENSITY = 32


@dataclass(frozen=True)
class FrameChange:
    """The changes of one frame of ``n`` words, frame-local, as compact as they come: where
    they are (``where``: uint32 ascending positions, or with ``bitmap`` a
    :func:`numpy.packbits` bitmap of the ``n`` elements, big-endian bit order) and their XOR
    ``masks`` (``old ^ new``, never zero, in position order). Held: ``min(4, n / 8k) + s``
    bytes per change of ``s``-byte words. ``found``: the uint32 positions as the encoder found
    them, for the frame's encoding only (:meth:`positions`; dropped from what is held by
    :meth:`held`). Immutable; :meth:`apply` is thread-safe on distinct targets."""

    n: int
    where: np.ndarray
    masks: np.ndarray
    bitmap: bool
    found: np.ndarray | None = None

    def positions(self) -> np.ndarray:
        """The uint32 positions of the changes (made from the bitmap if they were dropped)."""
        if self.found is not None:
            return self.found
        return _positions(self.where, self.n, self.bitmap)

    def held(self) -> HeldFrame:
        """What a writer keeps of this change until its commit: no encoder's positions, the
        masks packed when that is smaller (:class:`PackedMasks`)."""
        packed = PackedMasks.of(self.masks)
        return HeldFrame(self.n, self.where, self.masks if packed is None else packed, self.bitmap)


@dataclass(frozen=True)
class PackedMasks:
    """XOR masks of words of 2 bytes or more, as their low bytes (``low``: uint8, one per
    change) and, for the masks with higher bits set (a small change of a float mostly flips
    low mantissa bits), their indexes among the changes (``at``: uint32) and those bits
    (``high``: the masks shifted right by 8 bits, of the words' ``dtype``). Immutable."""

    low: np.ndarray
    at: np.ndarray
    high: np.ndarray
    dtype: np.dtype[Any]

    @classmethod
    def of(cls, masks: np.ndarray) -> PackedMasks | None:
        """``masks`` packed, or None when that would not be smaller than them."""
        size = masks.dtype.itemsize
        if size < 2 or not masks.size:
            return None
        high = masks >> 8
        at = np.flatnonzero(high)
        if at.size * (4 + size) + masks.size >= masks.nbytes:
            return None
        return cls(masks.astype(np.uint8), at.astype(np.uint32), high[at], masks.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return int(self.low.nbytes + self.at.nbytes + self.high.nbytes)

    def masks(self) -> np.ndarray:
        """The masks, unpacked."""
        out = self.low.astype(self.dtype)
        out[self.at] |= self.high << 8
        return out


@dataclass(frozen=True)
class HeldFrame:
    """A frame's changes as a writer holds them until its commit: a :class:`FrameChange`'s
    ``n``, ``where`` and ``bitmap``, its masks as they are or packed. Immutable; :meth:`apply`
    is thread-safe on distinct targets."""

    n: int
    where: np.ndarray
    masks: np.ndarray | PackedMasks
    bitmap: bool

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return int(self.where.nbytes + self.masks.nbytes)

    def positions(self) -> np.ndarray:
        """The uint32 positions of the changes."""
        return _positions(self.where, self.n, self.bitmap)

    def apply(self, words: np.ndarray, *, native: bool = True) -> None:
        """XOR the masks into ``words`` (the frame's ``n`` held words, in place): by the
        kernel :func:`deltastore.kernels.detect.xor_scatter` (one pass over the changes, the
        masks unpacked on the way) where ``words`` is 1-D and contiguous and ``native``,
        else by numpy (the reference; the same words)."""
        if native and words.ndim == 1 and words.flags.c_contiguous and words.flags.writeable:
            from deltastore.kernels import detect as kernels  # numba: imported on first use

            k = int(self.masks.low.size if isinstance(self.masks, PackedMasks) else self.masks.size)
            at = kernels.bitmap_positions(self.where, self.n, k) if self.bitmap else self.where
            if isinstance(self.masks, PackedMasks):
                m = self.masks
                kernels.xor_scatter(words, at, packed=(m.low, m.at, m.high))
            else:
                kernels.xor_scatter(words, at, self.masks)
            return
        masks = self.masks.masks() if isinstance(self.masks, PackedMasks) else self.masks
        words[_unpacked(self.where, self.n) if self.bitmap else self.where] ^= masks


def _unpacked(bitmap: np.ndarray, n: int) -> np.ndarray:
    """A :func:`numpy.packbits` bitmap of ``n`` elements as a bool mask."""
    return np.unpackbits(bitmap, count=n).view(np.bool_)


def _positions(where: np.ndarray, n: int, bitmap: bool) -> np.ndarray:
    """uint32 positions of changes held as positions (``where`` itself) or as a bitmap."""
    return np.flatnonzero(_unpacked(where, n)).astype(np.uint32) if bitmap else where


@dataclass(frozen=True)
class HeldChange:
    """Changes of one frame to write into the held copy once a delta is committed: ``held``
    (the frame's held words, a view of the tensor's) and its ``change``."""

    held: np.ndarray
    change: HeldFrame


@dataclass(frozen=True)
class TensorSums:
    """Adler-32 (zlib-compatible, of the little-endian bytes) of each frame of a tensor and
    of the whole tensor."""

    frames: list[int]
    whole: int


@dataclass
class TensorState:
    """Publisher-side memory of one tensor at the last published version."""

    dtype: str
    shape: list[int]  # of the whole (global) tensor
    words: np.ndarray  # unsigned little-endian words of the published version
    frame_adler: list[int]  # on the writer's frame grid, from the first word
    adler: int  # of the words
    rows: tuple[int, int] | None = None  # the dim-0 rows the words hold; None: all of them


@dataclass
class SavedState:
    """What a snapshot store remembers across restarts."""

    store: str
    version: int
    state_digest: str
    max_frame_bytes: int
    tensors: dict[str, TensorState]
    shard: tuple[int, int] | None = None  # (rank, world) of a shard writer


class MemorySnapshot:
    """Copies in RAM; nothing survives the process. Base of the other snapshot stores."""

    def replace(
        self, words: dict[str, np.ndarray], *, owned: bool = False
    ) -> dict[str, np.ndarray]:
        """New storage holding copies of ``words`` (``owned``: the arrays themselves, which
        the caller gives up: no copy); returns the stored arrays."""
        return dict(words) if owned else {n: w.copy() for n, w in words.items()}

    def begin_update(self) -> None:
        """Mark the saved state as being changed (nothing is saved in memory)."""

    def commit(self, state: SavedState) -> None:
        """Record ``state`` as the clean saved state (nothing is saved in memory)."""

    def load(self) -> SavedState | None:
        """The saved clean state, or None."""
        return None


def _write_json_atomic(path: Path, obj: Any) -> None:
    """Replace ``path`` with ``obj`` as JSON (temp file, fsync, rename); the temp file is
    removed on error, a full disk or quota raises :class:`~deltastore.errors.DiskFullError`."""
    data = json.dumps(obj).encode()
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}"
    try:
        with no_room(path.parent, path.name, needed=len(data), todo=_TODO):
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class DiskSnapshot(MemorySnapshot):
    """``snapshot.bin`` (memory-mapped words, 64-byte aligned per tensor) + ``state.json``."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir).expanduser()
        self._state_file = self.dir / "state.json"
        self._data_file = self.dir / "snapshot.bin"
        self._offsets: dict[str, int] = {}
        self._map: np.memmap | None = None

    def begin_update(self) -> None:
        """Mark the saved state dirty; when even that fails (a full disk), remove
        ``state.json`` (no room needed), so that the stale clean state is not adopted later."""
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            _write_json_atomic(self._state_file, {"format": STATE_FORMAT, "dirty": True})
        except OSError:
            self._state_file.unlink(missing_ok=True)
            raise

    def replace(
        self, words: dict[str, np.ndarray], *, owned: bool = False
    ) -> dict[str, np.ndarray]:
        """Write ``words`` to a new ``snapshot.bin`` (its blocks reserved before it is mapped,
        :func:`deltastore.store.space.reserve`) and map it (``owned`` makes no difference); on
        error the new file is removed and a full disk or quota raises
        :class:`~deltastore.errors.DiskFullError`."""
        self.dir.mkdir(parents=True, exist_ok=True)
        offsets, total = {}, 0
        for name, w in words.items():
            offsets[name] = total
            total += -(-w.nbytes // 64) * 64
        tmp = self.dir / f".snapshot.{uuid.uuid4().hex}"
        what = f"the publisher state ({len(words)} tensors)"
        try:
            with no_room(self.dir, what, needed=total, todo=_TODO):
                with open(tmp, "wb") as fh:
                    reserve(fh.fileno(), 0, max(total, 1))
                    fh.truncate(max(total, 1))
                new = np.memmap(tmp, dtype=np.uint8, mode="r+")
                out = {}
                for name, w in words.items():
                    view = new[offsets[name] : offsets[name] + w.nbytes].view(w.dtype)
                    view[:] = w
                    out[name] = view
                new.flush()
                os.replace(tmp, self._data_file)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._map, self._offsets = new, offsets
        return out

    def commit(self, state: SavedState) -> None:
        if self._map is not None:
            self._map.flush()
        tensors = {
            name: {
                "dtype": t.dtype,
                "shape": t.shape,
                "offset": self._offsets[name],
                "adler32": t.adler,
                "frame_adler32": t.frame_adler,
                "rows": t.rows,
            }
            for name, t in state.tensors.items()
        }
        _write_json_atomic(
            self._state_file,
            {
                "format": STATE_FORMAT,
                "dirty": False,
                "store": state.store,
                "version": state.version,
                "state_digest": state.state_digest,
                "max_frame_bytes": state.max_frame_bytes,
                "shard": state.shard,
                "tensors": tensors,
            },
        )

    def load(self) -> SavedState | None:
        try:
            meta = json.loads(self._state_file.read_text())
            if meta.get("format") != STATE_FORMAT or meta.get("dirty", True):
                return None
            shard = _pair(meta.get("shard"))
            data = np.memmap(self._data_file, dtype=np.uint8, mode="r+")
            tensors: dict[str, TensorState] = {}
            offsets: dict[str, int] = {}
            for name, t in meta["tensors"].items():
                size = itemsize(t["dtype"])
                rows = _pair(t.get("rows"))
                first, stop = row_range(t["shape"], rows) if rows else (0, math.prod(t["shape"]))
                count = stop - first
                start = int(t["offset"])
                if start + count * size > data.size:
                    return None
                words = data[start : start + count * size].view(word_dtype(size))
                if adler32(words) != int(t["adler32"]):  # a damaged snapshot would poison deltas
                    return None
                tensors[name] = TensorState(
                    t["dtype"],
                    list(t["shape"]),
                    words,
                    list(t["frame_adler32"]),
                    int(t["adler32"]),
                    rows,
                )
                offsets[name] = start
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self._map, self._offsets = data, offsets
        return SavedState(
            store=str(meta["store"]),
            version=int(meta["version"]),
            state_digest=str(meta["state_digest"]),
            max_frame_bytes=int(meta["max_frame_bytes"]),
            tensors=tensors,
            shard=shard,
        )


def _pair(value: Any) -> tuple[int, int] | None:
    """``[a, b]`` from ``state.json`` as a tuple (None stays None)."""
    if value is None:
        return None
    a, b = value
    return int(a), int(b)


class WriterState:
    """What a writer holds of its last committed version: the words (in a snapshot store),
    their checksums, the version and its state digest. Changed only after a commit or an
    attach; saved after every change by a disk snapshot store.

    ``shard`` is the ``(rank, world)`` of a shard writer (None for a publisher): a saved state
    is adopted only by a writer of the same store, ``max_frame_bytes`` and shard.
    """

    def __init__(
        self,
        store: Store,
        snapshots: MemorySnapshot,
        max_frame_bytes: int,
        shard: tuple[int, int] | None,
    ) -> None:
        self._store, self._snapshots = store, snapshots
        self._max_frame_bytes, self._shard = max_frame_bytes, shard
        self.tensors: dict[str, TensorState] | None = None
        self.version: int | None = None
        self.digest: str | None = None

    def resume(self) -> None:
        """Adopt the saved state if it is this store's committed version with these settings."""
        saved = self._snapshots.load()
        if saved is None or (saved.store, saved.shard) != (self._store.url, self._shard):
            return
        if saved.max_frame_bytes != self._max_frame_bytes:
            log.info("saved state ignored: it was written with another max_frame_bytes")
            return
        try:
            manifest = parse_manifest(self._store.get(manifest_key(saved.version)))
        except DeltastoreError as exc:
            log.info("saved state ignored: version %d unreadable (%s)", saved.version, exc)
            return
        if manifest.state_digest != saved.state_digest:
            log.info("saved state ignored: it does not match version %d", saved.version)
            return
        self.tensors, self.version, self.digest = saved.tensors, saved.version, saved.state_digest

    def forget(self) -> None:
        """Hold no version (the next publish is an anchor); the saved state stays as it was."""
        self.tensors = self.version = self.digest = None

    def replace(
        self,
        version: int,
        digest: str,
        host: Mapping[str, np.ndarray],
        specs: Mapping[str, tuple[str, list[int]]],
        sums: Mapping[str, TensorSums],
        rows: Mapping[str, tuple[int, int]],
        *,
        owned: bool = False,
    ) -> None:
        """Hold ``version``: copies of ``host`` (per tensor: ``specs`` dtype and shape, ``sums``
        frame and whole Adler-32, ``rows`` where the words are row slices; ``owned``: the
        arrays of ``host`` are the caller's own copies, which it gives up: a memory snapshot
        keeps them as they are)."""
        self._snapshots.begin_update()
        words = self._snapshots.replace(dict(host), owned=owned)
        self.tensors = {
            n: TensorState(*specs[n], words[n], sums[n].frames, sums[n].whole, rows=rows.get(n))
            for n in host
        }
        self._hold(version, digest)

    def update(
        self,
        version: int,
        digest: str,
        changes: Sequence[HeldChange],
        sums: Mapping[str, TensorSums],
    ) -> None:
        """Hold ``version``, a delta on the version held: ``changes`` written into the held
        words in place, O(changed); ``sums`` the new checksums."""
        if self.tensors is None:
            raise ValueError("no version held to update")
        self._snapshots.begin_update()
        for c in changes:
            c.change.apply(c.held)
        for name, st in self.tensors.items():
            st.frame_adler, st.adler = sums[name].frames, sums[name].whole
        self._hold(version, digest)

    def _hold(self, version: int, digest: str) -> None:
        self.version, self.digest = version, digest
        if self.tensors is not None:
            self._snapshots.commit(
                SavedState(
                    self._store.url,
                    version,
                    digest,
                    self._max_frame_bytes,
                    self.tensors,
                    self._shard,
                )
            )
