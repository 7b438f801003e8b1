"""Gather and scatter of words (unsigned element bits) in local tensors, CPU or device.

A tensor's words (``local``) are :func:`deltastore.tensors.dtypes.flat_words`: a 1-D integer
torch tensor (on the CPU: numpy views of its memory are indexed; on a device: torch's
``index_select`` / ``index_copy_``), or the numpy words of a
:class:`~deltastore.tensors.host.HostTensor`, indexed as they are without importing torch.
Positions are int32 or int64 flat element indices; values are unsigned little-endian words. Not
thread-safe for writes to the same tensor.

numpy indexes with int64 (intp) positions only: it converts any other index array to int64
first, a whole-array copy (int32 scatters were ~35% slower than int64 ones on 2M changes). Staged
positions are kept narrow (:func:`narrow`: int32, 4 bytes per change instead of 8, for the
memory bar of docs/performance.md) and :func:`scatter` converts them :data:`STEP` at a time
into one reused int64 buffer that stays in cache (~15% over an int64 scatter instead of 35%).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from deltastore.format.dtypes import signed_word_dtype

if TYPE_CHECKING:
    import torch

    from deltastore.tensors.host import Words

#: Positions converted to int64 per step when scattering narrower ones (512 KiB: in L2).
STEP = 1 << 16
INT32_MAX = (1 << 31) - 1
#: Fewest changed words of sparse XOR writes that :func:`write_all` spreads over threads.
PARALLEL_WORDS = 1 << 18


@dataclass(frozen=True)
class Write:
    """One write of a write phase: ``local``, the 1-D words of a tensor (CPU or device, or a
    host tensor's); ``positions`` in it, ascending (int32/int64, or :func:`compact` gaps); the
    ``old`` and ``new`` unsigned words there (same length). ``dense``: ``positions`` is unused
    and ``old`` / ``new`` are the words of elements ``[0, len(new))`` of ``local`` (one range
    write instead of a scatter). ``xor`` (host words only): ``old`` and ``new`` are the
    same XOR masks, and a put XORs them into ``local`` in place, over the dense run (numpy
    checks its operands before it writes: the XOR raises with nothing written, or completes)
    or at ``positions`` (int32/int64; the native :func:`xor_at`, which cannot fail once
    started), so the restore is the same XOR."""

    local: Words
    positions: np.ndarray
    old: np.ndarray
    new: np.ndarray
    dense: bool = False
    xor: bool = False

    def put(self, values: np.ndarray) -> None:
        """Write ``values`` (``old`` or ``new``) where this write goes."""
        if self.xor and not self.dense:
            xor_at(self.local, self.positions, values)
        elif self.xor:
            xor_range(self.local, values)
        elif self.dense:
            scatter_range(self.local, 0, values)
        else:
            scatter(self.local, self.positions, values)


def host_view(local: Words) -> np.ndarray | None:
    """The words ``local`` as a numpy array over the same memory (host words as they are, a
    CPU torch tensor's through ``.numpy()``); None for a tensor on a device."""
    if isinstance(local, np.ndarray):
        return local
    if local.device.type == "cpu":
        out: np.ndarray = local.numpy()
        return out
    return None


def gather(local: Words, positions: np.ndarray, wdt: np.dtype[Any]) -> np.ndarray:
    """The words (as ``wdt``) at flat ``positions`` of ``local``: a new host array."""
    positions = positions.astype(np.int64, copy=False)  # numpy indexes 2-3x faster with intp
    host = host_view(local)
    if host is not None:
        out: np.ndarray = host.view(wdt)[positions]
        return out
    import torch  # a device tensor: torch is loaded already

    dev = cast("torch.Tensor", local)
    idx = torch.from_numpy(positions).to(dev.device, torch.int64)
    got: np.ndarray = dev.index_select(0, idx).cpu().numpy().view(wdt)
    return got


def gather_range(local: Words, start: int, count: int, wdt: np.dtype[Any]) -> np.ndarray:
    """The words (as ``wdt``) of elements ``[start, start + count)`` of ``local`` (a view on
    the host, a copy from a device)."""
    host = host_view(local)
    if host is not None:
        out: np.ndarray = host.view(wdt)[start : start + count]
        return out
    dev = cast("torch.Tensor", local)  # on a device
    got: np.ndarray = dev[start : start + count].to("cpu", copy=True).numpy().view(wdt)
    return got


def scatter(local: Words, positions: np.ndarray, values: np.ndarray) -> None:
    """Write ``values`` (unsigned words) at ``positions`` (int64, int32 or :func:`compact` gaps)
    of ``local``; narrow positions are widened :data:`STEP` at a time on the host."""
    host = host_view(local)
    if host is not None:
        dest = host.view(values.dtype)
        if positions.dtype == np.intp:
            dest[positions] = values
            return
        buf = np.empty(min(STEP, positions.size), dtype=np.intp)
        gaps, base = positions.dtype.kind == "u", 0
        for lo in range(0, positions.size, STEP):
            part = positions[lo : lo + STEP]
            idx = buf[: part.size]
            if gaps:
                np.cumsum(part, out=idx)
                idx += base
                base = int(idx[-1])
            else:
                idx[:] = part
            dest[idx] = values[lo : lo + STEP]
        return
    import torch  # a device tensor: torch is loaded already

    dev = cast("torch.Tensor", local)
    at = torch.from_numpy(expand(positions)).to(dev.device, torch.int64)
    vals = torch.from_numpy(values.view(signed_word_dtype(values.dtype.itemsize))).to(dev.device)
    dev.index_copy_(0, at, vals)


def scatter_range(local: Words, start: int, values: np.ndarray) -> None:
    """Write ``values`` (unsigned words) to elements ``[start, start + len(values))``."""
    host = host_view(local)
    if host is not None:
        host.view(values.dtype)[start : start + values.size] = values
        return
    import torch  # a device tensor: torch is loaded already

    dev = cast("torch.Tensor", local)
    vals = torch.from_numpy(values.view(signed_word_dtype(values.dtype.itemsize)))
    dev[start : start + values.size].copy_(vals)


def xor_range(local: Words, masks: np.ndarray) -> None:
    """XOR ``masks`` (unsigned words) into elements ``[0, len(masks))`` of host words
    ``local``, in place."""
    host = host_view(local)
    if host is None:
        raise TypeError("an in-place XOR write needs host words")
    dest = host.view(masks.dtype)[: masks.size]
    np.bitwise_xor(dest, masks, out=dest)


def xor_at(local: Words, positions: np.ndarray, masks: np.ndarray) -> None:
    """XOR ``masks`` (unsigned words) into host words ``local`` at ``positions`` (int32 or
    int64, ascending, each in range), in place, by the native kernel
    (:func:`deltastore.kernels.apply.xor_at`: the GIL is released); the same call undoes it."""
    host = host_view(local)
    if host is None:
        raise TypeError("an in-place XOR write needs host words")
    from deltastore.kernels.apply import xor_at as kernel  # numba: loaded on first use

    kernel(host, positions, masks)


def xor_all(writes: Sequence[tuple[Words, np.ndarray, np.ndarray]]) -> None:
    """:func:`xor_at` of every ``(local, positions, masks)``, in one native call per kind of
    words (:func:`deltastore.kernels.apply.xor_many`: the GIL is released once, not once per
    write); every ``local`` is checked to be host words first (TypeError: nothing written)."""
    hosts = []
    for local, positions, masks in writes:
        host = host_view(local)
        if host is None:
            raise TypeError("an in-place XOR write needs host words")
        hosts.append((host, positions, masks))
    from deltastore.kernels.apply import xor_many  # numba: loaded on first use

    xor_many(hosts)


def narrow(positions: np.ndarray, numel: int) -> np.ndarray:
    """Flat int64 ``positions`` (each below ``numel``) as int32 when ``numel`` allows, else as
    they are: how staged positions are kept until the write (see the module docstring)."""
    return positions.astype(np.int32) if numel <= INT32_MAX else positions


def compact(positions: np.ndarray) -> np.ndarray:
    """Ascending positions stored as gaps (``gaps[0] = positions[0]``, then differences) in
    uint16 when they fit, else uint32: 2 bytes per staged change instead of 4 or 8."""
    gaps = np.diff(positions, prepend=0)
    return gaps.astype(np.uint16 if gaps.max(initial=0) < 1 << 16 else np.uint32)


def expand(stored: np.ndarray) -> np.ndarray:
    """int64 positions from :func:`compact` gaps (unsigned), or signed positions as they are."""
    if stored.dtype.kind == "u":
        return np.cumsum(stored, dtype=np.int64)
    return stored


def write_all(
    writes: Sequence[Write],
    threads: int | None = None,
    initializer: Callable[[], object] | None = None,
) -> None:
    """Put each write's new words (:meth:`Write.put`: a scatter, or a range write), in order,
    all or nothing: if a write fails, every write started (the failing one included) gets its
    old words back before the error is re-raised.

    Narrow positions (:func:`narrow`, :func:`compact` gaps) are widened in steps by
    :func:`scatter`. Restoring writes
    the old words, so it is idempotent: a write that failed halfway is undone like a complete
    one. The pause is pure scatters.

    Sparse XOR writes (the native :func:`xor_at`, which either raises before writing or
    completes) go first, spread over up to ``threads`` threads (default: the CPUs this process
    may run on; the kernel releases the GIL) when there are at least :data:`PARALLEL_WORDS`
    of them; the others follow in order on the calling thread. ``initializer``: run first on
    each of those threads (e.g. to lower its CPU priority)."""
    sparse = [w for w in writes if w.xor and not w.dense]
    others = [w for w in writes if not (w.xor and not w.dense)]
    _xor_parallel(sparse, threads, initializer)
    done = 0
    try:
        for w in others:
            done += not w.xor  # before the write: one that fails halfway is undone too
            w.put(w.new)
            done += w.xor  # an XOR write either completed or wrote nothing
    except BaseException:
        restore_all(others[:done])
        restore_all(sparse)
        raise


def _xor_parallel(
    writes: Sequence[Write], threads: int | None, initializer: Callable[[], object] | None
) -> None:
    """Put sparse XOR ``writes`` on up to ``threads`` threads, each write whole on one thread
    (balanced by size); all or nothing: if one raises, every one that completed is undone
    and the first error re-raised."""
    total = sum(w.new.size for w in writes)
    if threads is None:
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    threads = max(1, min(threads, len(writes)))
    if threads == 1 or total < PARALLEL_WORDS:
        bins = [list(writes)]
    else:
        bins = [[] for _ in range(threads)]
        loads = [0] * threads
        for w in sorted(writes, key=lambda w: -w.new.size):
            i = loads.index(min(loads))
            bins[i].append(w)
            loads[i] += w.new.size
    finished: list[list[Write]] = [[] for _ in bins]

    def put(i: int) -> None:
        xor_all([(w.local, w.positions, w.new) for w in bins[i]])  # all, or none written
        finished[i].extend(bins[i])

    try:
        if len(bins) == 1:
            put(0)
        else:
            with ThreadPoolExecutor(
                len(bins), thread_name_prefix="deltastore-write", initializer=initializer
            ) as pool:
                for fut in [pool.submit(put, i) for i in range(len(bins))]:
                    fut.result()
    except BaseException:
        restore_all([w for done in finished for w in done])
        raise


def restore_all(writes: Sequence[Write]) -> None:
    """Put the old words of ``writes`` back (:meth:`Write.put`), newest first."""
    for w in reversed(writes):
        w.put(w.old)
