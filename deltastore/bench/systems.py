"""The systems compared, each a sender (trainer side) and a receiver (rollout side).

- ``deltastore``: :class:`~deltastore.Publisher` (memory snapshot) and
  :class:`~deltastore.Subscriber` over tensors already at the base version.
- ``dense``: the strongest dense baseline, and ``dense-naive``, what the benchmark measured as
  dense before (reported, never used in a ratio): :mod:`deltastore.bench.dense`.
- ``coo``: per version one object, zstd level 1: a JSON header, then per tensor the int32
  positions of its changed elements and their new words (PULSE / AReaL-DTE style).
- ``xor-dense``: per version one object: a JSON header, then per tensor one zstd level-1 frame
  of the whole XOR buffer old ^ new (Baseten style); the receiver streams each frame through a
  reused buffer and XORs it into its tensors.

All go through the same :class:`~deltastore.store.Store`. Senders and receivers work on flat
int16 buffers holding every tensor's words in the workload's table order (bf16 tensors are
views of them). Baselines detect changes with the same chunked integer comparison
(:class:`~deltastore.bench.ops.Differ`) and keep their own copy of the last version, as the
deltastore publisher keeps its snapshot.

Not thread-safe: each sender and receiver belongs to one worker process and is called from
its main thread.
"""

from __future__ import annotations

import json
import struct
import time
from abc import ABC, abstractmethod

import numpy as np
import zstandard

from deltastore.bench.ops import CHUNK_BYTES, Differ, flat_buffer
from deltastore.bench.schema import PublishTimes, SyncTimes
from deltastore.bench.workload import Workload
from deltastore.publish.publisher import Publisher
from deltastore.store import Store
from deltastore.sync.priority import Priority
from deltastore.sync.subscriber import Subscriber

#: A little-endian u64 length (the packed blobs' header length, safetensors' too).
LEN = struct.Struct("<Q")


def object_key(version: int) -> str:
    """The store key of a baseline's object for ``version``."""
    return f"v{version:06d}.bin"


def _pack(header: object, parts: list[bytes]) -> bytes:
    raw = json.dumps(header).encode()
    return b"".join([LEN.pack(len(raw)), raw, *parts])


def _unpack(blob: bytes | memoryview) -> tuple[object, int]:
    """The JSON header of a packed blob and the offset of the bytes after it."""
    (n,) = LEN.unpack_from(blob)
    return json.loads(bytes(blob[LEN.size : LEN.size + n])), LEN.size + n


class Sender(ABC):
    """Trainer side: publishes each version's words through ``store``."""

    #: How this sender publishes, in words (the report names it).
    method = "publish"

    def __init__(self, store: Store, workload: Workload) -> None:
        self.store = store
        self.wl = workload

    def start(self, base: np.ndarray) -> None:  # noqa: B027 - optional hook
        """Untimed setup with the base version's words (e.g. keep a copy, publish an anchor)."""

    @abstractmethod
    def publish(self, version: int, flat: np.ndarray) -> PublishTimes:
        """Publish ``flat`` as ``version`` (the measured work)."""


class Receiver(ABC):
    """Rollout side: keeps ``flat`` (starting at the base version) in sync.

    A receiver with several load methods (:attr:`methods` not empty) has each version loaded
    by every method in turn; the caller overwrites ``flat`` between them, so a method must
    write every word (a dense load does)."""

    #: The load methods :meth:`sync` takes (empty: one method, and ``sync`` gets None).
    methods: tuple[str, ...] = ()
    #: The single method's name, for a receiver with one method.
    method = "sync"

    def __init__(self, store: Store, workload: Workload, flat: np.ndarray) -> None:
        self.store = store
        self.wl = workload
        self.flat = flat
        self.views = workload.views(flat)

    def start(self) -> None:  # noqa: B027 - optional hook
        """Untimed setup (deltastore: check the tensors against the base version)."""

    @abstractmethod
    def sync(self, version: int, method: str | None = None) -> SyncTimes:
        """Bring ``flat`` to ``version`` (the measured work) with ``method``."""


# --- deltastore ------------------------------------------------------------------------------


