"""A fused one-pass kernel (numba) for the AdamW inverse of :mod:`deltastore.publish.reconstruct`.

:func:`invert_chunk` returns exactly what :func:`deltastore.publish.reconstruct.invert_chunk`
returns (the numpy reference, the specification of the certified rule), bit for bit
(``tests/test_invert_kernel.py`` checks it on millions of random and adversarial elements and
after real AdamW steps), in two steps per chunk:

1. a float32 filter on every element (vectorized, 8 lanes): it computes the reconstruction and
   the bound in float32 and declares an element certain, with its word, only where a margin
   that covers every float32 rounding (:func:`_fast` states the error analysis) proves that
   the reference calls it certain with the same word;
2. the exact path for the others (near a bf16 rounding tie, uncertain, zero, non-finite or
   out of the filter's range; well under 1% of a trained model's elements): the reference's
   float64 operations in the same order and the same comparisons, no fast-math and no
   contraction to FMA (numba's default: every ``fadd``/``fmul`` rounds on its own).

About 1.7 ns per element on one core of the development machines, against ~27 for the
reference and ~3.2 for the exact path alone (sqrt and three float64 divisions per element
cost ~1.8 ns there).

:func:`invert_and_diff` also produces, in the same pass, what a snapshot-free publisher needs
next: the new words (bf16 of the current parameter, as
:func:`~deltastore.publish.reconstruct.bf16_words`) and the positions to send (old word !=
new word, or not certain).

:func:`bf16_cast` and :func:`cast_adler` cast one chunk of a parameter to its new words
(as ``bf16_words``) on the calling thread, the second with the Adler-32 of their bytes in the
same pass (about 0.4 ns per element against 0.65 for zlib's Adler-32 alone).

numba is imported when this module is (the first snapshot-free reconstruction; the publisher
imports this module lazily): compiled functions are cached on disk next to this file
(``cache=True``; the first call in a fresh environment compiles them, ~1-3 s). The kernels
release the GIL (``nogil=True``): threads may run different chunks at once. Pure functions;
thread-safe. Inputs: 1-D C-contiguous float32 arrays of equal length (other layouts are
copied first); outputs: ``<u2`` words (bf16 bit patterns, little-endian), bool masks, int64
chunk-local positions.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba  # type: ignore[import-untyped, unused-ignore]
import numpy as np
from llvmlite import ir  # type: ignore[import-untyped, unused-ignore]
from numba import types
from numba.extending import intrinsic  # type: ignore[import-untyped, unused-ignore]

from deltastore.publish.reconstruct import G64, SAFETY, TINY, U32, Coefficients


def _i32_intrinsic(build: Any, result: Any, arg: Any) -> Any:
    """A numba intrinsic of one argument whose body is ``build(builder, value)`` on 32-bit
    LLVM values (integer arithmetic wraps modulo 2**32, as numpy's uint32)."""

    def typer(typingctx: Any, value: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return build(builder, args[0])

        return result(arg), codegen

    return intrinsic(typer)


_I32 = ir.IntType(32)


def _c(value: int) -> Any:
    return ir.Constant(_I32, value)


def _build_bits(builder: Any, value: Any) -> Any:
    return builder.bitcast(value, _I32)


def _build_round(builder: Any, value: Any) -> Any:
    # ((bits >> 16) & 1) + 0x7FFF + bits, then >> 16 (uint32): the bf16 word in the low half
    bits = builder.bitcast(value, _I32)
    lsb = builder.and_(builder.lshr(bits, _c(16)), _c(1))
    return builder.lshr(builder.add(builder.add(lsb, _c(0x7FFF)), bits), _c(16))


def _build_tie(sign: int) -> Any:
    def build(builder: Any, rounded: Any) -> Any:
        # ((rounded & 0x7FFF) << 16) -/+ 0x8000 (uint32, wrapping), as a float32
        high = builder.shl(builder.and_(rounded, _c(0x7FFF)), _c(16))
        tie = builder.add(high, _c(0x8000)) if sign > 0 else builder.sub(high, _c(0x8000))
        return builder.bitcast(tie, ir.FloatType())

    return build


#: float32 -> its bit pattern (uint32).
_bits = _i32_intrinsic(_build_bits, types.uint32, types.float32)
#: float32 -> bf16 word rounded to nearest even (NaN not special-cased), in a uint32.
_round = _i32_intrinsic(_build_round, types.uint32, types.float32)
#: bf16 word -> the fp32 rounding tie below / above its magnitude.
_lower_tie = _i32_intrinsic(_build_tie(-1), types.float32, types.uint32)
_upper_tie = _i32_intrinsic(_build_tie(+1), types.float32, types.uint32)


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _element(
    pf: np.float32,
    mf: np.float32,
    vf: np.float32,
    alpha: float,
    c: float,
    eps: float,
    d: float,
    floor_k: float,
    floor_min: float,
    kp: float,
    ku: float,
    kx: float,
    tiny_x: float,
) -> tuple[Any, bool]:
    """One element of the reference, operation for operation (see reconstruct_chunk and
    invert_chunk there): the old word and whether it is certain."""
    p = np.float64(pf)
    m = np.float64(mf)
    den = math.sqrt(np.float64(vf))
    den = den / c
    den = den + eps
    a = abs(m)
    fl = den * floor_k
    if fl < floor_min:  # np.maximum: a NaN floor stays NaN (never exposed by it)
        fl = floor_min
    exposed = (a < fl) & (a != 0.0)
    exposed |= (abs(pf) < np.float32(TINY)) & (pf != 0)
    u = m * alpha
    u = u / den
    au = abs(u)
    # x86 returns the first operand's NaN (numpy's p + update); LLVM may commute an fadd
    x = p if p != p else p + u
    x = x / d
    b = abs(p) * kp
    b = b + au * ku
    ax = abs(x)
    exposed |= ax < tiny_x
    b = b + ax * kx
    rounded = _round(np.float32(x))
    lower = np.float64(_lower_tie(rounded))
    upper = np.float64(_upper_tie(rounded))
    certain = (ax - b > lower) & (ax + b < upper) & (not exposed)
    # the update was exactly zero and the decay keeps the sign: it was that zero
    kept = (pf == 0) & (_bits(mf) == 0)
    word = (_bits(pf) >> 16) if kept else rounded
    return word, certain | kept


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _new_word(pf: np.float32) -> Any:
    """bf16 word of a float32, as bf16_words (round to nearest even; NaN -> 0x7FC0)."""
    return 0x7FC0 if pf != pf else _round(pf)


#: Magnitudes the float32 fast path accepts (inputs and intermediates): far from float32's
#: subnormal and overflow ranges, so that each of its operations has a relative error of at
#: most ``2**-24``.
_LO32 = np.float32(2.0**-100)
_HI32 = np.float32(2.0**100)
#: The fast path's margin, relative to ``S + |x| + B`` (see :func:`_fast`): 64 units of
#: float32 roundoff.
_MARGIN32 = np.float32(2.0**-18)
#: Eight bool True bytes as one little-endian uint64.
_ALL_TRUE = np.uint64(0x0101010101010101)


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _fast(
    pf: np.float32,
    mf: np.float32,
    vf: np.float32,
    f: np.ndarray,
) -> tuple[Any, bool]:
    """A float32 filter: ``(word, True)`` when it *proves* that the reference (float64) calls
    the element certain with that word; else ``(anything, False)``: compute it exactly.

    It evaluates ``x~ = (p + alpha*m/(sqrt(v)*(1/c) + eps)) * (1/d)`` and ``B~`` in float32
    (scalars rounded to float32). Without underflow or overflow (the ``_LO32``/``_HI32``
    checks) each operation errs by at most ``u = 2**-24`` relative, so ``|x~ - x| <= 10.2 u S``
    with ``S = (|p| + |u~|) / d`` (7u for the update: sqrt, the reciprocal of c, product, eps
    sum, alpha, product, division; 3u for the sum, the reciprocal of d and the product; the
    float64 reference's own roundings below 2**-50), and ``|B~ - B| <= 6u B~ + 0.1u S``
    (``ku, kx < 2**-8``). Declaring certain needs
    ``|x~| - B~ - D > lower`` and ``|x~| + B~ + D < upper`` (evaluated in float32, 3u more),
    ``D = 2**-18 (S + |x~| + B~)``: 64u covers 17u + 3u, so ``|x| - B > lower`` and
    ``|x| + B < upper`` hold with room for the reference's float64 roundings, the reference
    is certain, and ``x`` and ``x~`` lie strictly inside the same bf16 cell: the same word.
    Not exposed: ``|p| >= 2**-100 > TINY``; ``|m| >= 2 max(den~ floor_k, floor_min)`` (or
    ``m == 0``: the update is exactly zero both ways); ``|x~| >= 2**-99`` and
    ``D >= 4 |x~ - x|`` keep ``|x| > TINY / d``. ``p == 0`` (the reference's kept zeros),
    NaN, infinities and anything out of range take the exact path."""
    rc, eps, alpha, rd = f[0], f[1], f[2], f[3]
    kp, ku, kx, floor_k, floor_min = f[4], f[5], f[6], f[7], f[8]
    ap = abs(pf)
    am = abs(mf)
    ok = (ap >= _LO32) & (ap <= _HI32) & (am <= _HI32) & (vf <= _HI32)
    ok &= ((am >= _LO32) | (am == 0)) & ((vf >= _LO32) | (vf == 0))
    den = np.float32(math.sqrt(vf)) * rc + eps
    ok &= (den >= _LO32) & (den <= _HI32)
    q = mf * alpha
    u = q / den
    au = abs(u)
    ok &= (am == 0) | ((abs(q) >= _LO32) & (au >= _LO32) & (au <= _HI32))
    ok &= (am == 0) | (am >= np.float32(2) * max(den * floor_k, floor_min))
    x = (pf + u) * rd
    ax = abs(x)
    ok &= (ax >= np.float32(2.0**-99)) & (ax <= _HI32)
    s = (ap + au) * rd
    b = ap * kp + au * ku + ax * kx
    margin = (s + ax + b) * _MARGIN32
    rounded = _round(x)
    lower = _lower_tie(rounded)
    upper = _upper_tie(rounded)
    ok &= ((ax - b) - margin > lower) & ((ax + b) + margin < upper)
    return rounded, ok


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _invert(
    param: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    k: np.ndarray,
    f: np.ndarray,
    words: np.ndarray,
    certain: np.ndarray,
) -> None:
    size = param.shape[0]
    # the float32 filter on every element (vectorized), then the exact float64 path for the
    # few it cannot prove certain (near a rounding tie, uncertain, out of its range)
    for i in range(size):
        w, ok = _fast(param[i], exp_avg[i], exp_avg_sq[i], f)
        words[i] = w
        certain[i] = ok
    full = size // 8 * 8
    lanes = certain[:full].view(np.uint64)  # 8 flags at a time: most are all True
    for j in range(lanes.shape[0]):
        if lanes[j] != _ALL_TRUE:
            for i in range(8 * j, 8 * j + 8):
                if not certain[i]:
                    _exact(param, exp_avg, exp_avg_sq, k, words, certain, i)
    for i in range(full, size):
        if not certain[i]:
            _exact(param, exp_avg, exp_avg_sq, k, words, certain, i)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _exact(
    param: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    k: np.ndarray,
    words: np.ndarray,
    certain: np.ndarray,
    i: int,
) -> None:
    """Element ``i`` by the exact float64 path."""
    w, ok = _element(
        param[i], exp_avg[i], exp_avg_sq[i], k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7],
        k[8], k[9],
    )  # fmt: skip
    words[i] = w
    certain[i] = ok


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _invert_diff(
    param: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    k: np.ndarray,
    f: np.ndarray,
    words: np.ndarray,
    certain: np.ndarray,
    new: np.ndarray,
    positions: np.ndarray,
) -> int:
    _invert(param, exp_avg, exp_avg_sq, k, f, words, certain)
    size = param.shape[0]
    send = np.zeros((size + 7) // 8 * 8, dtype=np.bool_)
    for i in range(size):  # vectorized: no loop-carried state
        nw = _new_word(param[i])
        new[i] = nw
        send[i] = (words[i] != nw) | (not certain[i])
    n = 0
    lanes = send.view(np.uint64)  # 8 flags at a time: most are all zero
    for j in range(lanes.shape[0]):
        if lanes[j] != 0:
            for i in range(8 * j, 8 * j + 8):
                if send[i]:
                    positions[n] = i
                    n += 1
    return n


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _cast(src: np.ndarray, out: np.ndarray) -> None:
    for i in range(src.shape[0]):  # vectorized
        out[i] = _new_word(src[i])


#: Adler-32's modulus, and the most words (2 bytes each) summed before reducing it
#: (zlib's NMAX: 5552 bytes keep the 32-bit sums from overflowing; here 64-bit sums).
_MOD = 65521
_SPAN = 2776


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _cast_adler(src: np.ndarray, out: np.ndarray, value: np.int64) -> Any:
    a = value & 0xFFFF
    b = (value >> 16) & 0xFFFF
    size = src.shape[0]
    for i in range(size):  # vectorized
        out[i] = _new_word(src[i])
    for start in range(0, size, _SPAN):
        stop = min(start + _SPAN, size)
        nbytes = 2 * (stop - start)
        # 32-bit sums cannot overflow over a span (sb < 2776 * 5552 * 255 < 2**32)
        sa = np.uint32(0)
        sj = np.uint32(0)
        sh = np.uint32(0)
        span = out[start:stop]
        for j in range(stop - start):  # vectorized: plain sums
            w = np.uint32(span[j])
            t = (w & np.uint32(0xFF)) + (w >> np.uint32(8))
            sa += t
            sj += np.uint32(j) * t
            sh += w >> np.uint32(8)
        # sum over bytes of (bytes left) * byte: word j's low byte has nbytes - 2j left,
        # its high byte one less (sj < 2776 * 2776 * 510 < 2**32)
        sb = np.int64(nbytes) * np.int64(sa) - 2 * np.int64(sj) - np.int64(sh)
        b = (b + nbytes * a + sb) % _MOD
        a = (a + np.int64(sa)) % _MOD
    return (b << 16) | a


def cast_adler(src: np.ndarray, out: np.ndarray, value: int = 1) -> int:
    """:func:`bf16_cast` into ``out`` and, in the same pass, the Adler-32 of the words'
    little-endian bytes continuing from ``value`` (as ``zlib.adler32(words, value)``).
    Returns the Adler-32; the words are ``out[:len(src)]``."""
    words = bf16_cast(src[:0], out)  # checks out
    del words
    (p,) = _inputs(src)
    if out.shape[0] < p.shape[0]:
        raise ValueError(f"out holds {out.shape[0]} words, fewer than {p.shape[0]}")
    return int(_cast_adler(p, out[: p.shape[0]], np.int64(value & 0xFFFFFFFF)))


def bf16_cast(src: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """bf16 words (``<u2``) of a 1-D float32 array, as
    :func:`~deltastore.publish.reconstruct.bf16_words` (round to nearest even, NaN ->
    0x7FC0), in one vectorized pass on the calling thread. ``out``: a 1-D contiguous ``<u2``
    buffer of at least ``src``'s length to write into (the result is a view of its first
    elements)."""
    (p,) = _inputs(src)
    if out is None:
        words = np.empty(p.shape[0], dtype="<u2")
    elif (
        out.dtype != np.dtype("<u2")
        or out.ndim != 1
        or out.shape[0] < p.shape[0]
        or not out.flags.c_contiguous
        or not out.flags.writeable
    ):
        raise ValueError(
            f"out must be a writable contiguous 1-D <u2 array of at least {p.shape[0]} "
            f"elements (got {out.dtype} {out.shape})"
        )
    else:
        words = out[: p.shape[0]]
    _cast(p, words)
    return words


def _scalars(coef: Coefficients) -> np.ndarray:
    """The float64 scalars of the reference, computed by the same Python expressions."""
    d = coef.decay
    alpha = coef.step_size
    floor_k = TINY * max(1.0, 1.0 / alpha) if alpha > 0 else math.inf
    floor_min = TINY / alpha if alpha > 0 else math.inf
    return np.array(
        [
            alpha,
            coef.bc2_sqrt,
            coef.eps,
            d,
            floor_k,
            floor_min,
            SAFETY * (U32 + G64) / d,
            SAFETY * (coef.update_rel + G64) / d,
            SAFETY * (coef.weight_rel + G64),
            TINY / d,
        ],
        dtype=np.float64,
    )


#: Elements below which a call runs on the calling thread alone.
MIN_PART = 1 << 16
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def default_threads() -> int:
    """Threads a call splits its chunk across by default: the CPUs this process may run on
    (the publish runs between optimizer steps, when the trainer's cores are idle), at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def _parts(size: int, threads: int | None) -> list[tuple[int, int]]:
    if threads is None:  # a worker thread's caller already runs chunks in parallel
        main = threading.current_thread() is threading.main_thread()
        threads = default_threads() if main else 1
    count = max(1, min(threads, size // MIN_PART))
    bounds = [size * i // count for i in range(count + 1)]
    return list(itertools.pairwise(bounds))


def _run(parts: list[tuple[int, int]], work: Any) -> list[Any]:
    """``work(start, stop)`` for every part: the first on this thread, the others on the
    module's pool (the kernels release the GIL)."""
    global _pool
    if len(parts) == 1:
        return [work(*parts[0])]
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(default_threads(), thread_name_prefix="invert-kernel")
        pool = _pool
    futures = [pool.submit(work, a, b) for a, b in parts[1:]]
    first = work(*parts[0])
    return [first, *(f.result() for f in futures)]


def _scalars32(k: np.ndarray) -> np.ndarray:
    """The fast path's float32 scalars: 1/c, eps, alpha, 1/d, kp, ku, kx, floor_k, floor_min
    (each rounded once from the float64 values of :func:`_scalars`; an infinite one sends
    every element to the exact path)."""
    alpha, c, eps, d, floor_k, floor_min, kp, ku, kx = (float(v) for v in k[:9])
    values = [1.0 / c, eps, alpha, 1.0 / d, kp, ku, kx, floor_k, floor_min]
    with np.errstate(over="ignore"):
        return np.array(values, dtype=np.float64).astype(np.float32)


def _inputs(*arrays: np.ndarray) -> list[np.ndarray]:
    out = [np.ascontiguousarray(a, dtype=np.float32).reshape(-1) for a in arrays]
    if len({a.shape[0] for a in out}) != 1:
        raise ValueError(
            "param, exp_avg and exp_avg_sq must have the same length "
            f"(got {[a.shape[0] for a in out]})"
        )
    return out


def invert_chunk(
    param: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    coef: Coefficients,
    threads: int | None = None,
    out: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Previous bf16 words (``<u2``) and the certain mask (bool) of one chunk: bit-identical
    to :func:`deltastore.publish.reconstruct.invert_chunk` (same arguments). ``threads``:
    split the chunk across this many threads (parts of at least :data:`MIN_PART` elements;
    default: :func:`default_threads` when called from the main thread, 1 from any other, whose
    caller is taken to run chunks in parallel already: nested splits only wait on each
    other). ``out``: buffers to write into (``<u2`` and bool, 1-D, contiguous, at least the
    chunk's length; the results are views of their first elements), e.g. one pair per thread
    reused from chunk to chunk: a thread that allocates and frees chunk-sized buffers grows
    its allocator arena (docs/performance.md, Measured limits and pitfalls). Memory: the two
    outputs (3 bytes per element), none with ``out``."""
    p, m, v = _inputs(param, exp_avg, exp_avg_sq)
    if out is None:
        words = np.empty(p.shape[0], dtype="<u2")
        certain = np.empty(p.shape[0], dtype=np.bool_)
    else:
        words, certain = _out(out, p.shape[0])
    k = _scalars(coef)
    f = _scalars32(k)

    def work(a: int, b: int) -> None:
        _invert(p[a:b], m[a:b], v[a:b], k, f, words[a:b], certain[a:b])

    _run(_parts(p.shape[0], threads), work)
    return words, certain


def _out(out: tuple[np.ndarray, np.ndarray], size: int) -> tuple[np.ndarray, np.ndarray]:
    words, certain = out
    for buf, dtype in ((words, np.dtype("<u2")), (certain, np.dtype(np.bool_))):
        if buf.dtype != dtype or buf.ndim != 1 or buf.shape[0] < size:
            raise ValueError(
                f"out must be a 1-D <u2 array and a 1-D bool array of at least {size} "
                f"elements (got {buf.dtype} {buf.shape})"
            )
        if not buf.flags.c_contiguous or not buf.flags.writeable:
            raise ValueError("out buffers must be contiguous and writable")
    return words[:size], certain[:size]


def invert_and_diff(
    param: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    coef: Coefficients,
    threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`invert_chunk` plus, in the same pass, the new words and what to send.

    Returns ``(old, certain, new, positions)``: ``old`` and ``certain`` as
    :func:`invert_chunk` (``threads`` too); ``new``: ``<u2`` bf16 words of ``param`` (round
    to nearest even, NaN -> 0x7FC0, as :func:`~deltastore.publish.reconstruct.bf16_words`);
    ``positions``: int64 ascending chunk-local positions where ``old != new`` or not
    ``certain`` (a certain one goes out as the XOR ``old ^ new``, an uncertain one as the
    absolute ``new``). Memory: 14 bytes per element of the chunk (``positions`` is a view of
    a chunk-sized buffer)."""
    p, m, v = _inputs(param, exp_avg, exp_avg_sq)
    size = p.shape[0]
    old = np.empty(size, dtype="<u2")
    certain = np.empty(size, dtype=np.bool_)
    new = np.empty(size, dtype="<u2")
    positions = np.empty(size, dtype=np.int64)
    k = _scalars(coef)
    f = _scalars32(k)

    def work(a: int, b: int) -> np.ndarray:
        out = positions[a:b]
        n = int(_invert_diff(p[a:b], m[a:b], v[a:b], k, f, old[a:b], certain[a:b], new[a:b], out))
        out[:n] += a
        return out[:n]

    found = _run(_parts(size, threads), work)
    return old, certain, new, found[0] if len(found) == 1 else np.concatenate(found)
