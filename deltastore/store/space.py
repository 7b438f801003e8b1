"""Room on a local file system: reserve a file's blocks before it is written through a memory
map, and turn "no space left" into :class:`~deltastore.errors.DiskFullError`.

A page of a memory map that has no disk block behind it (a sparse file, or a hole made by
``truncate``) gets one when it is first written; when the file system has none left, the
kernel can only answer the page fault with SIGBUS, which kills the process without a message.
Every file deltastore writes through a map is therefore reserved first (:func:`reserve`):
``posix_fallocate``, or, where the file system does not support it, zeros written through the
file descriptor. A full disk then fails there, as an ``OSError``, before anything is mapped.
(A copy-on-write file system (btrfs, ZFS) may still need new blocks to overwrite reserved
ones; there a full disk during an in-place update can still end in SIGBUS.)

``ENOSPC`` (no space) and ``EDQUOT`` (quota exhausted) are "disk full" (:func:`is_disk_full`);
:func:`disk_full` builds the error that names the folder and the bytes needed and free.
Functions are thread-safe (they share no state).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from deltastore.errors import DiskFullError

#: errno values that mean "no room": the disk is full, or the user's quota is exhausted.
FULL_ERRNOS = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e is not None)
#: errno values of a file system that cannot ``fallocate`` (NFS before 4.2, some FUSE and
#: older file systems): the blocks are then reserved by writing zeros.
UNSUPPORTED_ERRNOS = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS})
_ZEROS = bytes(1 << 20)
#: What a disk-full message says to do by default.
TODO = "free space or choose another folder, then run it again"


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says a file system has no room (``ENOSPC`` or ``EDQUOT``)."""
    return isinstance(exc, OSError) and exc.errno in FULL_ERRNOS


def free_bytes(folder: str | os.PathLike[str]) -> int | None:
    """Bytes free for unprivileged users in the file system of ``folder`` (or of its nearest
    existing parent); None when it cannot be asked."""
    path = Path(folder)
    for candidate in (path, *path.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def human(n: int | None) -> str:
    """``n`` bytes for a message: ``45.2 MB (45,180,928 bytes)``; "an unknown number of
    bytes" for None."""
    if n is None:
        return "an unknown number of bytes"
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit} ({n:,} bytes)"
    return f"{n} bytes"


def disk_full(
    folder: str | os.PathLike[str],
    exc: OSError,
    *,
    needed: int | None,
    what: str,
    todo: str = TODO,
    cls: type[DiskFullError] = DiskFullError,
) -> DiskFullError:
    """The error for ``exc`` (``ENOSPC`` / ``EDQUOT``) while writing ``what`` (e.g. "the
    checkpoint files of version 7") in ``folder``: names the folder, the bytes ``needed`` and
    free, and says what to do (``todo``). ``cls``: :class:`DiskFullError` or a subclass."""
    free = free_bytes(folder)
    why = "the disk quota is exhausted" if exc.errno != errno.ENOSPC else "no space left"
    message = (
        f"{why} in {folder}: {what} needs {human(needed)}, {human(free)} free; {todo}"
        if needed is not None
        else f"{why} in {folder} while writing {what} ({human(free)} free); {todo}"
    )
    return cls(message, errno=exc.errno, filename=str(folder), needed=needed, free=free)


@contextmanager
def no_room(
    folder: str | os.PathLike[str],
    what: str,
    *,
    needed: int | None = None,
    todo: str = TODO,
    cls: type[DiskFullError] = DiskFullError,
) -> Iterator[None]:
    """Raise a full disk or quota met in the ``with`` block as :func:`disk_full`'s error
    (a :class:`~deltastore.errors.DiskFullError` already raised passes unchanged)."""
    try:
        yield
    except OSError as exc:
        if is_disk_full(exc) and not isinstance(exc, DiskFullError):
            raise disk_full(folder, exc, needed=needed, what=what, todo=todo, cls=cls) from None
        raise


def reserve(fd: int, offset: int, length: int) -> None:
    """Give the bytes ``[offset, offset + length)`` of the open file ``fd`` disk blocks, so
    that writing them through a memory map cannot fault for lack of space (see the module
    docstring). ``posix_fallocate`` where the file system supports it (the file reads the
    same: zeros where it was a hole); otherwise the range is written with zeros through the
    descriptor (``pwrite``; the range must hold only zeros or be past the end of the file).
    Raises ``OSError`` (``ENOSPC``, ``EDQUOT``, ...) when the blocks cannot be had; blocks
    already reserved then stay with the file (remove it to give them back)."""
    if length <= 0:
        return
    if hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, offset, length)
            return
        except OSError as exc:
            if exc.errno not in UNSUPPORTED_ERRNOS:
                raise
    end = offset + length
    pos = offset
    while pos < end:
        n = os.pwrite(fd, _ZEROS[: min(len(_ZEROS), end - pos)], pos)
        if n <= 0:  # pragma: no cover - pwrite raises rather than writing nothing
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        pos += n


__all__ = [
    "FULL_ERRNOS",
    "TODO",
    "disk_full",
    "free_bytes",
    "human",
    "is_disk_full",
    "no_room",
    "reserve",
]
