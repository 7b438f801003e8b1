"""The receiver's floors (benchmarks/README.md, Floors): the least work any verifying receiver
does for a version's changes, timed on the same changes, into the same tensors, in the same
process as deltastore's subscriber.

Receiver floor = zstd decompression of every stored frame of the version + per tensor one
gather of the changed words, the O(changed) Adler-32 update
(:func:`deltastore.format.checksum.delta_sums`) and one scatter of the new words (numpy, int64
positions, one thread). Pause floor = one bare scatter of the same words into the same
tensors, timed on its own right after the receiver floor's pass (as deltastore's write phase
follows its staging, which gathered the same words). Each pass starts after a hash of the
whole model (the caches then hold what they hold before a sync: the worker hashes the model
after every sync); each floor is the fastest of :data:`REPEATS` passes.

The changes come from the workload's files (positions where version ``v - 1`` and ``v``
differ, their old and new words), the frames from the store (the version's manifest and data
objects, read untimed). The tensors' contents do not matter to the cost: the floors run after
the subscriber's last sync and leave the tensors at no particular version.

Not thread-safe (it writes into the caller's tensors); one call at a time per buffer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import zstandard

from deltastore.bench.ops import Differ, digest
from deltastore.bench.schema import FloorSample
from deltastore.bench.workload import Workload
from deltastore.format.checksum import delta_sums
from deltastore.format.keys import manifest_key
from deltastore.format.manifest import parse_manifest
from deltastore.store import Store

#: Passes per version; each floor is the fastest (a floor bounds from below).
REPEATS = 3


@dataclass(frozen=True)
class Changes:
    """One tensor's changes between two versions: its flat int16 words in the receiver's
    buffer, sorted int64 positions, and the old and new words there (uint16)."""

    words: np.ndarray
    positions: np.ndarray
    old: np.ndarray
    new: np.ndarray


def workload_changes(wl: Workload, flat: np.ndarray, version: int) -> list[Changes]:
    """The changes of ``version`` against ``version - 1``, per tensor that has any, read
    from the workload's files (memory-mapped; chunked bit-wise comparison)."""
    before, after = wl.words(version - 1), wl.words(version)
    differ = Differ()
    out = []
    for t in wl.index.tensors:
        a, b = before[t.offset : t.offset + t.numel], after[t.offset : t.offset + t.numel]
        pos = differ.positions(a, b)
        if pos.size:
            out.append(
                Changes(
                    words=flat[t.offset : t.offset + t.numel],
                    positions=pos.astype(np.int64, copy=False),
                    old=a[pos].view(np.uint16),
                    new=b[pos].view(np.uint16),
                )
            )
    return out


def stored_frames(store: Store, version: int) -> list[memoryview]:
    """The stored bytes of every frame of ``version`` (each one zstd frame), from its
    manifest and data objects (each object read once)."""
    manifest = parse_manifest(store.get(manifest_key(version)))
    frames = [f for entry in manifest.tensors.values() for f in entry.frames]
    objects = {name: memoryview(store.get(name)) for name in {f.object for f in frames}}
    return [objects[f.object][f.offset : f.offset + f.length] for f in frames]


def decompress_all(frames: list[memoryview]) -> float:
    """Seconds to zstd-decompress every frame (one context, one thread; the output of each
    frame is dropped)."""
    dctx = zstandard.ZstdDecompressor()
    t0 = time.perf_counter()
    for frame in frames:
        dctx.decompress(frame)
    return time.perf_counter() - t0


def _pass(changes: list[Changes], news: list[np.ndarray]) -> tuple[float, float, float, float]:
    """One receiver-floor pass over every tensor's changes, then one bare scatter:
    seconds of (gather, checksum, scatter, bare scatter)."""
    gather = checksum = scatter = 0.0
    for c, new in zip(changes, news, strict=True):
        ta = time.perf_counter()
        got = c.words[c.positions]
        tb = time.perf_counter()
        delta_sums(c.positions, c.old, got.view(np.uint16), 2 * c.words.size)
        tc = time.perf_counter()
        c.words[c.positions] = new
        td = time.perf_counter()
        gather, checksum, scatter = gather + tb - ta, checksum + tc - tb, scatter + td - tc
    t0 = time.perf_counter()
    for c, new in zip(changes, news, strict=True):
        c.words[c.positions] = new
    return gather, checksum, scatter, time.perf_counter() - t0


def measure(store: Store, wl: Workload, flat: np.ndarray, version: int) -> FloorSample:
    """The floors of ``version`` (see the module docstring), timed into ``flat`` (the
    receiver's flat int16 buffer, every tensor in the workload's table order)."""
    changes = workload_changes(wl, flat, version)
    changed = sum(c.positions.size for c in changes)
    if changed != wl.index.changed[version]:
        raise RuntimeError(
            f"version {version}: {changed} changed words in the files, the index says "
            f"{wl.index.changed[version]}"
        )
    frames = stored_frames(store, version)
    news = [c.new.view(np.int16) for c in changes]
    passes = []
    for _ in range(REPEATS):
        digest([flat])  # as before a sync: a pass over the whole model
        decompress = decompress_all(frames)
        passes.append((decompress, *_pass(changes, news)))
    decompress, gather, checksum, scatter, _ = min(passes, key=lambda p: sum(p[:4]))
    bare = min(p[4] for p in passes)
    return FloorSample(
        version=version,
        changed_elements=changed,
        frames=len(frames),
        payload_bytes=sum(len(f) for f in frames),
        decompress_s=decompress,
        gather_s=gather,
        checksum_s=checksum,
        scatter_s=scatter,
        receiver_floor_s=decompress + gather + checksum + scatter,
        scatter_floor_s=bare,
    )
