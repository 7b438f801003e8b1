"""The static last section of docs/performance.md, "Measured limits and pitfalls": measured
facts the code's choices rest on (the code cites that section). Not from a results JSON;
:func:`deltastore.bench.report.performance_doc` appends it to the page."""

from __future__ import annotations

#: The last section of docs/performance.md: measured facts the code's choices rest on (the
#: code cites this section); static text, not from the results JSON.
LIMITS_AND_PITFALLS = """
What the code's hot paths are built around, measured on the 2-core development machines (numpy,
torch CPU). The code cites this section where a choice follows from one of these numbers.

Limits of the machine, for reading the results above:

| operation | measured |
|---|---|
| read (page cache) | ~32 GB/s |
| copy into a preallocated buffer | 13-17 GB/s |
| a fresh 2 GB allocation (page faults) | 0.4-2 GB/s |
| chunked `np.not_equal` + `flatnonzero` (exact change detection) | ~4.7 GB/s of model |
| zstd level 1 on a dense XOR buffer | ~2 GB/s |
| `xxh3_64` | 2 GB in ~0.07 s |
| AdamW step, 2 threads, 32 tensors of 1 Mi fp32 elements | foreach 4.3-5.7 ns/element, fused 0.57 |
| the same, foreach, on the 246M-parameter medium trainer | 0.82 s (3.3 ns per element) |
| float64 `sqrt` + three divisions per element (numba, AVX2, one core) | ~1.8 ns per element |
| fp32 to bf16 on one thread: numpy `bf16_words` / torch `.to` | 1.15 / 0.18 ns per element |

The strongest dense load and the receiver floors are measured in every run (the tables above);
the bar was set from 0.24-0.33 s for loading a 2 GB safetensors file from the page cache into
existing tensors (a naive whole-object read, parse and copy: 3.5 s) and ~0.15 s on one core
for the receiver floor of 8M changes.

Payload floor: at density `p` with +-1 ulp changes, a position carries about
`log2(1/p) + 1.44` bits and the change about 1 bit, ~1.2 bytes per change at `p` = 0.8%. Real
fine-tuned weights change 0.5-1% of their bf16 elements per step at lr 1e-6, sparser as
training goes on.

Pitfalls, and what the code does instead:

- `np.flatnonzero` on an int16 array is several times slower than on a bool array (7x on the
  development machines, 2.7x on 33M words in December 2026): compare into a reused bool buffer
  (`np.not_equal(a, b, out=buf)`), then `flatnonzero` (`publish/encode.py`, `bench/ops.py`).
  `torch.nonzero` is slower than numpy's on 2 cores.
- Compare bf16 through integer views (`t.view(torch.int16).numpy()`), never as floats: float
  comparison says -0.0 == +0.0 and NaN != NaN, and both must round-trip bit-exact.
- `scatter_` on bf16 is 20-70x slower than `index_copy_`: `tensors/words.py` uses
  `index_select` and `index_copy_` off the CPU, and numpy indexing with int64 indices on it
  (int32 indices are ~2x slower: numpy converts them first). The receiver floors use the same
  int64 numpy indexing.
- Fresh multi-GB allocations cost more than the comparison itself: work in bounded chunks
  (~16 MiB) and reuse buffers; the benchmark touches its buffers before timing anything.
- zstandard: one-shot `decompress()` needs the content size in the frame header (`compress()`
  writes it, `compressobj` does not) and allocates a new buffer each time; `stream_reader(...)`
  `.readinto` a reused buffer is 3-5x faster on large frames (on a version's small sparse
  frames both took the same time, so the receiver floor uses one-shot `decompress()`). One
  frame decodes on one thread; independent frames decode in parallel on a thread pool (hence
  frames of at most `max_frame_bytes`). Output is capped by the size the manifest declares.
- Incremental Adler-32 in int64: reduce `(n - p) mod 65521` before multiplying, or it
  overflows (`format/checksum.py`).
- A full post-apply scrub of host-memory tensors is cheap (XXH3-64 above); the O(changed)
  Adler-32 is what makes verification possible *before* writing, and on GPUs.
- `safetensors` `load_file` is lazy (mmap): it returns in milliseconds and whatever touches
  the tensors reads the file, so a dense baseline must copy the data out to be honest
  (`bench/dense.py`).
- torch's two-thread `copy_` on a busy 2-core machine waits on its thread pool: loading the
  small model (138 MB) with `load_file` + `copy_` took 0.07-1.2 s with two threads and
  0.035 s with one. The dense baseline also times `load_file` + `copy_` on one torch thread
  and reports its fastest method.
- glibc raises its mmap threshold (up to 32 MiB) once large buffers are freed, and each
  thread's arena then keeps the buffers that thread freed: after a foreach AdamW step (which
  frees ~1 GB of temporaries on the medium trainer) a publisher that allocates chunk-sized
  buffers on two worker threads grew the process by ~750 MiB that stayed resident, against a
  live peak of ~60 MiB (`deltastore bench --mode trainer`, the `none-live` run with
  `MALLOC_MMAP_THRESHOLD_=1048576`). Beside a fused step (no large temporaries) the same
  publisher stayed at 71 MiB but took 1.9 s instead of 1.2 s: its fresh buffers page-faulted
  on every publish. Reuse per-thread buffers across chunks instead of allocating them.
- numba compiles without fast-math and without FMA contraction by default, so a kernel can
  repeat numpy's float64 operations bit for bit; but LLVM may swap the operands of an `fadd`,
  and x86 returns the first operand's NaN: where NaN payloads matter, select the operand
  explicitly (`publish/invert_kernel.py`). Without `error_model="numpy"` a division checks for
  zero and raises, which also stops vectorization.
- moto is not S3: it serves a ranged GET by reading the whole object and slicing it, under a
  per-object lock, so through moto the dense baseline's 8 ranged GETs read the object 8 times
  or more and one whole-object GET is faster (on S3, ranged GETs are the fast path). The
  benchmark times both and reports the faster.
- `torch.distributed` gloo supports `all_to_all_single` with split sizes (a variable-size
  exchange), not `all_to_all` with lists of differently sized tensors (`sync/group.py`).

Emulator and service pitfalls of the store backends are in [stores.md](stores.md).
"""
