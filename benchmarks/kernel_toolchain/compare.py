"""numba against a C extension for the receiver's kernel: the same loop, timed on the same frame.

``stage.c`` is deltastore/kernels/apply.py's walk (decode an ``xor-sparse2`` frame, prefetch,
gather the old words a block at a time, Adler-32 sums) written in C for 2-byte words and int32
positions, compiled here with ``gcc -O3 -march=native`` (what a C extension built on this
machine would get at best). Both stage the same frame, 60 times at 60 offsets of a 480 MB
buffer (cold cache lines, as in a sync); the results must be identical.

    .venv/bin/python benchmarks/kernel_toolchain/compare.py [--json out.json]

Needs gcc; not part of the tests. The result decided docs/design/decisions.md ("Native
kernels: numba").
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from deltastore.format.codecs.v2 import FrameDecoder2, FrameEncoder2
from deltastore.kernels import apply as kernel

HERE = Path(__file__).parent
FRAMES, FRAME_ELEMENTS, CHANGES, REPEATS = 60, 4_000_000, 32_000, 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lib_path = Path(tmp) / "stage.so"
        flags = ["-O3", "-march=native", "-shared", "-fPIC"]
        subprocess.run(["gcc", *flags, "-o", str(lib_path), str(HERE / "stage.c")], check=True)
        lib = ctypes.CDLL(str(lib_path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.stage16.argtypes = [p, i64, i64, i64, i64, p, i64, p, p, p]
    rng = np.random.default_rng(1)
    n = FRAME_ELEMENTS
    words = rng.integers(0, 2**16, size=FRAMES * n, dtype=np.uint16)
    pos = np.sort(rng.choice(n, CHANGES, replace=False))
    masks = rng.integers(1, 2**16, size=CHANGES, dtype=np.uint16)
    data = FrameEncoder2().xor_sparse2(pos, masks)
    raw, k, e, low = FrameDecoder2().sparse2_content(data, n, 2, CHANGES)
    src = np.frombuffer(raw, np.uint8)
    c_pos, c_masks, c_sums = np.empty(k, np.int32), np.empty(k, np.uint16), np.zeros(3, np.int64)
    t0 = time.perf_counter()
    kernel.stage_sparse2(raw, k, e, low, n, words, 0, words.nbytes)
    first_call = time.perf_counter() - t0
    numba_ns, c_ns = [], []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for f in range(FRAMES):
            kernel.stage_sparse2(raw, k, e, low, n, words, f * n, words.nbytes)
        t1 = time.perf_counter()
        for f in range(FRAMES):
            lib.stage16(
                src.ctypes.data, k, e, low, n, words.ctypes.data, f * n,
                c_pos.ctypes.data, c_masks.ctypes.data, c_sums.ctypes.data,
            )  # fmt: skip
        t2 = time.perf_counter()
        numba_ns.append((t1 - t0) / FRAMES / k * 1e9)
        c_ns.append((t2 - t1) / FRAMES / k * 1e9)
    _, got_pos, got_masks, _ = kernel.stage_sparse2(
        raw, k, e, low, n, words, (FRAMES - 1) * n, words.nbytes
    )
    assert np.array_equal(got_pos, c_pos) and np.array_equal(got_masks, c_masks)
    result = {
        "changes_per_frame": k,
        "frames": FRAMES,
        "numba_ns_per_change": min(numba_ns),
        "c_gcc_O3_native_ns_per_change": min(c_ns),
        "numba_over_c": min(numba_ns) / min(c_ns),
        "numba_first_call_s": first_call,
        "all_ns": {"numba": numba_ns, "c": c_ns},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
