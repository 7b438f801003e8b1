"""The zstd frame rules every codec shares (spec section 8.1 and 8.3): the largest window a
reader accepts, the zstd bound of a content size, and the length of the one zstd frame a
stored frame must be."""

from __future__ import annotations

from typing import Any, Final

import zstandard

from deltastore.errors import FrameError

#: Largest zstd window a receiver accepts (bytes); writers use level <= 19 windows.
MAX_WINDOW_SIZE: Final = 1 << 27


def compress_bound(n: int) -> int:
    """Largest zstd frame for ``n`` content bytes (``ZSTD_COMPRESSBOUND``, plus header room)."""
    small = ((128 << 10) - n) >> 11 if n < (128 << 10) else 0
    return n + (n >> 8) + small + 32


def one_shot(cctx: zstandard.ZstdCompressor, data: Any) -> bytes:
    """``cctx.compress(data)`` (``data``: a contiguous bytes-like object), the same bytes,
    copied to an object of their own size when they are under half the input's: the one-shot
    ``compress`` of python-zstandard returns bytes that keep the allocation of the zstd bound
    of the input however small the frame (measured with zstandard 0.25), which a publisher
    holding its frames until their upload would pay for every frame."""
    out = cctx.compress(data)
    return bytes(memoryview(out)) if 2 * len(out) < memoryview(data).nbytes else out


def frame_length(data: bytes | memoryview) -> int:
    """Bytes of the zstd frame at the start of ``data``, by walking its block headers."""
    try:
        pos = int(zstandard.frame_header_size(data))
    except zstandard.ZstdError as exc:
        raise FrameError(f"not a zstd frame ({exc})") from None
    has_checksum = len(data) > 4 and bool(data[4] & 0x04)
    while True:
        if pos + 3 > len(data):
            raise FrameError("zstd frame is truncated (block header missing)")
        header = int.from_bytes(data[pos : pos + 3], "little")
        kind, size = (header >> 1) & 3, header >> 3
        if kind == 3:
            raise FrameError("zstd frame holds a reserved block type")
        pos += 3 + (1 if kind == 1 else size)
        if header & 1:
            return pos + (4 if has_checksum else 0)


def content_size(
    data: bytes | memoryview, lo: int, hi: int, max_window: int, codec: str = ""
) -> int:
    """The content size a stored frame's zstd header declares, after the checks every codec
    shares (spec sections 8.1 and 8.3), all before anything is decompressed: the size is
    declared and within ``[lo, hi]`` (the bound its manifest entry implies), no dictionary,
    a window of at most ``max_window`` bytes, and exactly one zstd frame. ``codec`` names the
    codec in messages. :class:`FrameError` otherwise."""
    what = f"{codec} zstd frame" if codec else "zstd frame"
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as exc:
        raise FrameError(f"not a zstd frame ({exc})") from None
    size = int(params.content_size)
    if size == zstandard.CONTENTSIZE_UNKNOWN or not lo <= size <= hi:
        raise FrameError(
            f"{what} declares {size} content bytes, outside the [{lo}, {hi}] "
            "its manifest entry allows"
        )
    if params.dict_id:
        raise FrameError(f"{what} names a dictionary ({params.dict_id})")
    if params.window_size > max_window:
        raise FrameError(
            f"{what} asks for a {params.window_size}-byte window, more than "
            f"the {max_window} this reader allows"
        )
    if frame_length(data) != len(data):
        raise FrameError("a stored frame must be exactly one zstd frame (extra bytes follow)")
    return size


__all__ = ["MAX_WINDOW_SIZE", "compress_bound", "content_size", "frame_length", "one_shot"]
