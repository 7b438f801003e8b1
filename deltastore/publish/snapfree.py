"""One frame of a snapshot-free tensor: reconstruct, verify against block digests, encode.

A snapshot-free publisher holds no words of an AdamW-updated parameter, only the block
digests of what it published (:mod:`deltastore.publish.digests`). Per frame of such a tensor
(elements ``[a, b)`` of the flat parameter, a :class:`ReconJob`), chunk by chunk
(:data:`~deltastore.publish.reconstruct.DEFAULT_CHUNK` elements, a multiple of
:data:`~deltastore.publish.digests.BLOCK`), :func:`encode_frame`:

1. casts the chunk of the fp32 parameter to its new bf16 words (round to nearest even, as
   torch; with their Adler-32 in the same compiled pass where numba is there) and hashes
   their blocks (the digests of the new version, adopted after the commit);
2. by ``mode``: ``"new"`` (no parent: the frame's new words, an anchor); ``"absolute"``
   (every element as an absolute entry: the old words are unknown); ``"verify"`` (no step
   moved the parameter: blocks whose new words match the digests are unchanged, the others
   go out as absolute entries); ``"delta"`` (the previous words reconstructed by
   :meth:`Inversion.chunk`, each block checked against its digest, uncertain words resolved
   by :func:`~deltastore.publish.digests.resolve_block`);
3. emits the changed elements of verified blocks as XOR masks (the digest proves every word
   of such a block, the uncertain ones it resolved included) and every element of a block
   that does not verify as an absolute new word, in one ``xor-patch`` frame; a frame with
   XOR entries only is encoded as the smallest of the usual delta codecs (its old words are
   all proven).

Memory: per thread, one :class:`Scratch` of chunk buffers (6 bytes per element, reused from
chunk to chunk and publish to publish through the writer's :class:`ScratchPool`), the
float64 temporaries of the few elements the compiled kernel cannot prove on its float32
path, the frame's entries (O(changed)), and the
frame's words only where they are encoded whole (an anchor, an absolute frame, an anchor
copy, or a frame without uncertain elements). Pure per job; run jobs on any threads, one
:class:`~deltastore.format.codecs.FrameEncoder` per thread, before the next optimizer step.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import xxhash

from deltastore.format.checksum import adler32
from deltastore.format.codecs import RAW, XOR_PATCH, Codec, FrameEncoder
from deltastore.publish.digests import (
    BLOCK,
    CHUNK_TRIES,
    MAX_TRIES,
    block_count,
    candidate_lists,
    digest_blocks,
    resolve_block,
)
from deltastore.publish.encode import FullFrame
from deltastore.publish.reconstruct import DEFAULT_CHUNK, Inversion, bf16_words

if TYPE_CHECKING:
    import torch

#: The bf16 word torch's cast gives a NaN on some paths (its vectorized CPU cast gives 0xFFFF),
#: replaced by the canonical one of :func:`~deltastore.publish.reconstruct.bf16_words`.
CANONICAL_NAN = 0x7FC0

Mode = Literal["new", "delta", "verify", "absolute"]


@dataclass(frozen=True)
class SnapshotFreeStats:
    """What a snapshot-free publish did (:attr:`PublishReport.snapshot_free`).

    ``reconstructed``: tensors whose previous words came from the optimizer (verified, or
    verified unchanged); ``snapshots``: name -> reason, tensors held as a snapshot (not AdamW
    parameters, gated for good); ``absolute``: name -> reason, tensors sent whole as absolute
    words this version (a gate; their old words were unknown); ``blocks_verified``: blocks
    whose reconstructed (or unchanged) words matched their digest; ``blocks_raw``: blocks that
    did not, sent whole as absolute words; ``uncertain``: elements of verified blocks whose
    bound straddles a bf16 rounding tie (their words resolved by the digest, then sent as
    any other: an XOR mask where they changed); ``anchor_reason``: why
    the version became an anchor (None: it did not, or it is an ordinary anchor)."""

    reconstructed: int = 0
    snapshots: dict[str, str] = field(default_factory=dict)
    absolute: dict[str, str] = field(default_factory=dict)
    blocks_verified: int = 0
    blocks_raw: int = 0
    uncertain: int = 0
    anchor_reason: str | None = None


@dataclass(frozen=True)
class ReconJob:
    """One frame of a snapshot-free tensor: elements ``[a, b)`` of ``flat`` (the fp32
    parameter, 1-D, detached; any device), encoded as ``mode`` (module docstring).
    ``inversion``: the reconstruction (``"delta"``); ``held``: the frame's block digests at
    the parent (``"delta"``, ``"verify"``); ``full``: also encode the new words (an anchor
    copy); ``chunk``: elements per step (a multiple of :data:`BLOCK`); ``scratch``: the
    writer's chunk buffers (None: fresh ones for this job)."""

    flat: torch.Tensor
    a: int
    b: int
    mode: Mode
    inversion: Inversion | None = None
    held: np.ndarray | None = None
    full: bool = False
    chunk: int = DEFAULT_CHUNK
    scratch: ScratchPool | None = None


