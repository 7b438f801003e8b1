"""The local path's staging of one frame: its changes to a local tensor, checked, nothing written.

:func:`check_frames` bounds every frame of a manifest before anything is fetched;
:func:`stage_frame` turns one fetched frame into the update it makes to a local tensor (with the
steps of :mod:`deltastore.sync.apply`) and checks the frame's Adler-32 and changed count. The
layout path stages received segments instead (:mod:`deltastore.sync.ranks`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltastore.errors import FrameError, IntegrityError, ManifestError
from deltastore.format.checksum import adler32
from deltastore.format.codecs import Changes, FrameDecoder, codec_spec, stored_bound
from deltastore.format.codecs.v2 import XOR_SPARSE2
from deltastore.format.codecs.zstdframe import MAX_WINDOW_SIZE
from deltastore.format.dtypes import itemsize, word_dtype
from deltastore.format.manifest import Manifest
from deltastore.sync.apply import Sums, Update, contribution, stage_at, stage_run
from deltastore.sync.fetch import FrameTask, check_blake3, check_xxh3, corrupted
from deltastore.tensors.host import Words
from deltastore.tensors.words import host_view, narrow


@dataclass(frozen=True)
class Staged:
    """One frame staged against its local tensor: the ``update`` (flat positions in the tensor,
    :func:`~deltastore.tensors.words.narrow`), its Adler-32 contribution ``sums`` to the whole
    tensor, and ``frame_adler``, the Adler-32 of the frame's new bytes
    (checked against the manifest already)."""

    update: Update
    sums: Sums
    frame_adler: int


def check_frames(m: Manifest, max_frame_bytes: int) -> None:
    """Raise :class:`FrameError` for a frame over ``max_frame_bytes`` or whose stored length
    exceeds what zstd can produce from its content (before anything is fetched)."""
    for name, entry in m.tensors.items():
        size = itemsize(entry.dtype)
        for f in entry.frames:
            nbytes = (f.stop - f.start) * size
            if nbytes > max_frame_bytes:
                raise FrameError(
                    f"version {m.version}: a frame of {name} covers {nbytes} bytes, "
                    f"over max_frame_bytes={max_frame_bytes}"
                )
            bound = stored_bound(f.codec, f.stop - f.start, size, f.changed)
            if f.length > bound:
                raise FrameError(
                    f"version {m.version}: a frame of {name} claims {f.length} stored bytes, "
                    f"more than the {bound} zstd can produce from its largest content; the "
                    "manifest is damaged"
                )


def stage_frame(
    local: Words,
    task: FrameTask,
    data: bytes,
    dec: FrameDecoder,
    delta: bool,
    *,
    native: bool = True,
) -> Staged:
    """Turn one fetched frame (``data``, its stored bytes) into its update of ``local`` (the
    tensor's flat words; reads only), checked against the frame's Adler-32: for sparse changes
    ``parent_adler32`` updated with them (O(changed)), for dense runs the new bytes themselves.
    Sparse changes are XOR masks, or absolute new words (``xor-patch``); an absolute word equal
    to the old one is left out of the update (the element does not change).
    In a ``delta``, the number of elements a dense frame changes must be its ``changed`` (an
    anchor may land on any older state). Thread-safe for distinct decoders.

    One pass per step over a sparse frame's changes: the decoder's int64 positions are moved to
    the tensor in place, the old words gathered with them, the new ones XORed into the decoded
    masks, the Adler-32 contribution computed at the tensor (the frame's follows from it), and
    the positions kept :func:`~deltastore.tensors.words.narrow` for the write.

    ``native`` (default): an ``xor-sparse2`` frame into host words is decoded, gathered and
    summed in one pass by :func:`deltastore.kernels.apply.stage_sparse2` (GIL released),
    staged as its positions and masks only (an XOR write, :class:`Update` ``xor``); False:
    the numpy path above, the reference the kernel is tested against."""
    name, entry, f = task.name, task.entry, task.frame
    size = itemsize(entry.dtype)
    n = f.stop - f.start
    host = host_view(local) if native and codec_spec(f.codec).native else None
    if host is not None:
        return _stage_sparse2(host, task, data, dec)
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    frame_adler: int | None = 1  # None: from parent_adler32 and the sums (sparse changes)
    sparse = 0  # sparse parts: xor-patch has two (XOR, then absolute entries), each ascending
    for ch in dec.changes(f.codec, data, n, size, f.changed):
        if ch.positions is not None:  # XOR masks: every position changes
            at = ch.positions
            if at.dtype != np.int64 or not at.flags.owndata or not at.flags.writeable:
                at = at.astype(np.int64)  # ours to move: never the decoder's buffer
            if f.start:
                at += f.start
            old, new = stage_at(local, at, ch.words, xor=ch.xor)
            if not ch.xor:  # absolute new words: one equal to the old word changes nothing
                keep = np.flatnonzero(old != new)
                if keep.size < at.size:
                    at, old, new = at[keep], old[keep], new[keep]
            parts.append((at, old, new))
            frame_adler = None
            sparse += 1
            continue
        old, new = stage_run(local, f.start + ch.first, ch.words, xor=ch.xor)
        if frame_adler is not None:
            frame_adler = adler32(new, frame_adler)
        idx = dec.nonzero(ch.words if ch.xor else ch.words ^ old)
        parts.append((idx + (f.start + ch.first), old[idx], new[idx]))
    if len(parts) == 1:
        pos, old, new = parts[0]
    else:
        pos, old, new = (np.concatenate(p) for p in zip(*parts, strict=True))
        if sparse > 1:  # merge the parts' positions into one ascending list
            order = np.argsort(pos, kind="stable")
            pos, old, new = pos[order], old[order], new[order]
    sums = contribution(pos, old, new, entry.nbytes)  # of the tensor
    if frame_adler is None:
        return Staged(Update(name, 0, narrow(pos, f.stop), old, new), sums, _checked(task, sums))
    if delta and pos.size != f.changed:  # an anchor may land on any older state
        raise FrameError(
            f"{name}[{f.start}:{f.stop}]: frame changes {pos.size} elements, "
            f"the manifest says {f.changed}"
        )
    if frame_adler != f.adler32:
        raise _mismatch(task, frame_adler)
    update = Update(name, 0, narrow(pos, f.stop), old, new)
    return Staged(update, sums, frame_adler)


_local = threading.local()


def stage_batch(
    locals_: Sequence[Words],
    tasks: Sequence[FrameTask],
    buf: bytes,
    offsets: Sequence[int],
    dec: FrameDecoder,
    delta: bool,
) -> list[Staged]:
    """:func:`stage_frame` of consecutive ``tasks`` (into ``locals_[i]``, their tensors'
    words) whose stored bytes lie in ``buf`` at ``offsets`` (length checked, XXH3 not yet),
    the same results and errors. Runs of ``xor-sparse2`` frames into host words of one word
    size are checked, decompressed, decoded and staged in one native call each
    (:func:`deltastore.kernels.batch.stage_batch`, GIL released once per run); other frames
    go through :func:`stage_frame` after their XXH3 check, as do all where zstd's and
    xxhash's C functions are not reachable (:func:`deltastore.kernels.clib.functions`)."""
    from deltastore.kernels import clib  # numba-free: ctypes only

    fns = clib.functions()
    out: list[Staged | None] = [None] * len(tasks)
    run: list[int] = []

    def flush() -> None:
        if run:
            for i, staged in zip(
                run,
                _native_run(
                    fns,
                    [locals_[i] for i in run],
                    [tasks[i] for i in run],
                    buf,
                    [offsets[i] for i in run],
                    dec,
                ),
                strict=True,
            ):
                out[i] = staged
            run.clear()

    for i, task in enumerate(tasks):
        host = host_view(locals_[i]) if fns is not None else None
        native = host is not None and codec_spec(task.frame.codec).native
        if run and (not native or _size(tasks[run[0]]) != _size(task)):
            flush()
        if native:
            run.append(i)
            continue
        f = task.frame
        data = memoryview(buf)[offsets[i] : offsets[i] + f.length]
        check_xxh3(f, data)
        out[i] = stage_frame(locals_[i], task, bytes(data), dec, delta)
    flush()
    return [st for st in out if st is not None]


def _size(task: FrameTask) -> int:
    return itemsize(task.entry.dtype)


def _native_run(
    fns: Any,
    locals_: Sequence[Words],
    tasks: Sequence[FrameTask],
    buf: bytes,
    offsets: Sequence[int],
    dec: FrameDecoder,
) -> list[Staged]:
    """One native call for ``tasks`` (``xor-sparse2`` frames into host words of one size)."""
    from deltastore.kernels import apply as kernel
    from deltastore.kernels import batch
    from deltastore.kernels.clib import DCtx

    dctx: DCtx | None = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = DCtx(fns, MAX_WINDOW_SIZE.bit_length() - 1)
    view = memoryview(buf)
    frames = []
    for local, task, at in zip(locals_, tasks, offsets, strict=True):
        f, size = task.frame, _size(task)
        data = view[at : at + f.length]
        check_blake3(f, data)  # a signed frame's bytes, before the kernel reads them
        try:
            content = dec.sparse2_precheck(data, f.stop - f.start, size, f.changed)
        except FrameError:
            check_xxh3(f, data)  # damaged bytes: say so, as the frame-by-frame path does
            raise
        words = host_view(local)
        assert words is not None
        frames.append(
            batch.BatchFrame(
                at, f.length, int(f.xxh3, 16), content, f.stop - f.start, f.start, f.changed,
                words.view(word_dtype(size)),
            )
        )  # fmt: skip
    res = batch.stage_batch(buf, frames, fns, dctx)
    if res.status != kernel.OK:
        task = tasks[res.failed]
        raise _problem(task, res.status)
    out = []
    for i, task in enumerate(tasks):
        name = task.name
        sums = Sums(*kernel.reduce_sums(res.sums[i], _size(task), task.entry.nbytes))
        frame_adler = _checked(task, sums)
        a, b = int(res.offsets[i]), int(res.offsets[i + 1])
        masks = res.masks[a:b]
        out.append(Staged(Update(name, 0, res.positions[a:b], masks, masks, xor=True), sums,
                          frame_adler))  # fmt: skip
    return out


def _problem(task: FrameTask, status: int) -> Exception:
    """The error of a frame the batch kernel stopped at (``status``)."""
    from deltastore.kernels import apply as kernel
    from deltastore.kernels import batch

    f = task.frame
    where = f"{task.name}[{f.start}:{f.stop}]: {XOR_SPARSE2}"
    if status == batch.XXH_MISMATCH:
        return corrupted(f)
    if status == batch.NOT_DECOMPRESSED:
        return FrameError(f"{where} frame does not decompress to its declared content")
    if status == batch.HEADER_INVALID:
        return FrameError(f"{where} header is invalid")
    if status == batch.COUNT_MISMATCH:
        return FrameError(
            f"{where} frame's header does not hold the {f.changed} changes its manifest entry "
            "declares in its content"
        )
    return FrameError(f"{where} {kernel.PROBLEMS[status]}")


def _checked(task: FrameTask, sums: Sums) -> int:
    """The Adler-32 of a frame of sparse changes, from its ``parent_adler32`` and their
    contribution ``sums`` to the tensor; :class:`ManifestError` without a parent checksum,
    :class:`IntegrityError` unless it is the manifest's."""
    entry, f = task.entry, task.frame
    if f.parent_adler32 is None:
        raise ManifestError(f"{task.name}: {f.codec} frame without parent_adler32")
    size = itemsize(entry.dtype)
    frame = sums.within((f.stop - f.start) * size, f.start * size, entry.nbytes)
    frame_adler = frame.applied_to(f.parent_adler32)
    if frame_adler != f.adler32:
        raise _mismatch(task, frame_adler)
    return frame_adler


def _mismatch(task: FrameTask, frame_adler: int) -> IntegrityError:
    f = task.frame
    return IntegrityError(
        f"{task.name}[{f.start}:{f.stop}]: decoded frame has Adler-32 {frame_adler:08x}, "
        f"the manifest says {f.adler32:08x}; the tensors are not at the frame's parent "
        "or the frame is damaged"
    )


def frame_changes(
    dec: FrameDecoder, codec: str, data: bytes, n: int, size: int, changed: int
) -> Iterable[Changes]:
    """What :meth:`FrameDecoder.changes` returns for a stored frame, the same arrays, with an
    ``xor-sparse2`` frame decoded by the native kernel
    (:func:`deltastore.kernels.apply.decode_sparse2`, GIL released): for receivers that
    route changes before staging them (:mod:`deltastore.sync.ranks`)."""
    if not codec_spec(codec).native:
        return dec.changes(codec, data, n, size, changed)
    from deltastore.kernels import apply as kernel  # numba: loaded on the first sparse frame

    raw, k, e, low_bits = dec.sparse2_content(data, n, size, changed)
    status, positions, masks = kernel.decode_sparse2(raw, k, e, low_bits, n, size)
    if status != kernel.OK:
        raise FrameError(f"{XOR_SPARSE2} {kernel.PROBLEMS[status]}")
    return (Changes(masks, True, 0, positions),)


def _stage_sparse2(host: np.ndarray, task: FrameTask, data: bytes, dec: FrameDecoder) -> Staged:
    """:func:`stage_frame` of an ``xor-sparse2`` frame into host words, by the native kernel:
    the update is the frame's tensor positions and XOR masks, written by an in-place XOR."""
    from deltastore.kernels import apply as kernel  # numba: loaded on the first sparse frame

    name, entry, f = task.name, task.entry, task.frame
    size = itemsize(entry.dtype)
    n = f.stop - f.start
    raw, k, e, low_bits = dec.sparse2_content(data, n, size, f.changed)
    words = host.view(word_dtype(size))
    status, pos, masks, (da, db) = kernel.stage_sparse2(
        raw, k, e, low_bits, n, words, f.start, entry.nbytes
    )
    del raw
    if status != kernel.OK:
        raise FrameError(f"{name}[{f.start}:{f.stop}]: {XOR_SPARSE2} {kernel.PROBLEMS[status]}")
    sums = Sums(da, db)
    return Staged(Update(name, 0, pos, masks, masks, xor=True), sums, _checked(task, sums))


__all__ = ["Staged", "check_frames", "frame_changes", "stage_batch", "stage_frame"]
