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

Memory floor = zstd decompression of the same frames on a pool of as many threads as
deltastore's subscriber decodes on (:data:`~deltastore.bench.systems.SUBSCRIBER_WORKERS`;
frames split across the threads, largest first, each thread with its own context) + one
native read-modify-write pass that XORs ``old ^ new`` into the changed words
(:func:`deltastore.kernels.floor.xor_at_unchecked`, GIL released) on the same pool, the
version's changes cut into as many equal runs as threads (a run may span tensors and a
tensor several runs; runs touch disjoint words). Positions are int32 where a tensor has
fewer than 2**31 words. Threads, contexts, kernel compilation and the inputs are set up
untimed; each pass follows its own hash of the whole model. XOR entropy floor: the order-0
entropy of the same changes' gaps and masks (:mod:`deltastore.bench.entropy`), untimed.

The changes come from the workload's files (positions where version ``v - 1`` and ``v``
differ, their old and new words), the frames from the store (the version's manifest and data
objects, read untimed). The tensors' contents do not matter to the cost: the floors run after
the subscriber's last sync and leave the tensors at no particular version.

Not thread-safe (it writes into the caller's tensors); one call at a time per buffer. The
pool (:class:`FloorPool`) is used from one thread at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType

import numpy as np
import zstandard

from deltastore.bench.entropy import xor_entropy
from deltastore.bench.ops import Differ, digest
from deltastore.bench.schema import FloorSample
from deltastore.bench.systems import SUBSCRIBER_WORKERS
from deltastore.bench.workload import Workload
from deltastore.format.checksum import delta_sums
from deltastore.format.keys import manifest_key
from deltastore.format.manifest import parse_manifest
from deltastore.kernels import floor as kernel
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


class FloorPool:
    """``threads`` threads, all started before anything is timed, one zstd context each.
    Used from one thread at a time; :meth:`close` (or ``with``) stops them."""

    def __init__(self, threads: int = SUBSCRIBER_WORKERS) -> None:
        if threads < 1:
            raise ValueError("threads must be positive")
        self.threads = threads
        self._ex = ThreadPoolExecutor(threads, thread_name_prefix="memory-floor")
        barrier = threading.Barrier(threads)  # every thread exists before the first pass
        list(self._ex.map(lambda _: barrier.wait(timeout=60), range(threads)))
        self._dctx = [zstandard.ZstdDecompressor() for _ in range(threads)]
        for dtype in kernel.POSITION_DTYPES:  # compile or load both signatures, untimed
            kernel.xor_at(np.zeros(1, np.uint16), np.zeros(1, dtype), np.zeros(1, np.uint16))

    def run(self, jobs: list[Callable[[], None]]) -> float:
        """Seconds from handing out ``jobs`` (one per thread at most) to the last one done."""
        t0 = time.perf_counter()
        for future in [self._ex.submit(job) for job in jobs]:
            future.result()
        return time.perf_counter() - t0

    def decompress(self, frames: list[memoryview]) -> float:
        """Seconds to zstd-decompress every frame, the frames split across the threads
        (largest first, each to the least loaded thread; outputs dropped)."""
        bins: list[list[memoryview]] = [[] for _ in range(self.threads)]
        load = [0] * self.threads
        for frame in sorted(frames, key=len, reverse=True):
            i = load.index(min(load))
            bins[i].append(frame)
            load[i] += len(frame)

        def job(i: int) -> Callable[[], None]:
            def work() -> None:
                for frame in bins[i]:
                    self._dctx[i].decompress(frame)

            return work

        return self.run([job(i) for i in range(self.threads) if bins[i]])

    def xor_pass(self, runs: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]) -> float:
        """Seconds of one native XOR pass over ``runs`` (from :func:`xor_runs`), one run
        per thread."""

        def job(run: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Callable[[], None]:
            def work() -> None:
                for words, positions, masks in run:
                    kernel.xor_at_unchecked(words, positions, masks)

            return work

        return self.run([job(run) for run in runs if run])

    def close(self) -> None:
        self._ex.shutdown(wait=True)

    def __enter__(self) -> FloorPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def xor_runs(
    changes: list[Changes], threads: int
) -> list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """The changes cut into ``threads`` runs of (nearly) equal counts, in order: each run a
    list of (uint16 words of a tensor, its positions there, the XOR masks ``old ^ new``),
    checked for the kernel. Positions are int32 where the tensor has fewer than 2**31 words."""
    total = sum(c.positions.size for c in changes)
    bounds = [total * k // threads for k in range(threads + 1)]
    runs: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in range(threads)]
    start = 0
    for c in changes:
        words = c.words.view(np.uint16)
        small = words.size < 2**31
        positions = c.positions.astype(np.int32) if small else c.positions
        masks = c.old ^ c.new
        end = start + positions.size
        for k in range(threads):
            a, b = max(start, bounds[k]), min(end, bounds[k + 1])
            if a < b:
                piece = (words, positions[a - start : b - start], masks[a - start : b - start])
                kernel.check(*piece)
                runs[k].append(piece)
        start = end
    return runs


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


def measure(
    store: Store, wl: Workload, flat: np.ndarray, version: int, pool: FloorPool | None = None
) -> FloorSample:
    """The floors of ``version`` (see the module docstring), timed into ``flat`` (the
    receiver's flat int16 buffer, every tensor in the workload's table order); ``pool``: the
    memory floor's threads (default: a pool of :data:`SUBSCRIBER_WORKERS` for this call).
    ``flat`` ends with the version's new words at its changed positions."""
    if pool is None:
        with FloorPool() as own:
            return measure(store, wl, flat, version, own)
    changes = workload_changes(wl, flat, version)
    changed = sum(c.positions.size for c in changes)
    if changed != wl.index.changed[version]:
        raise RuntimeError(
            f"version {version}: {changed} changed words in the files, the index says "
            f"{wl.index.changed[version]}"
        )
    frames = stored_frames(store, version)
    news = [c.new.view(np.int16) for c in changes]
    runs = xor_runs(changes, pool.threads)
    entropy = xor_entropy([(c.positions, c.old ^ c.new) for c in changes])
    passes, memory = [], []
    for _ in range(REPEATS):
        digest([flat])  # as before a sync: a pass over the whole model
        memory.append((pool.decompress(frames), pool.xor_pass(runs)))
        digest([flat])
        decompress = decompress_all(frames)
        passes.append((decompress, *_pass(changes, news)))  # the last: flat at the version
    decompress, gather, checksum, scatter, _ = min(passes, key=lambda p: sum(p[:4]))
    bare = min(p[4] for p in passes)
    pool_decompress, rmw = min(memory, key=sum)
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
        threads=pool.threads,
        pool_decompress_s=pool_decompress,
        rmw_s=rmw,
        memory_floor_s=pool_decompress + rmw,
        gap_entropy_bytes=entropy.gap_bytes,
        mask_entropy_bytes=entropy.mask_bytes,
        xor_entropy_floor=entropy.floor,
    )
