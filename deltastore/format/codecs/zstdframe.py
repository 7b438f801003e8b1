"""The zstd frame rules every codec shares (spec section 8.1 and 8.3): the largest window a
reader accepts, the zstd bound of a content size, and the length of the one zstd frame a
stored frame must be."""

from __future__ import annotations

from typing import Final

import zstandard

from deltastore.errors import FrameError

#: Largest zstd window a receiver accepts (bytes); writers use level <= 19 windows.
MAX_WINDOW_SIZE: Final = 1 << 27


def compress_bound(n: int) -> int:
    """Largest zstd frame for ``n`` content bytes (``ZSTD_COMPRESSBOUND``, plus header room)."""
    small = ((128 << 10) - n) >> 11 if n < (128 << 10) else 0
    return n + (n >> 8) + small + 32


def frame_length(data: bytes) -> int:
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


__all__ = ["MAX_WINDOW_SIZE", "compress_bound", "frame_length"]