class DeltastoreSender(Sender):
    method = "Publisher.publish (memory snapshot)"
    #: Stored bytes of the anchor published by :meth:`start` (data frames only).
    anchor_bytes: int | None = None

    def start(self, base: np.ndarray) -> None:
        self.pub = Publisher(self.store)
        rep = self.pub.publish(self.wl.tensors(base), version=0)  # the chain's anchor, untimed
        self.anchor_bytes = rep.payload_bytes

    def publish(self, version: int, flat: np.ndarray) -> PublishTimes:
        t0 = time.perf_counter()
        rep = self.pub.publish(self.wl.tensors(flat), version=version)
        total = time.perf_counter() - t0
        return PublishTimes(
            payload_bytes=rep.payload_bytes,
            detect_s=rep.detect_s,
            encode_s=rep.encode_s,
            upload_s=rep.upload_s,
            total_s=total,
            requests=rep.requests,
            round_trips=rep.round_trips,
            commit_round_trips=rep.commit_round_trips,
        )


#: The threads deltastore's subscriber fetches and decodes on (``Subscriber(max_workers=)``,
#: its default); the memory floor runs on as many (:mod:`deltastore.bench.floors`).
SUBSCRIBER_WORKERS = 4


class DeltastoreReceiver(Receiver):
    """deltastore's subscriber; ``priority``: its worker threads' (0: unchanged; the serving
    replay runs at the engines' default, :data:`~deltastore.sync.priority.DEFAULT_PRIORITY`)."""

    method = "Subscriber.sync"
    priority: Priority = 0

    def start(self) -> None:
        self.sub = Subscriber(
            self.store,
            tensors=self.wl.tensors(self.flat),
            version=0,
            max_workers=SUBSCRIBER_WORKERS,
            priority=self.priority,
        )
        self.sub.verify()  # the O(model) check of tensors handed over with a version
        # the decode kernel's code is loaded here, in the set-up, as an engine loads it at
        # attach (0.2 s from numba's cache), not in the first timed sync
        from deltastore.kernels.batch import warm

        warm()

    def sync(self, version: int, method: str | None = None) -> SyncTimes:
        t0 = time.perf_counter()
        rep = self.sub.sync(version)
        total = time.perf_counter() - t0
        return SyncTimes(
            fetch_s=rep.fetch_s,
            decode_s=rep.decode_s,
            verify_s=rep.verify_s,
            apply_s=rep.pause_s,
            pause_s=rep.pause_s,
            total_s=total,
        )


# --- shared by the baselines ------------------------------------------------------------------


def publish_times(payload: int, t0: float, t1: float, t2: float, t3: float) -> PublishTimes:
    """Detect in ``[t0, t1)``, encode in ``[t1, t2)``, upload in ``[t2, t3)``."""
    return PublishTimes(
        payload_bytes=payload,
        detect_s=t1 - t0,
        encode_s=t2 - t1,
        upload_s=t3 - t2,
        total_s=t3 - t0,
    )


def sync_times(t0: float, t1: float, t2: float, t3: float) -> SyncTimes:
    """Fetch in ``[t0, t1)``, decode in ``[t1, t2)``, apply (the pause) in ``[t2, t3)``."""
    return SyncTimes(
        fetch_s=t1 - t0,
        decode_s=t2 - t1,
        verify_s=0.0,
        apply_s=t3 - t2,
        pause_s=t3 - t2,
        total_s=t3 - t0,
    )


# --- COO: positions + values ------------------------------------------------------------------


class _CopySender(Sender):
    """A baseline sender that keeps its own copy of the last version (``olds``)."""

    def start(self, base: np.ndarray) -> None:
        self.prev = base.copy()
        self.olds = self.wl.views(self.prev)
        self.cctx = zstandard.ZstdCompressor(level=1)


class CooSender(_CopySender):
    method = "chunked not_equal, int32 positions + words, zstd-1, put"

    def start(self, base: np.ndarray) -> None:
        super().start(base)
        self.differ = Differ()

    def publish(self, version: int, flat: np.ndarray) -> PublishTimes:
        t0 = time.perf_counter()
        news = self.wl.views(flat)
        found = {n: self.differ.positions(old, news[n]) for n, old in self.olds.items()}
        t1 = time.perf_counter()
        header, idx, vals = [], [], []
        for name, pos in found.items():
            values = news[name][pos]
            self.olds[name][pos] = values  # the sender's copy moves to this version
            header.append([name, int(pos.size)])
            idx.append(pos.astype(np.int32).tobytes())
            vals.append(values.tobytes())
        blob = self.cctx.compress(_pack(header, idx + vals))
        t2 = time.perf_counter()
        self.store.put(object_key(version), blob)
        return publish_times(len(blob), t0, t1, t2, time.perf_counter())


