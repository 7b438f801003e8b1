"""The dense baselines: the whole model as one safetensors object per version.

``dense`` is the strongest dense load a competent user would write. Publish:
``safetensors.torch.save_file``, then the file goes into the store (a local store: written in
its folder; S3: a multipart upload, :data:`PARTS_AT_ONCE` parts at once; other stores: ``put``).
Load, straight into the receiver's existing tensors, by every method of
:attr:`DenseReceiver.methods` on every version (the analysis reports the fastest by median):

- local store: ``safetensors.torch.load_file`` + ``copy_`` per tensor, ``safe_open`` +
  ``get_tensor`` + ``copy_`` per tensor, and ``load_file`` + ``copy_`` with torch limited to
  one thread (``load_file`` maps the file lazily: the copy is what reads it, from the page
  cache; on a busy 2-core machine torch's two-thread ``copy_`` waited on its thread pool and
  took 3-30x longer than one thread for the small model);
- object store: :data:`RANGES_AT_ONCE` concurrent ranged GETs (``Store.get_range`` on a
  thread pool; the safetensors header is parsed from the first range, each range copied into
  the tensors as it arrives), and one whole-object GET copied into the tensors.

``dense-naive`` is what the benchmark measured as dense in schema 1 (a straw man):
``safetensors.torch.save`` to ``bytes`` and ``put``; ``get`` the whole object,
``safetensors.torch.load`` (new tensors), copy. It is reported, never used in a ratio.

Object layout: safetensors (an 8-byte little-endian header length, the JSON header, then the
tensors' little-endian bytes). Not thread-safe: one sender or receiver per worker process,
called from its main thread (the ranged load runs its GETs on a pool of its own).
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from safetensors import safe_open

from deltastore.bench.schema import PublishTimes, SyncTimes
from deltastore.bench.systems import (
    LEN,
    Receiver,
    Sender,
    object_key,
    publish_times,
    sync_times,
)
from deltastore.bench.workload import Workload
from deltastore.store import LocalStore, Store
from deltastore.store.counting import CountingStore
from deltastore.store.s3 import S3Store

#: Concurrent ranged GETs of dense's object-store load.
RANGES_AT_ONCE = 8
#: Bounds of one ranged GET: the object's data split in :data:`RANGES_AT_ONCE` ranges, clamped.
MIN_RANGE_BYTES = 8 << 20
MAX_RANGE_BYTES = 64 << 20
#: Parts uploaded at once, and bytes per part, by dense's S3 multipart upload.
PARTS_AT_ONCE = 8
PART_BYTES = 64 << 20
#: Bytes the last range asks for beyond the data, so it also covers the header (which comes
#: first): a header longer than this costs one more GET.
HEADER_SLACK = 1 << 20

#: dense's load methods: local stores, then object stores.
LOAD_FILE = "load_file+copy_"
SAFE_OPEN = "safe_open+copy_"
LOAD_FILE_ONE_THREAD = "load_file+copy_ (1 torch thread)"
RANGED = f"{RANGES_AT_ONCE} ranged GETs+copy"
WHOLE_GET = "GET+copy"


def range_bytes(data_bytes: int) -> int:
    """Bytes per ranged GET for an object of ``data_bytes`` tensor bytes."""
    return min(MAX_RANGE_BYTES, max(MIN_RANGE_BYTES, -(-data_bytes // RANGES_AT_ONCE)))


@dataclass(frozen=True)
class FileLayout:
    """Where a safetensors object puts each tensor of the workload: per tensor, sorted by
    position in the object, its object bytes ``[starts[i], ends[i])`` and the byte offset
    ``dests[i]`` of its words in the receiver's flat buffer; ``size``: the object's bytes."""

    size: int
    starts: list[int]
    ends: list[int]
    dests: list[int]


def parse_layout(head: bytes | memoryview, wl: Workload) -> FileLayout:
    """The :class:`FileLayout` of a safetensors object from its first bytes (the 8-byte
    little-endian header length, then the JSON header). :class:`ValueError` when ``head``
    is too short or a tensor is missing or differs from the workload's (dtype, shape)."""
    if len(head) < LEN.size:
        raise ValueError("safetensors object shorter than its header length")
    (n,) = LEN.unpack_from(head)
    if len(head) < LEN.size + n:
        raise ValueError(f"safetensors header of {n} bytes not in the first {len(head)} bytes")
    header = json.loads(bytes(head[LEN.size : LEN.size + n]))
    base = LEN.size + n
    spans = []
    for t in wl.index.tensors:
        entry = header.get(t.name)
        if entry is None or entry["dtype"] != "BF16" or tuple(entry["shape"]) != t.shape:
            raise ValueError(f"safetensors object: {t.name} missing or not bf16 {t.shape}")
        a, b = entry["data_offsets"]
        if b - a != 2 * t.numel:
            raise ValueError(f"safetensors object: {t.name} spans {b - a} bytes")
        spans.append((base + a, base + b, 2 * t.offset))
    spans.sort()
    return FileLayout(
        size=max((e for _, e, _ in spans), default=base),
        starts=[a for a, _, _ in spans],
        ends=[e for _, e, _ in spans],
        dests=[d for _, _, d in spans],
    )


