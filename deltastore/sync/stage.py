"""One frame of a version applied against local tensors: staged (read only), then written.

:func:`check_frames` bounds every frame of a manifest before anything is fetched;
:func:`stage_frame` decodes one fetched frame into the changes it makes to a local tensor
(positions, old and new words) and checks the result's Adler-32; nothing is written here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deltastore.errors import FrameError, IntegrityError, ManifestError
from deltastore.format.checksum import adler32, apply_delta, delta_sums, shift_to_outer
from deltastore.format.codecs import RAW, XOR_SPARSE, FrameDecoder, compress_bound, sparse_bound
from deltastore.format.dtypes import itemsize, word_dtype
from deltastore.format.manifest import Frame, Manifest, TensorEntry
from deltastore.tensors.words import compact, gather, gather_range


@dataclass
class Staged:
    """Changes of one frame: frame-relative positions (as compact gaps), old and new words,
    Adler-32 sums."""

    name: str
    start: int
    positions: np.ndarray
    old: np.ndarray
    new: np.ndarray
    da: int
    db: int
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
            content = sparse_bound(f.stop - f.start, size) if f.codec == XOR_SPARSE else nbytes
            if f.length > compress_bound(content):
                raise FrameError(
                    f"version {m.version}: a frame of {name} claims {f.length} stored bytes, "
                    f"more than zstd can produce from {content} bytes; the manifest is damaged"
                )


def stage_frame(
    local: torch.Tensor,
    name: str,
    entry: TensorEntry,
    f: Frame,
    data: bytes,
    dec: FrameDecoder,
    delta: bool,
) -> Staged:
    """Turn one fetched frame into changes against ``local`` (the tensor's flat words; reads
    only): positions, old and new words, checked against the frame's Adler-32."""
    size = itemsize(entry.dtype)
    n = f.stop - f.start
    wdt = word_dtype(size)
    if f.codec == XOR_SPARSE:
        pos, masks = dec.sparse(data, n, size, f.changed)
        old = gather(local, pos + f.start, wdt)
        new = old ^ masks
        if f.parent_adler32 is None:
            raise ManifestError(f"{name}: xor-sparse frame without parent_adler32")
        sums = delta_sums(pos, old, new, n * size)
        frame_adler = apply_delta(f.parent_adler32, *sums)
    else:
        parts_pos, parts_old, parts_new = [], [], []
        frame_adler = 1
        for first, words in dec.chunks(data, n, size):
            cur = gather_range(local, f.start + first, words.size, wdt)
            if f.codec == RAW:
                new_chunk, mask = words, words ^ cur
            else:
                new_chunk, mask = words ^ cur, words
            frame_adler = adler32(new_chunk, frame_adler)
            idx = dec.nonzero(mask)
            parts_pos.append(idx + first)
            parts_old.append(cur[idx])
            parts_new.append(new_chunk[idx])
        pos, old, new = (np.concatenate(p) for p in (parts_pos, parts_old, parts_new))
        sums = delta_sums(pos, old, new, n * size)
        if delta and pos.size != f.changed:  # an anchor may land on any older state
            raise FrameError(
                f"{name}[{f.start}:{f.stop}]: frame changes {pos.size} elements, "
                f"the manifest says {f.changed}"
            )
    if frame_adler != f.adler32:
        raise IntegrityError(
            f"{name}[{f.start}:{f.stop}]: decoded frame has Adler-32 {frame_adler:08x}, "
            f"the manifest says {f.adler32:08x}; the tensors are not at the frame's parent "
            "or the frame is damaged"
        )
    da, db = shift_to_outer(*sums, n * size, f.start * size, entry.nbytes)
    return Staged(name, f.start, compact(pos), old, new, da, db, frame_adler)


__all__ = ["Staged", "check_frames", "stage_frame"]
