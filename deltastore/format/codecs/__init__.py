"""Frame codecs of format v1: ``raw``, ``xor-dense``, ``xor-sparse`` (deltastore 0.1.0),
``xor-sparse2``, ``raw-planes`` (from deltastore 0.2.0, in :mod:`deltastore.format.codecs.v2`)
and ``xor-patch`` (from deltastore 0.3.0, in :mod:`deltastore.format.codecs.patch`).

A frame covers elements ``[start, stop)`` of one tensor; ``n = stop - start`` elements of
``s`` bytes each (the dtype's size), handled as little-endian unsigned words. Every stored frame
is exactly one zstd frame whose header carries the content size. Decompressed contents:

``raw``
    the ``n * s`` new bytes.
``xor-dense``
    the ``n * s`` bytes of ``old XOR new``.
``xor-sparse``
    an 8-byte header ``<u32 k><u8 g><3 zero bytes>`` (``k`` changed elements, gap width ``g`` in
    {1, 2, 4} bytes), then ``g`` byte planes of ``k`` bytes holding the gaps, then ``s`` byte
    planes of ``k`` bytes holding the XOR masks (plane ``j`` = byte ``j``, least significant
    first, of every value). Gap ``i`` is the number of unchanged elements before changed
    element ``i`` since the previous changed one: ``pos[0] = gap[0]``,
    ``pos[i] = pos[i-1] + 1 + gap[i]``. Masks are never zero.
``xor-sparse2``
    the changes as ``xor-sparse``, with each gap split into a one-byte token and packed low
    bits (spec section 8.2.4).
``raw-planes``
    the ``n * s`` new bytes as ``s`` byte planes of ``n`` bytes (spec section 8.2.5).
``xor-patch``
    (from deltastore 0.3.0, in :mod:`deltastore.format.codecs.patch`) entries coded as
    ``xor-sparse2``'s changes plus one flag per entry: the word is an XOR mask (never zero)
    or the element's absolute new word (spec section 8.2.6). Written only on request
    (:meth:`FrameEncoder.xor_patch`, by the snapshot-free publisher), never picked by
    :meth:`FrameEncoder.encode_delta`.

Decoders never allocate more than the frame's declared size: the zstd content size is checked
against the bound the manifest implies before anything is decompressed.

Every codec is one row of :data:`CODEC_TABLE` (:class:`CodecSpec`: the codec set that first
writes it, whether its frames carry the new words or XOR masks that need the parent's words,
its content bounds, its decoder); nothing else branches on a codec name. Receivers take a
frame's changes from :meth:`FrameDecoder.changes` (or new words from
:meth:`FrameDecoder.decode_into`) and bound stored frames with :func:`stored_bound` (the one
bound of a stored length, spec section 8.3); writers pick a frame's codec with
:meth:`FrameEncoder.encode_delta` and :meth:`FrameEncoder.new_words`, among the codecs of the
:data:`CodecSet` they write (``"v1"``: what deltastore 0.1.0 reads; ``"v2"``: also the 0.2.0
codecs). The largest frame a writer cuts and a reader accepts by default is
:data:`MAX_FRAME_BYTES`.

Thread-safety: :class:`FrameEncoder` and :class:`FrameDecoder` hold zstd contexts and reusable
buffers; use one instance per thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

import numpy as np
import zstandard

from deltastore.errors import FrameError
from deltastore.format.codecs.patch import (
    XOR_PATCH,
    decode_patch,
    encode_patch,
    patch_bound,
    patch_bounds,
)
from deltastore.format.codecs.sparse import (
    SPARSE_HEADER,
    decode_sparse,
    sparse_bound,
    sparse_content,
)
from deltastore.format.codecs.v2 import (
    ESCAPE,
    RAW_PLANES,
    SPARSE2_HEADER,
    V1_MAX_CHANGES,
    XOR_SPARSE2,
    FrameDecoder2,
    FrameEncoder2,
    sparse2_bounds,
)
from deltastore.format.codecs.zstdframe import (
    MAX_WINDOW_SIZE,
    compress_bound,
    content_size,
    one_shot,
)
from deltastore.format.dtypes import word_dtype

#: Every codec name of format v1 (the rows of :data:`CODEC_TABLE`, in the same order).
Codec = Literal["raw", "xor-dense", "xor-sparse", "xor-sparse2", "raw-planes", "xor-patch"]
RAW: Final = "raw"
XOR_DENSE: Final = "xor-dense"
XOR_SPARSE: Final = "xor-sparse"
#: Which codecs a writer *picks* (:meth:`FrameEncoder.encode_delta`,
#: :meth:`FrameEncoder.new_words`): ``"v1"`` only :data:`CODECS_V1` (frames every deltastore
#: reads), ``"v2"`` also ``xor-sparse2`` and ``raw-planes`` (read from deltastore 0.2.0).
#: ``xor-patch`` is in no codec set: it is written only when asked for
#: (:meth:`FrameEncoder.xor_patch`) and read from deltastore 0.3.0.
CodecSet = Literal["v1", "v2"]
CODEC_SETS: Final = ("v1", "v2")
#: Largest frame (bytes of the elements it covers, ``n * s``) a publisher cuts, and the
#: limit a subscriber applies by default (spec section 8.3: 1 GiB).
MAX_FRAME_BYTES: Final = 1 << 30

#: Words decoded per step when streaming a dense frame.
CHUNK_BYTES = 1 << 20


def sparse2_bound(n: int, size: int) -> int:
    """Largest decompressed size of an ``xor-sparse2`` frame of ``n`` elements of ``size``
    bytes, whatever its ``changed``: ``12 + n * (5 + size) + 4 * floor(n / 255)`` (every
    element changed, 31 low bits, as many escapes as gaps of 255 fit). The decoder checks the
    exact bounds for the frame's ``changed`` (spec section 8.3)."""
    return SPARSE2_HEADER + n * (5 + size) + 4 * (n // ESCAPE)


def unknown_codec(codec: str) -> FrameError:
    """The error for a codec name this reader does not know."""
    return FrameError(
        f"unknown frame codec {codec!r}: written by a newer deltastore than this one "
        f"(which reads {', '.join(CODECS)}); upgrade deltastore to read this version"
    )


def content_bound(codec: str, n: int, size: int) -> int:
    """Largest decompressed size (bytes) of a ``codec`` frame of ``n`` elements of ``size``
    bytes: ``n * size``, :func:`sparse_bound` for ``xor-sparse``, :func:`sparse2_bound` for
    ``xor-sparse2``; :class:`FrameError` for a codec this reader does not know."""
    return codec_spec(codec).max_content(n, size)


def stored_bound(codec: str, n: int, size: int, changed: int) -> int:
    """Largest stored (compressed) length of a ``codec`` frame of ``n`` elements of ``size``
    bytes and ``changed`` changes: the zstd bound (:func:`compress_bound`) of the largest
    content its manifest entry allows (spec section 8.3). The one bound: what a reader checks
    before fetching a frame, and what a writer never exceeds. :class:`FrameError` for a codec
    this reader does not know."""
    return compress_bound(codec_spec(codec).content_range(n, size, changed)[1])


@dataclass(frozen=True)
class Changes:
    """What one frame, or one run of it, changes; element positions are frame-relative.

    Sparse (``positions`` is not None, ``first`` is 0): the elements at ``positions`` (int64,
    strictly ascending, each below the frame's ``n``) change by ``words``: their XOR masks
    when ``xor`` is True (never zero), else their new words (``xor-patch``'s absolute
    entries; a new word may equal the old one, and then the element does not change).
    Dense (``positions`` is None): ``words`` covers the run of elements
    ``[first, first + words.size)``; they are the new words when ``xor`` is False (``raw``),
    else ``old XOR new`` (``xor-dense``: a zero word is an unchanged element).
    Words are unsigned little-endian (:func:`~deltastore.format.dtypes.word_dtype`). A dense
    run's ``words`` is a view of the decoder's reused buffer, valid until its iterator moves on.
    """

    words: np.ndarray
    xor: bool
    first: int = 0
    positions: np.ndarray | None = None


class FrameEncoder:
    """Encodes frames and picks each frame's codec among those of ``codecs`` (default
    ``"v1"``: what deltastore 0.1.0 reads; the publisher's default is ``"v2"``). ``level``:
    the zstd level of every frame; None (default) is level 1 for the 0.1.0 codecs and the
    tuned parameters :data:`~deltastore.format.codecs.v2.DEFAULT_PARAMS` for the others.
    Not thread-safe: one per thread."""

    def __init__(self, level: int | None = None, *, codecs: CodecSet = "v1") -> None:
        if codecs not in CODEC_SETS:
            raise ValueError(f"codecs must be one of {', '.join(CODEC_SETS)}, not {codecs!r}")
        self.codecs: CodecSet = codecs
        self._cctx = zstandard.ZstdCompressor(
            level=1 if level is None else level, write_content_size=True
        )
        self._level = level
        self._v2 = FrameEncoder2(level) if codecs == "v2" else None
        self._patch = self._v2

    def xor_patch(self, positions: np.ndarray, words: np.ndarray, absolute: np.ndarray) -> bytes:
        """``xor-patch`` frame (whatever :attr:`codecs`: a reader from deltastore 0.3.0 needs
        it) of ``k >= 1`` entries: strictly increasing frame-local ``positions`` (int64),
        ``words`` (unsigned little-endian words of the dtype's size,
        :func:`~deltastore.format.dtypes.word_dtype`) that are the XOR masks (non-zero) or,
        where ``absolute`` (bool) is True, the elements' new words; all three the same length.
        Its manifest entry declares ``changed = k``. :class:`ValueError` otherwise."""
        if self._patch is None:
            self._patch = FrameEncoder2(self._level)
        return encode_patch(self._patch, positions, words, absolute)

    def raw(self, new: np.ndarray) -> bytes:
        """``raw`` frame of the new words."""
        return one_shot(self._cctx, new.view(np.uint8).data)

    def xor_dense(self, xor: np.ndarray) -> bytes:
        """``xor-dense`` frame of the full XOR words."""
        return one_shot(self._cctx, xor.view(np.uint8).data)

    def xor_sparse(self, positions: np.ndarray, masks: np.ndarray) -> bytes:
        """``xor-sparse`` frame from strictly increasing positions and non-zero masks."""
        return one_shot(self._cctx, sparse_content(positions, masks))

    def new_words(self, new: np.ndarray) -> tuple[Codec, bytes]:
        """The frame of new words (every frame of an anchor, a tensor without a parent):
        ``raw``, or with the ``"v2"`` codecs ``raw-planes`` unless it does not shrink the
        words (then ``raw``, which decodes faster)."""
        if self._v2 is not None:
            data = self._v2.raw_planes(new)
            if len(data) < new.nbytes:
                return RAW_PLANES, data
        return RAW, self.raw(new)

    def encode_delta(
        self,
        old: np.ndarray,
        new: np.ndarray,
        positions: np.ndarray,
        *,
        masks: np.ndarray | None = None,
        sparse2: Sequence[bytes | memoryview] | None = None,
    ) -> tuple[Codec, bytes]:
        """Pick the smallest encoding of a changed frame.

        ``old``/``new`` are the frame's words, ``positions`` the frame-local indices where they
        differ (non-empty), ``masks`` (optional, computed if None) ``old ^ new`` there.
        ``sparse2`` (``"v2"``, optional): their ``xor-sparse2`` content, already cut into
        sections (:meth:`FrameEncoder2.xor_sparse2_sections`): the same frame, made faster.
        ``"v1"``: ``xor-sparse`` is always tried; ``xor-dense`` and ``raw`` only when more than
        1/16 of the elements changed, where they can win. ``"v2"``: ``xor-sparse2`` always,
        ``xor-sparse`` for at most :data:`~deltastore.format.codecs.v2.V1_MAX_CHANGES`
        changes (4 header bytes less), ``xor-dense`` and ``raw-planes`` above 1/16 changed.
        """
        if masks is None:
            masks = old[positions] ^ new[positions]
        count = int(positions.size)
        # each candidate encoded in turn, only the smallest so far kept (the first in the
        # order above on a tie): one candidate's bytes and temporaries at a time beside the
        # best; the codecs of every word first (their temporaries are the largest)
        dense = count * 16 > new.size
        v2 = self._v2
        # (rank in the order above, codec, encoder)
        cands: list[tuple[int, Codec, Callable[[], bytes]]] = []
        if dense and v2 is None:
            cands += [
                (1, XOR_DENSE, lambda: self.xor_dense(old ^ new)),
                (2, RAW, lambda: self.raw(new)),
            ]
        elif dense and v2 is not None:
            cands += [
                (2, XOR_DENSE, lambda: v2.xor_dense(old ^ new)),
                (3, RAW_PLANES, lambda: v2.raw_planes(new)),
            ]
        best: tuple[int, Codec, bytes] | None = None
        for rank, codec, encode in cands:
            best = _smaller(best, (rank, codec, encode()))
        if v2 is None:
            best = _smaller(best, (0, XOR_SPARSE, self.xor_sparse(positions, masks)))
        else:
            got = v2.xor_sparse2_sections(sparse2, count) if sparse2 else None
            best = _smaller(best, (0, XOR_SPARSE2, got or v2.xor_sparse2(positions, masks)))
            if count <= V1_MAX_CHANGES:
                best = _smaller(best, (1, XOR_SPARSE, self.xor_sparse(positions, masks)))
        assert best is not None
        return best[1], best[2]


def _smaller(
    best: tuple[int, Codec, bytes] | None, cand: tuple[int, Codec, bytes]
) -> tuple[int, Codec, bytes]:
    """The smaller encoding; on a tie, the one of lower rank."""
    if best is None or (len(cand[2]), cand[0]) < (len(best[2]), best[0]):
        return cand
    return best


class FrameDecoder:
    """Decodes frames into caller buffers or sparse changes. Not thread-safe: one per thread."""

    def __init__(self, *, max_window_size: int = MAX_WINDOW_SIZE) -> None:
        self._max_window = max_window_size
        self._dctx = zstandard.ZstdDecompressor(max_window_size=max_window_size)
        self._v2 = FrameDecoder2(max_window_size=max_window_size)
        self._chunk = np.empty(CHUNK_BYTES, dtype=np.uint8)
        self._mask = np.empty(CHUNK_BYTES, dtype=np.bool_)

    def _content_size(self, data: bytes, lo: int, hi: int) -> int:
        return content_size(data, lo, hi, self._max_window)

    def changes(
        self, codec: str, data: bytes, n: int, size: int, changed: int
    ) -> Iterator[Changes]:
        """The changes a stored ``codec`` frame of ``n`` elements of ``size`` bytes makes: one
        sparse :class:`Changes` for ``xor-sparse`` and ``xor-sparse2`` (decoded at once,
        ``changed`` checked), else dense runs of at most :data:`CHUNK_BYTES` bytes, in order
        (``raw`` and ``xor-dense`` decoded as the iterator advances, ``raw-planes`` at once).
        ``xor-patch``: up to two sparse :class:`Changes`, its XOR entries (``xor`` True) then
        its absolute entries (``xor`` False: new words), a part without entries left out.
        The content size is checked against the frame's bound before anything is
        decompressed; :class:`FrameError` for a damaged frame or an unknown codec (at once)."""
        return codec_spec(codec).changes(self, data, n, size, changed)

    def decode_into(self, codec: str, data: bytes, out: np.ndarray) -> None:
        """Decode a frame of new words (``raw`` or ``raw-planes``: every frame of an anchor)
        straight into ``out`` (contiguous words, exactly the frame's size); :class:`FrameError`
        for another codec, whose frames hold XOR masks that need the old words (use
        :meth:`changes`), or one this reader does not know."""
        spec = codec_spec(codec)
        if spec.into is None:
            raise FrameError(f"a {codec!r} frame holds no new words to decode into place")
        spec.into(self, data, out)

    def sparse(self, data: bytes, n: int, size: int, changed: int) -> tuple[np.ndarray, np.ndarray]:
        """Decode ``xor-sparse``: (frame-local int64 positions, unsigned XOR masks)."""
        self._content_size(data, SPARSE_HEADER + changed * (1 + size), sparse_bound(n, size))
        try:
            raw = self._dctx.decompress(data)
        except zstandard.ZstdError as exc:
            raise FrameError(f"xor-sparse frame does not decompress ({exc})") from None
        return decode_sparse(raw, n, size, changed)

    def sparse2_content(
        self, data: bytes, n: int, size: int, changed: int
    ) -> tuple[bytes, int, int, int]:
        """An ``xor-sparse2`` frame's decompressed content and its header's ``(k, e, L)``,
        after every check of :meth:`changes` that needs no decoding (content size against the
        frame's bounds, header, ``k == changed``): what a native decoder reads
        (:mod:`deltastore.kernels.apply`)."""
        return self._v2.sparse2_content(data, n, size, changed)

    def sparse2_precheck(self, data: bytes | memoryview, n: int, size: int, changed: int) -> int:
        """The declared content size of a stored ``xor-sparse2`` frame, checked as far as its
        zstd frame header allows, nothing decompressed: what a native decoder that
        decompresses the frame itself checks first (:mod:`deltastore.kernels.batch`)."""
        return self._v2.sparse2_precheck(data, n, size, changed)

    def into(self, data: bytes, out: np.ndarray) -> None:
        """Decode a ``raw``/``xor-dense`` frame into ``out`` (contiguous, exactly its size)."""
        view = out.reshape(-1).view(np.uint8).data
        self._content_size(data, view.nbytes, view.nbytes)
        with self._stream(data) as reader:
            self._read_full(reader, view)

    def chunks(self, data: bytes, n: int, size: int) -> Iterator[tuple[int, np.ndarray]]:
        """Stream a ``raw``/``xor-dense`` frame as ``(first_element, words)`` chunks.

        Each yielded array is a view of a reused buffer, valid until the next step.
        """
        total = n * size
        self._content_size(data, total, total)
        step = (CHUNK_BYTES // size) * size
        with self._stream(data) as reader:
            for first in range(0, total, step):
                view = self._chunk.data[: min(step, total - first)]
                self._read_full(reader, view)
                yield first // size, self._chunk[: view.nbytes].view(word_dtype(size))

    def nonzero(self, words: np.ndarray) -> np.ndarray:
        """Indices (int64) of non-zero words, using a reused bool buffer."""
        mask = (
            self._mask[: words.size]
            if words.size <= self._mask.size
            else np.empty(words.size, np.bool_)
        )
        np.not_equal(words, 0, out=mask)
        return np.flatnonzero(mask)

    def _stream(self, data: bytes) -> zstandard.ZstdDecompressionReader:
        return self._dctx.stream_reader(data, read_across_frames=False)

    @staticmethod
    def _read_full(reader: zstandard.ZstdDecompressionReader, view: memoryview) -> None:
        done = 0
        try:
            while done < view.nbytes:
                got = reader.readinto(view[done:])
                if not got:
                    raise FrameError(
                        f"frame ended after {done} of {view.nbytes} bytes (truncated frame)"
                    )
                done += got
        except zstandard.ZstdError as exc:
            raise FrameError(f"frame does not decompress ({exc})") from None


# --- the codec table ---------------------------------------------------------------------


@dataclass(frozen=True)
class CodecSpec:
    """One codec of format v1 (spec section 8.2): what writers and readers need to know of it.
    Frozen; the decoder callables take the calling thread's :class:`FrameDecoder`."""

    name: Codec
    #: The first codec set that writes it: ``"v1"`` (deltastore 0.1.0) or ``"v2"`` (0.2.0);
    #: None for a codec in no codec set, written only on request (``xor-patch``, 0.3.0).
    codec_set: CodecSet | None
    #: Its frames carry the new words (every frame of an anchor is of such a codec); the
    #: others carry XOR masks, applied to the parent's words (:attr:`needs_parent`).
    new_words: bool
    #: Its frames hold only some elements (positions and words), not every element.
    sparse: bool
    #: ``(n, size) ->`` the largest decompressed content (bytes) of a frame of ``n``
    #: elements of ``size`` bytes, whatever its ``changed``: what a reader plans memory for.
    max_content: Callable[[int, int], int]
    #: ``(n, size, changed) -> (lo, hi)``: the content sizes (bytes) a frame's zstd header
    #: may declare, given its manifest entry (spec section 8.3).
    content_range: Callable[[int, int, int], tuple[int, int]]
    #: ``(decoder, data, n, size, changed) ->`` the frame's :class:`Changes`.
    changes: Callable[[FrameDecoder, bytes, int, int, int], Iterator[Changes]]
    #: ``(decoder, data, out)``: decode the new words into ``out``; None for a codec of
    #: XOR masks.
    into: Callable[[FrameDecoder, bytes, np.ndarray], None] | None = None
    #: The receivers' native kernels decode it (:mod:`deltastore.kernels`; from
    #: :meth:`FrameDecoder.sparse2_content`); other codecs go through :attr:`changes`.
    native: bool = False

    @property
    def needs_parent(self) -> bool:
        """Whether its frames apply only to the parent's words (XOR masks)."""
        return not self.new_words


def _dense_range(n: int, size: int, changed: int) -> tuple[int, int]:
    return n * size, n * size


def _dense_bound(n: int, size: int) -> int:
    return n * size


def _sparse_range(n: int, size: int, changed: int) -> tuple[int, int]:
    return SPARSE_HEADER + changed * (1 + size), sparse_bound(n, size)


def _sparse_changes(
    dec: FrameDecoder, data: bytes, n: int, size: int, changed: int
) -> Iterator[Changes]:
    positions, masks = dec.sparse(data, n, size, changed)
    return iter((Changes(masks, True, 0, positions),))


def _sparse2_changes(
    dec: FrameDecoder, data: bytes, n: int, size: int, changed: int
) -> Iterator[Changes]:
    positions, masks = dec._v2.sparse2(data, n, size, changed)
    return iter((Changes(masks, True, 0, positions),))


def _raw_changes(
    dec: FrameDecoder, data: bytes, n: int, size: int, changed: int
) -> Iterator[Changes]:
    return (Changes(words, False, first) for first, words in dec.chunks(data, n, size))


def _xor_dense_changes(
    dec: FrameDecoder, data: bytes, n: int, size: int, changed: int
) -> Iterator[Changes]:
    return (Changes(words, True, first) for first, words in dec.chunks(data, n, size))


def _planes_changes(
    dec: FrameDecoder, data: bytes, n: int, size: int, changed: int
) -> Iterator[Changes]:
    runs = dec._v2.planes_chunks(data, n, size)
    return (Changes(words, False, first) for first, words in runs)


def _patch_changes(
    dec: FrameDecoder, data: bytes, n: int, size: int, changed: int
) -> Iterator[Changes]:
    positions, words, absolute = decode_patch(dec._v2, data, n, size, changed)
    parts = []
    if not absolute.all():
        xor = ~absolute
        parts.append(Changes(words[xor], True, 0, positions[xor]))
    if absolute.any():
        parts.append(Changes(words[absolute], False, 0, positions[absolute]))
    return iter(parts)


def _raw_into(dec: FrameDecoder, data: bytes, out: np.ndarray) -> None:
    dec.into(data, out)


def _planes_into(dec: FrameDecoder, data: bytes, out: np.ndarray) -> None:
    dec._v2.planes_into(data, out)


#: Every codec this reader knows, by name, in the order of :data:`Codec`.
CODEC_TABLE: Final[Mapping[str, CodecSpec]] = MappingProxyType(
    {
        RAW: CodecSpec(RAW, "v1", True, False, _dense_bound, _dense_range, _raw_changes, _raw_into),
        XOR_DENSE: CodecSpec(
            XOR_DENSE, "v1", False, False, _dense_bound, _dense_range, _xor_dense_changes
        ),
        XOR_SPARSE: CodecSpec(
            XOR_SPARSE, "v1", False, True, sparse_bound, _sparse_range, _sparse_changes
        ),
        XOR_SPARSE2: CodecSpec(
            XOR_SPARSE2,
            "v2",
            False,
            True,
            sparse2_bound,
            sparse2_bounds,
            _sparse2_changes,
            native=True,
        ),
        RAW_PLANES: CodecSpec(
            RAW_PLANES,
            "v2",
            True,
            False,
            _dense_bound,
            _dense_range,
            _planes_changes,
            _planes_into,
        ),
        XOR_PATCH: CodecSpec(
            XOR_PATCH, None, False, True, patch_bound, patch_bounds, _patch_changes
        ),
    }
)
#: The codecs deltastore 0.1.0 writes and reads.
CODECS_V1: Final = tuple(c for c, spec in CODEC_TABLE.items() if spec.codec_set == "v1")
#: Every codec this reader knows.
CODECS: Final = tuple(CODEC_TABLE)
#: Codecs whose frames hold the new words (every frame of an anchor is one of these).
NEW_WORDS_CODECS: Final = tuple(c for c, spec in CODEC_TABLE.items() if spec.new_words)


def codec_spec(codec: str) -> CodecSpec:
    """The row of ``codec`` in :data:`CODEC_TABLE`; :class:`FrameError` (upgrade deltastore)
    for a codec this reader does not know."""
    spec = CODEC_TABLE.get(codec)
    if spec is None:
        raise unknown_codec(codec)
    return spec


__all__ = [
    "CHUNK_BYTES",
    "CODECS",
    "CODECS_V1",
    "CODEC_SETS",
    "CODEC_TABLE",
    "MAX_FRAME_BYTES",
    "MAX_WINDOW_SIZE",
    "NEW_WORDS_CODECS",
    "RAW",
    "RAW_PLANES",
    "SPARSE_HEADER",
    "XOR_DENSE",
    "XOR_PATCH",
    "XOR_SPARSE",
    "XOR_SPARSE2",
    "Changes",
    "Codec",
    "CodecSet",
    "CodecSpec",
    "FrameDecoder",
    "FrameEncoder",
    "codec_spec",
    "compress_bound",
    "content_bound",
    "sparse2_bound",
    "sparse_bound",
    "stored_bound",
    "unknown_codec",
]