class CooReceiver(Receiver):
    method = "get, zstd decompress, scatter"

    def sync(self, version: int, method: str | None = None) -> SyncTimes:
        t0 = time.perf_counter()
        blob = self.store.get(object_key(version))
        t1 = time.perf_counter()
        body = zstandard.ZstdDecompressor().decompress(blob)
        header, at = _unpack(body)
        assert isinstance(header, list)
        changes = []
        for name, count in header:
            changes.append((name, np.frombuffer(body, np.int32, count, at)))
            at += 4 * count
        updates = []
        for name, idx in changes:
            updates.append((self.views[name], idx, np.frombuffer(body, np.int16, idx.size, at)))
            at += 2 * idx.size
        t2 = time.perf_counter()
        for words, idx, values in updates:
            words[idx] = values
        return sync_times(t0, t1, t2, time.perf_counter())


# --- xor-dense: the whole XOR buffer per tensor ----------------------------------------------


class XorDenseSender(_CopySender):
    method = "per tensor XOR, zstd-1, put"

    def start(self, base: np.ndarray) -> None:
        super().start(base)
        self.xor = flat_buffer(max(t.numel for t in self.wl.index.tensors))

    def publish(self, version: int, flat: np.ndarray) -> PublishTimes:
        detect = encode = 0.0
        header, frames = [], []
        t0 = time.perf_counter()
        for name, new in self.wl.views(flat).items():
            ta = time.perf_counter()
            old, xor = self.olds[name], self.xor[: new.size]
            np.bitwise_xor(old, new, out=xor)
            tb = time.perf_counter()
            frame = self.cctx.compress(xor.data.cast("B"))
            np.copyto(old, new)  # the sender's copy moves to this version
            header.append([name, len(frame)])
            frames.append(frame)
            tc = time.perf_counter()
            detect, encode = detect + tb - ta, encode + tc - tb
        blob = _pack(header, frames)
        t1 = time.perf_counter()
        self.store.put(object_key(version), blob)
        # Detect is the XORs; the rest up to the upload (zstd, copies, packing) is encode.
        return publish_times(len(blob), t0, t0 + detect, t1, time.perf_counter())


class XorDenseReceiver(Receiver):
    method = "get, streamed zstd decompress, XOR in place"

    def start(self) -> None:
        self.chunk = flat_buffer(CHUNK_BYTES // 2)
        self.dctx = zstandard.ZstdDecompressor()

    def _read(self, reader: zstandard.ZstdDecompressionReader, want: int) -> int:
        """Fill ``self.chunk[:want]`` from ``reader``; returns the words read."""
        view = self.chunk.data.cast("B")[: 2 * want]
        got = 0
        while got < len(view):
            n = reader.readinto(view[got:])
            if not n:
                break
            got += n
        if got % 2:
            raise ValueError("xor-dense frame of an odd byte length")
        return got // 2

    def sync(self, version: int, method: str | None = None) -> SyncTimes:
        t0 = time.perf_counter()
        blob = memoryview(self.store.get(object_key(version)))
        t1 = time.perf_counter()
        header, at = _unpack(blob)
        assert isinstance(header, list)
        decode = apply = 0.0
        for name, length in header:
            words = self.views[name]
            with self.dctx.stream_reader(blob[at : at + length]) as reader:
                done = 0
                while done < words.size:
                    ta = time.perf_counter()
                    n = self._read(reader, min(self.chunk.size, words.size - done))
                    tb = time.perf_counter()
                    if n == 0:
                        raise ValueError(f"xor-dense frame of {name} ends early")
                    part = words[done : done + n]
                    np.bitwise_xor(part, self.chunk[:n], out=part)
                    done += n
                    decode, apply = decode + tb - ta, apply + time.perf_counter() - tb
            at += length
        t2 = time.perf_counter()
        return SyncTimes(
            fetch_s=t1 - t0,
            decode_s=decode,
            verify_s=0.0,
            apply_s=apply,
            pause_s=t2 - t1,
            total_s=t2 - t0,
        )