@dataclass
class ReconFrame:
    """What :func:`encode_frame` produced: the frame (``data`` None: nothing changed), its
    new Adler-32 and block digests, the anchor-copy frame, and counters: blocks verified
    against a digest, blocks sent whole (``raw_at``: their frame-local starts), uncertain
    elements of verified blocks (their words resolved by the digest)."""

    changed: int
    adler: int
    codec: Codec
    data: bytes | None
    xxh3: str
    digests: np.ndarray
    full: FullFrame | None = None
    verified: int = 0
    raw: int = 0
    uncertain: int = 0
    raw_at: list[int] = field(default_factory=list)
    encode_s: float = 0.0


def _probe() -> np.ndarray:
    """fp32 values where a cast may go wrong: zeros, infinities, NaNs, subnormals, the
    largest finite values, exact ties (odd and even), values just off a tie."""
    bits = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001]
    bits += [1, 0x8000, 0x8001, 0x18000, 0x807FFFFF, 0x7FFFFF, 0x7F7FFFFF, 0xFF7F8000]
    bits += [0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F818001, 0x00FF8000, 0x80018000]
    more = np.arange(0, 1 << 32, 65_521, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([np.asarray(bits, dtype=np.uint32), more, more | 0x8000]).view(np.float32)


_torch_exact: list[bool] = []


def torch_cast_exact() -> bool:
    """Whether this process's torch casts fp32 to the words of ``bf16_words`` (after
    :data:`CANONICAL_NAN` replaces NaN words): checked once, on :func:`_probe`'s values
    (e.g. a CPU whose bf16 instruction flushes subnormals fails it: the numpy cast is used)."""
    if not _torch_exact:
        import torch

        x = _probe()
        buf = torch.empty(x.size, dtype=torch.bfloat16)
        got = cast_words(torch.from_numpy(x), buf)
        _torch_exact.append(bool(np.array_equal(got, bf16_words(x))))
    return _torch_exact[0]


def cast_words(src: torch.Tensor, buf: torch.Tensor) -> np.ndarray:
    """bf16 words (``<u2``, a view of ``buf``'s first elements) of ``src`` (1-D float32, any
    device), cast by torch into ``buf`` (a CPU bfloat16 tensor at least as long: no
    allocation), NaN words replaced by :data:`CANONICAL_NAN`."""
    import torch

    out = buf[: src.numel()]
    out.copy_(src)
    words: np.ndarray = out.view(torch.int16).numpy().view("<u2")
    # the NaN words: magnitude above the infinity's (one compare, rarely any)
    if int(words.max(initial=0)) > 0x7F80 and bool(np.any((words & 0x7FFF) > 0x7F80)):
        words[(words & 0x7FFF) > 0x7F80] = CANONICAL_NAN
    return words


def new_words(flat: torch.Tensor, a: int, b: int, buf: torch.Tensor | None = None) -> np.ndarray:
    """bf16 words (``<u2``) of elements ``[a, b)`` of a flat fp32 tensor, as
    :func:`~deltastore.publish.reconstruct.bf16_words` gives them. With ``buf`` (a CPU
    bfloat16 tensor of at least ``b - a`` elements) torch casts into it and the words are a
    view of it (when :func:`torch_cast_exact`); otherwise a new array."""
    src = flat[a:b].detach()
    if buf is not None and src.device.type == "cpu":
        cast = _kernel_cast()
        if cast is not None:  # one compiled pass on this thread
            return cast(src.numpy(), buf.view(torch_int16()).numpy().view("<u2"))
    if buf is not None and torch_cast_exact():
        return cast_words(src, buf)
    return bf16_words(src.cpu().numpy())


def new_words_adler(
    flat: torch.Tensor, a: int, b: int, buf: torch.Tensor, value: int
) -> tuple[np.ndarray, int]:
    """:func:`new_words` into ``buf`` and the Adler-32 of their bytes continuing from
    ``value``: one compiled pass over a CPU range when numba is there
    (:func:`deltastore.publish.invert_kernel.cast_adler`), else the cast then zlib."""
    src = flat[a:b].detach()
    if src.device.type == "cpu" and _kernel_cast() is not None:
        from deltastore.publish.invert_kernel import cast_adler

        out = buf.view(torch_int16()).numpy().view("<u2")
        value = cast_adler(src.numpy(), out, value)
        return out[: b - a], value
    words = new_words(flat, a, b, buf)
    return words, adler32(words, value)


_cast_fn: list[Callable[[np.ndarray, np.ndarray], np.ndarray] | None] = []


def _kernel_cast() -> Callable[[np.ndarray, np.ndarray], np.ndarray] | None:
    """The compiled cast (:func:`deltastore.publish.invert_kernel.bf16_cast`), None without
    numba; imported on first use."""
    if not _cast_fn:
        try:
            from deltastore.publish.invert_kernel import bf16_cast
        except ImportError:
            _cast_fn.append(None)
        else:
            _cast_fn.append(bf16_cast)
    return _cast_fn[0]


def torch_int16() -> torch.dtype:
    import torch

    return torch.int16


class Scratch:
    """One thread's chunk buffers (``size`` elements): the new words (a bfloat16 tensor and
    its ``<u2`` view), the old words, the certain mask, a bool scratch. 6 bytes per element."""

    def __init__(self, size: int) -> None:
        import torch

        self.size = size
        self.cast = torch.empty(size, dtype=torch.bfloat16)
        self.old = np.empty(size, dtype="<u2")
        self.certain = np.empty(size, dtype=np.bool_)
        self.flags = np.empty(size, dtype=np.bool_)


class ScratchPool:
    """Chunk buffers reused from chunk to chunk, frame to frame and publish to publish: a job
    takes a :class:`Scratch` and gives it back when its frame is encoded, so the worker
    threads stop allocating (and the allocator's per-thread arenas stop growing with) fresh
    chunk-sized arrays. Holds at most as many as jobs ran at once (the writer's threads).
    Thread-safe."""

    def __init__(self) -> None:
        self._free: list[Scratch] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> Scratch:
        """A scratch of at least ``size`` elements (a smaller free one is dropped)."""
        with self._lock:
            got = self._free.pop() if self._free else None
        if got is None or got.size < size:
            got = Scratch(max(size, got.size if got is not None else 0))
        return got

    def give(self, scratch: Scratch) -> None:
        with self._lock:
            self._free.append(scratch)

    def clear(self) -> None:
        """Drop the free buffers."""
        with self._lock:
            self._free = []


def check_blocks(
    old: np.ndarray, certain: np.ndarray, held: np.ndarray, inversion: Inversion, first: int
) -> np.ndarray:
    """Per block of the chunk ``old`` (reconstructed words; ``certain`` mask; element
    ``first`` of the parameter at its start), whether it does *not* match its digest in
    ``held`` even with its uncertain words resolved (True: send the block whole). At most
    :data:`CHUNK_TRIES` candidate combinations in all: past them a block that misses is sent
    whole without trying."""
    bad = np.zeros(held.size, dtype=np.bool_)
    missed = np.flatnonzero(digest_blocks(old) != held).tolist()
    if not missed:
        return bad
    # the uncertain words of every missed block, their candidates in one call
    uncs = [np.flatnonzero(~certain[j * BLOCK : (j + 1) * BLOCK]) for j in missed]
    at = np.concatenate([u + j * BLOCK for u, j in zip(uncs, missed, strict=True)])
    lo_all, hi_all, zero_all = inversion.candidates(at + first)
    ends = np.cumsum([0] + [u.size for u in uncs]).tolist()
    budget = CHUNK_TRIES
    for k, j in enumerate(missed):
        s = j * BLOCK
        blk = old[s : s + BLOCK]
        unc = uncs[k]
        if unc.size == 0 or budget <= 0:
            bad[j] = True
            continue
        part = slice(ends[k], ends[k + 1])
        cands = candidate_lists(blk[unc], lo_all[part], hi_all[part], zero_all[part])
        tries = min(MAX_TRIES, budget, math.prod(len(c) for c in cands))
        bad[j] = not resolve_block(blk, unc, cands, int(held[j]), tries)
        budget -= tries if bad[j] else 1
    return bad


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """The parts end to end (the part itself when there is one: no copy)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def encode_frame(job: ReconJob, enc: FrameEncoder) -> ReconFrame:
    """Encode one frame of a snapshot-free tensor (module docstring). Thread-safe per job
    (``enc`` is the calling thread's own)."""
    pool = job.scratch if job.scratch is not None else ScratchPool()
    scratch = pool.take(min(job.chunk, job.b - job.a))
    try:
        return _encode_frame(job, enc, scratch)
    finally:
        pool.give(scratch)


def _encode_frame(job: ReconJob, enc: FrameEncoder, sc: Scratch) -> ReconFrame:
    t0 = time.perf_counter()
    n = job.b - job.a
    mode = job.mode
    digests = np.empty(block_count(n), dtype=np.uint64)
    keep_new = mode in ("new", "absolute") or job.full
    whole = mode == "delta"  # every old word proven so far: the usual codecs apply
    # a frame of several chunks keeps copies of the parts it encodes whole (the buffers are
    # reused by the next chunk); a frame of one chunk encodes from the buffers themselves
    several = n > job.chunk
    new_parts: list[np.ndarray] = []
    old_parts: list[np.ndarray] = []
    pos_parts: list[np.ndarray] = []
    word_parts: list[np.ndarray] = []
    flag_parts: list[np.ndarray] = []
    out = ReconFrame(0, 1, RAW, None, "", digests)
    adler = 1
    for c in range(job.a, job.b, job.chunk):
        e = min(c + job.chunk, job.b)
        local = c - job.a
        new, adler = new_words_adler(job.flat, c, e, sc.cast, adler)
        k0 = local // BLOCK
        nd = digest_blocks(new)
        digests[k0 : k0 + nd.size] = nd
        if keep_new or whole:
            new_parts.append(new.copy() if several else new)
        if mode == "new":
            continue
        if mode == "absolute":
            pos_parts.append(np.arange(local, local + e - c, dtype=np.int64))
            word_parts.append(new.copy())
            flag_parts.append(np.ones(e - c, dtype=np.bool_))
            continue
        assert job.held is not None
        held = job.held[k0 : k0 + nd.size]
        old: np.ndarray | None = None
        if mode == "verify":
            bad = nd != held
        else:
            assert job.inversion is not None
            rec = job.inversion.chunk(c, e, out=(sc.old, sc.certain))
            old, certain = rec.words, rec.certain
            bad = check_blocks(old, certain, held, job.inversion, c)
            # uncertain words of verified blocks were resolved by the digest: proven too
            if bad.any():
                out.uncertain += int(np.count_nonzero(~certain & ~np.repeat(bad, BLOCK)[: e - c]))
            else:
                out.uncertain += (e - c) - int(np.count_nonzero(certain))
        out.verified += int(np.count_nonzero(~bad))
        out.raw += int(np.count_nonzero(bad))
        out.raw_at.extend((local + int(j) * BLOCK) for j in np.flatnonzero(bad))
        if old is not None and not bad.any():  # every old word proven: XOR masks only
            p = np.flatnonzero(np.not_equal(old, new, out=sc.flags[: e - c]))
            words = old[p]
            words ^= new[p]
            flags = np.zeros(p.size, dtype=np.bool_)
        else:
            absolute = np.repeat(bad, BLOCK)[: e - c]
            send = absolute if old is None else (old != new) | absolute
            p = np.flatnonzero(send)
            flags = absolute[p]
            # XOR masks where proven, the new words where absolute
            words = new[p] if old is None else np.where(flags, new[p], old[p] ^ new[p])
        if p.size:
            p += local
            pos_parts.append(p)
            word_parts.append(words)
            flag_parts.append(flags)
        if whole and bool(flags.any()):
            whole = False
            old_parts = []
            if not keep_new:
                new_parts = []
        elif whole and old is not None:
            old_parts.append(old.copy() if several else old)
    out.adler = adler
    if mode == "new":
        out.codec, out.data = enc.new_words(_joined(new_parts))
        out.changed = n
    elif pos_parts:
        pos, words = _joined(pos_parts), _joined(word_parts)
        del pos_parts[:], word_parts[:]
        if whole:
            out.codec, out.data = enc.encode_delta(
                _joined(old_parts), _joined(new_parts), pos, masks=words
            )
        else:
            out.codec, out.data = XOR_PATCH, enc.xor_patch(pos, words, _joined(flag_parts))
        out.changed = int(pos.size)
    if out.data is not None:
        out.xxh3 = xxhash.xxh3_64_hexdigest(out.data)
    if job.full:
        if mode == "new" and out.data is not None:
            out.full = FullFrame(out.codec, out.data, out.xxh3)
        else:
            codec, data = enc.new_words(_joined(new_parts))
            out.full = FullFrame(codec, data, xxhash.xxh3_64_hexdigest(data))
    out.encode_s = time.perf_counter() - t0
    return out


__all__ = [
    "Mode",
    "ReconFrame",
    "ReconJob",
    "Scratch",
    "ScratchPool",
    "SnapshotFreeStats",
    "cast_words",
    "check_blocks",
    "encode_frame",
    "new_words",
    "new_words_adler",
    "torch_cast_exact",
]