def copy_span(layout: FileLayout, at: int, chunk: bytes | memoryview, out: np.ndarray) -> None:
    """Copy object bytes ``[at, at + len(chunk))`` that hold tensor data into ``out`` (the
    receiver's flat buffer as uint8). memcpy per tensor piece (numpy releases the GIL)."""
    src = np.frombuffer(chunk, dtype=np.uint8)
    end = at + src.size
    i = max(0, bisect.bisect_right(layout.starts, at) - 1)
    while i < len(layout.starts) and layout.starts[i] < end:
        a, b = max(at, layout.starts[i]), min(end, layout.ends[i])
        if a < b:
            d = layout.dests[i] + a - layout.starts[i]
            out[d : d + b - a] = src[a - at : b - at]
        i += 1


def _unwrapped(store: Store) -> Store:
    """The store behind the bench's request counter: a local store's folder is read
    directly (the counter still sees every request made through the store)."""
    return store.inner if isinstance(store, CountingStore) else store


class DenseSender(Sender):
    """``save_file`` of the whole model, then into the store: written in a local store's
    folder (temp file and rename, as the store writes; no fsync), a multipart upload of
    :data:`PART_BYTES` parts, :data:`PARTS_AT_ONCE` at once, to S3 (s3fs ``put_file``, from a
    temporary file), ``put`` elsewhere. Encode = ``save_file``, upload = the rest."""

    def __init__(self, store: Store, workload: Workload) -> None:
        super().__init__(store, workload)
        if isinstance(store, LocalStore):
            self.method = "save_file in the store's folder"
        elif isinstance(store, S3Store):
            self.method = f"save_file + multipart upload ({PARTS_AT_ONCE} parts at once)"
        else:
            self.method = "save_file + put"

    def publish(self, version: int, flat: np.ndarray) -> PublishTimes:
        key, tensors = object_key(version), self.wl.tensors(flat)
        store = self.store
        if isinstance(store, LocalStore):
            path = store.root / key
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".tmp-{key}-{uuid.uuid4().hex}"
            t0 = time.perf_counter()
            safetensors.torch.save_file(tensors, tmp)
            t1 = time.perf_counter()
            os.replace(tmp, path)
            t2 = time.perf_counter()
            return publish_times(path.stat().st_size, t0, t0, t1, t2)
        fd, name = tempfile.mkstemp(prefix="deltastore-bench-", suffix=".safetensors")
        os.close(fd)
        try:
            t0 = time.perf_counter()
            safetensors.torch.save_file(tensors, name)
            t1 = time.perf_counter()
            if isinstance(store, S3Store):
                store.fs.put_file(
                    name,
                    f"{store.root}/{key}",
                    chunksize=PART_BYTES,
                    max_concurrency=PARTS_AT_ONCE,
                )
            else:
                store.put(key, Path(name).read_bytes())
            t2 = time.perf_counter()
            return publish_times(os.path.getsize(name), t0, t0, t1, t2)
        finally:
            os.unlink(name)


class DenseReceiver(Receiver):
    """The strongest dense load, straight into the receiver's tensors, by every method of
    :attr:`methods` (see the module docstring). Times: ``fetch`` the GETs (summed over the
    ranged GETs' threads), ``decode`` opening and parsing (``load_file``, ``get_tensor``, the
    header), ``apply`` the copies (summed over threads), ``pause`` the span in which tensors
    are written (for ``safe_open`` and ranged GETs, the whole load)."""

    def __init__(
        self,
        store: Store,
        workload: Workload,
        flat: np.ndarray,
        *,
        methods: tuple[str, ...] | None = None,
        range_size: int | None = None,
        header_slack: int = HEADER_SLACK,
    ) -> None:
        """``methods``: the methods to time (default: the local ones for a
        :class:`~deltastore.store.LocalStore`, the object-store ones otherwise; the
        object-store methods work on any store). ``range_size``: bytes per ranged GET
        (default :func:`range_bytes` of the model); ``header_slack``: see
        :data:`HEADER_SLACK`."""
        super().__init__(store, workload, flat)
        local = isinstance(_unwrapped(store), LocalStore)
        default = (LOAD_FILE, SAFE_OPEN, LOAD_FILE_ONE_THREAD) if local else (RANGED, WHOLE_GET)
        self.methods = default if methods is None else methods
        if not local and set(self.methods) - {RANGED, WHOLE_GET}:
            raise ValueError(f"dense loads a file only from a local store, not {store.url}")
        self.tensors = workload.tensors(flat)
        self.out = flat.view(np.uint8)
        self.range_size = range_size or range_bytes(workload.dense_bytes)
        self.header_slack = header_slack
        self.pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        if RANGED in self.methods:
            self._pool()

    def _pool(self) -> ThreadPoolExecutor:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(RANGES_AT_ONCE, thread_name_prefix="dense-get")
        return self.pool

    def sync(self, version: int, method: str | None = None) -> SyncTimes:
        key, store = object_key(version), _unwrapped(self.store)
        if method not in self.methods:
            raise ValueError(f"dense times {self.methods}, not {method!r}")
        if method == RANGED:
            return self._ranged(key, self._pool())
        if method == WHOLE_GET:
            return self._whole(key)
        if not isinstance(store, LocalStore):
            raise ValueError(f"dense loads a file only from a local store, not {store.url}")
        path = store.root / key
        if method == SAFE_OPEN:
            return self._safe_open(path)
        if method == LOAD_FILE_ONE_THREAD:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                return self._load_file(path)
            finally:
                torch.set_num_threads(threads)
        return self._load_file(path)

    def _load_file(self, path: Path) -> SyncTimes:
        t0 = time.perf_counter()
        loaded = safetensors.torch.load_file(path)
        t1 = time.perf_counter()
        for name, dst in self.tensors.items():
            dst.copy_(loaded[name])
        t2 = time.perf_counter()
        del loaded
        return sync_times(t0, t0, t1, t2)

    def _safe_open(self, path: Path) -> SyncTimes:
        decode = apply = 0.0
        t0 = time.perf_counter()
        with safe_open(path, framework="pt") as fh:
            for name, dst in self.tensors.items():
                ta = time.perf_counter()
                src = fh.get_tensor(name)
                tb = time.perf_counter()
                dst.copy_(src)
                del src
                decode, apply = decode + tb - ta, apply + time.perf_counter() - tb
        total = time.perf_counter() - t0
        return SyncTimes(
            fetch_s=0.0, decode_s=decode, verify_s=0.0, apply_s=apply, pause_s=total, total_s=total
        )

    def _whole(self, key: str) -> SyncTimes:
        t0 = time.perf_counter()
        blob = self.store.get(key)
        t1 = time.perf_counter()
        layout = parse_layout(blob, self.wl)
        t2 = time.perf_counter()
        copy_span(layout, 0, blob, self.out)
        return sync_times(t0, t1, t2, time.perf_counter())

    def _header(self, key: str, first: bytes) -> bytes:
        """The object's first bytes through its whole header: ``first`` (the first range),
        or one more GET when the header is longer."""
        if len(first) < LEN.size:
            return first
        need = LEN.size + LEN.unpack_from(first)[0]
        return first if len(first) >= need else self.store.get_range(key, 0, need)

    def _ranged(self, key: str, pool: ThreadPoolExecutor) -> SyncTimes:
        step = self.range_size
        starts = list(range(0, self.wl.dense_bytes, step))
        ready = threading.Event()
        found: list[FileLayout] = []
        lock = threading.Lock()
        spent = {"fetch": 0.0, "decode": 0.0, "apply": 0.0}

        def job(i: int) -> int:
            at = starts[i]
            last = i == len(starts) - 1
            ta = time.perf_counter()
            try:
                chunk = self.store.get_range(key, at, step + (self.header_slack if last else 0))
                tb = time.perf_counter()
                if i == 0:
                    found.append(parse_layout(self._header(key, chunk), self.wl))
            finally:
                if i == 0:
                    ready.set()
            tc = time.perf_counter()
            ready.wait()
            if not found:
                raise ValueError("dense: the first range gave no safetensors header")
            td = time.perf_counter()
            copy_span(found[0], at, chunk, self.out)
            te = time.perf_counter()
            with lock:
                spent["fetch"] += tb - ta
                spent["decode"] += tc - tb
                spent["apply"] += te - td
            return at + len(chunk)

        t0 = time.perf_counter()
        covered = max(pool.map(job, range(len(starts))))
        if covered < found[0].size:  # a header longer than the slack
            tail = self.store.get_range(key, covered, found[0].size - covered)
            copy_span(found[0], covered, tail, self.out)
        total = time.perf_counter() - t0
        return SyncTimes(
            fetch_s=spent["fetch"],
            decode_s=spent["decode"],
            verify_s=0.0,
            apply_s=spent["apply"],
            pause_s=total,
            total_s=total,
        )


class DenseNaiveSender(Sender):
    """What the benchmark measured as dense before: ``safetensors.torch.save`` to ``bytes``,
    ``put``."""

    method = "save to bytes + put"

    def publish(self, version: int, flat: np.ndarray) -> PublishTimes:
        t0 = time.perf_counter()
        data = safetensors.torch.save(self.wl.tensors(flat))
        t1 = time.perf_counter()
        self.store.put(object_key(version), data)
        return publish_times(len(data), t0, t0, t1, time.perf_counter())


class DenseNaiveReceiver(Receiver):
    """``get`` the whole object, ``safetensors.torch.load`` it (new tensors), copy each into
    the receiver's."""

    method = "get, safetensors.torch.load, copy"

    def sync(self, version: int, method: str | None = None) -> SyncTimes:
        t0 = time.perf_counter()
        data = self.store.get(object_key(version))
        t1 = time.perf_counter()
        loaded = safetensors.torch.load(data)
        t2 = time.perf_counter()
        for name, words in self.views.items():  # np.copyto: steadier than torch's copy_
            np.copyto(words, loaded[name].view(torch.int16).reshape(-1).numpy())
        return sync_times(t0, t1, t2, time.perf_counter())
