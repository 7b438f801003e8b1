"""Rendering a :class:`~deltastore.bench.schema.BenchResult`: a markdown report with the
strongest baselines, the floors and the bar checks; ``docs/performance.md`` generated from a
results JSON (:func:`performance_doc`); an optional PNG (matplotlib, the ``plot`` extra).

Command line::

    python -m deltastore.bench.report RESULTS.json                  # the report, to stdout
    python -m deltastore.bench.report A.json [B.json ...] --performance-doc docs/performance.md

Pure functions of the result (thread-safe), except :func:`plot` (matplotlib's global state).
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from deltastore.bench.analysis import holds
from deltastore.bench.schema import BASELINES, SCHEMA_VERSION, BenchResult, StoreResult
from deltastore.bench.trainer_report import (
    is_trainer_json,
    trainer_command,
    trainer_left,
    trainer_markdown,
    trainer_summary,
)
from deltastore.bench.trainer_schema import TrainerResult

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


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x" if v < 100 else f"{v:.0f}x"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _measured(value: float | None, op: str, threshold: float) -> str:
    """The measured value with enough decimals that its rounding does not flip the check."""
    if value is None:
        return "-"
    for digits in range(3, 8):
        text = f"{value:.{digits}f}"
        if holds(float(text), op, threshold) == holds(value, op, threshold):
            return text
    return repr(value)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


_HEAD = [
    "system",
    "payload",
    "B/changed",
    "publish s",
    "detect",
    "encode",
    "upload",
    "sync s",
    "fetch",
    "decode",
    "verify",
    "pause",
    "pub RSS+",
    "sub RSS+",
    "exact",
]


def _systems_table(s: StoreResult) -> list[str]:
    rows = []
    for name, r in s.systems.items():
        m, p, y = r.median, r.median.publish, r.median.sync
        rows.append(
            [
                name,
                _bytes(p.payload_bytes),
                f"{m.bytes_per_changed:.3f}",
                f"{p.total_s:.3f}",
                f"{p.detect_s:.3f}",
                f"{p.encode_s:.3f}",
                f"{p.upload_s:.3f}",
                f"{y.total_s:.3f}",
                f"{y.fetch_s:.3f}",
                f"{y.decode_s:.3f}",
                f"{y.verify_s:.3f}",
                f"{y.pause_s:.3f}",
                f"{_bytes(m.publisher_rss_extra_bytes)} ({_pct(m.publisher_rss_extra_fraction)})",
                f"{_bytes(m.subscriber_rss_extra_bytes)} ({_pct(m.subscriber_rss_extra_fraction)})",
                "yes" if r.exact else "NO",
            ]
        )
    return _table(_HEAD, rows)


def _methods_table(s: StoreResult) -> list[str]:
    """How each system publishes and loads; every method of a receiver that times several,
    the one reported marked."""
    rows = []
    for name, r in s.systems.items():
        if r.methods:
            loads = ", ".join(
                f"{'**' if m == r.method else ''}{m}{'**' if m == r.method else ''} "
                f"{res.median.total_s:.3f} s" + ("" if res.exact else " (NOT EXACT)")
                for m, res in r.methods.items()
            )
        else:
            loads = r.method
        use = (
            "ratios, bar" if name in BASELINES else "reported only" if name != "deltastore" else "-"
        )
        rows.append([name, r.publish_method, loads, use])
    return _table(["system", "publish", "sync methods (median s)", "compared in"], rows)


def _floors_table(s: StoreResult) -> list[str]:
    ds = s.systems.get("deltastore")
    if ds is None:
        return []
    rows = []
    if s.detect_bound_median_s is not None:
        rows.append(
            [
                "publish: chunked not_equal + flatnonzero (exact detect)",
                _s(s.detect_bound_median_s),
                f"publish {ds.median.publish.total_s:.3f}",
                _x(s.publish_bound_ratio),
            ]
        )
    fl = s.floors
    if fl is not None:
        parts = [
            statistics.median(getattr(f, k) for f in fl.samples)
            for k in ("decompress_s", "gather_s", "checksum_s", "scatter_s")
        ]
        rows.append(
            [
                "receiver: zstd decompress + gather + Adler-32 update + scatter "
                f"({' + '.join(f'{p:.3f}' for p in parts)})",
                _s(fl.receiver_floor_median_s),
                f"sync {ds.median.sync.total_s:.3f}",
                _x(fl.sync_floor_ratio),
            ]
        )
        rows.append(
            [
                "pause: one bare scatter",
                _s(fl.scatter_floor_median_s),
                f"pause {ds.median.sync.pause_s:.3f}",
                _x(fl.pause_floor_ratio),
            ]
        )
    return _table(
        ["floor (medians; parts: medians each)", "floor s", "deltastore s", "ratio"], rows
    )


def _requests_table(s: StoreResult) -> list[str]:
    """Store requests per operation (medians) and how many ran one after the other."""
    rows = []
    for name, r in s.systems.items():
        y, p = r.median.sync, r.median.publish
        if y.requests is None:
            continue
        rows.append(
            [
                name,
                f"{y.requests} / {y.round_trips}",
                "-" if p.requests is None else f"{p.requests} / {p.round_trips}",
                "-" if p.commit_round_trips is None else str(p.commit_round_trips),
                "-" if r.poll_requests is None else f"{r.poll_requests} / {r.poll_round_trips}",
            ]
        )
    if not rows:
        return []
    head = ["system", "sync: requests / round trips", "publish", "after the data", "poll"]
    return _table(head, rows)


def _link_line(s: StoreResult) -> list[str]:
    """The shaped link and the floors it sets, beside the measured medians."""
    if s.link is None:
        return []
    k = s.link
    dense, ds = s.systems.get("dense"), s.systems.get("deltastore")
    parts = [
        f"Through the shaped link `{k.name}`: {k.latency_s * 1e3:g} ms per request, "
        f"{k.conn_bits_per_s / 1e9:g} Gbit/s per connection and {k.total_bits_per_s / 1e9:g} "
        "Gbit/s in total, each way."
    ]
    if dense is not None:
        t = dense.median.sync.total_s
        parts.append(
            f"Its floor for dense (one request, the model's bytes): {k.dense_floor_s:.2f} s; "
            f"dense took {t:.2f} s ({t / k.dense_floor_s:.2f}x its floor)."
        )
    if ds is not None and k.deltastore_floor_s is not None:
        t = ds.median.sync.total_s
        parts.append(
            "Its floor for deltastore (two requests one after the other, the payload): "
            f"{k.deltastore_floor_s:.3f} s; deltastore took {t:.3f} s "
            f"({t / k.deltastore_floor_s:.2f}x its floor, the receiver's own work included)."
        )
    return [" ".join(parts), ""]


def _store_section(s: StoreResult) -> list[str]:
    out = [f"### Store: {s.store}", "", *_link_line(s), *_systems_table(s), ""]
    out += [*_methods_table(s), ""]
    requests = _requests_table(s)
    if requests:
        out += [*requests, ""]
    dense = s.systems.get("dense")
    if dense is not None:
        out += [
            f"Strongest dense: `{dense.method}` (the fastest by median sync of the methods "
            f"timed), published by `{dense.publish_method}`. Every ratio and bar point uses it"
            + ("; `dense-naive` is reported only." if "dense-naive" in s.systems else ".")
            + "",
            "",
        ]
    floors = _floors_table(s)
    if floors:
        out += [*floors, ""]
    notes = []
    if s.pause_fraction is not None:
        notes.append(f"deltastore pause / sync {_pct(s.pause_fraction)}")
    if s.anchor_bytes is not None:
        notes.append(
            f"anchor {_bytes(s.anchor_bytes)} stored = {_pct(s.anchor_fraction)} of dense bf16"
        )
    if notes:
        line = "; ".join(notes)
        out += [line[0].upper() + line[1:] + ".", ""]
    if s.ratios:
        rows = [
            [
                f"{b} / deltastore",
                _x(r.payload),
                _x(r.publish),
                _x(r.sync),
                _x(r.publisher_rss),
                _x(r.subscriber_rss),
            ]
            for b, r in s.ratios.items()
        ]
        out += _table(["ratio", "payload", "publish", "sync", "pub RSS+", "sub RSS+"], rows)
        out.append("")
    return out


def _machine(result: BenchResult) -> str:
    m = result.machine
    return (
        f"{m.cpu_model}, {m.cores} cores, {_bytes(m.memory_bytes)} RAM, {m.platform}; "
        f"python {m.python}, torch {m.torch}, numpy {m.numpy}, zstandard {m.zstandard}, "
        f"safetensors {m.safetensors}, deltastore {m.deltastore}"
    )


def _bar_table(result: BenchResult) -> list[str]:
    rows = [
        [
            b.name,
            b.store or "-",
            _measured(b.measured, b.op, b.threshold),
            f"{b.op} {b.threshold:g}",
            {"pass": "pass", "fail": "FAIL"}.get(b.status, b.status),
        ]
        for b in result.bars
    ]
    return _table(["check", "store", "measured", "bar", "result"], rows)


def markdown(result: BenchResult, level: int = 2) -> str:
    """The report: workload, per store the systems, methods, floors and ratios, scaling and
    the bar checks. ``level``: the heading level of its title (sections one deeper)."""
    w = result.workload
    h, hh = "#" * level, "#" * (level + 1)
    changed = ", ".join(_pct(f) for f in w.changed_fraction)
    out = [
        f"{h} deltastore bench: {w.size}, {w.elements / 1e6:.0f}M bf16 elements "
        f"({_bytes(w.dense_bytes)}), lr {w.lr:g}, {w.versions} measured versions",
        "",
        f"Changed per version: {changed}. Machine: {_machine(result)}. {result.created}, "
        f"wall {result.wall_s:.0f} s. Medians over the measured versions; times in seconds; "
        "RSS+ is peak extra resident memory (share of the model's bytes).",
        "",
    ]
    for s in result.stores:
        out += [line.replace("### ", hh + " ", 1) for line in _store_section(s)]
    for line in result.skipped:
        out += [f"Skipped store {line}", ""]
    sc = result.scaling
    if sc is not None:
        line = (
            f"deltastore sync of {sc.changed_elements} changed elements (store {sc.store}): "
            f"{sc.small.size} {sc.small.median_s:.3f} s"
        )
        if sc.target.size == sc.small.size:
            line += " (the benchmarked size is small: nothing to compare, the check is n/a)."
        else:
            line += f", {sc.target.size} {sc.target.median_s:.3f} s, ratio {sc.ratio:.2f}."
        out += [f"{hh} Scaling", "", line, ""]
    out += [f"{hh} The bar", "", *_bar_table(result)]
    out += ["", "All receivers bit-exact." if result.exact else "MISMATCH: some receiver differs."]
    return "\n".join(out) + "\n"


def _link(target: str | os.PathLike[str], doc: str | os.PathLike[str]) -> str:
    """``target`` as a relative link from the folder of ``doc``."""
    return Path(os.path.relpath(Path(target).resolve(), Path(doc).resolve().parent)).as_posix()


def _summary(result: BenchResult) -> list[str]:
    """One line per store: the headline numbers against the strongest baselines and floors."""
    out = []
    for s in result.stores:
        ds, dense = s.systems.get("deltastore"), s.systems.get("dense")
        if ds is None:
            continue
        parts = [f"sync {ds.median.sync.total_s:.3f} s"]
        if dense is not None and "dense" in s.ratios:
            parts.append(
                f"strongest dense (`{dense.method}`) {dense.median.sync.total_s:.3f} s, "
                f"dense / deltastore {_x(s.ratios['dense'].sync)}"
            )
        if s.link is not None and s.link.deltastore_floor_s:
            t = ds.median.sync.total_s
            parts.append(
                f"sync / the link's floor ({s.link.deltastore_floor_s:.3f} s) "
                f"{_x(t / s.link.deltastore_floor_s)}"
            )
        if ds.median.sync.round_trips is not None:
            parts.append(
                f"{ds.median.sync.round_trips} round trips per sync, "
                f"{ds.poll_requests} request{'' if ds.poll_requests == 1 else 's'} per poll"
            )
        if s.floors is not None:
            parts.append(f"sync / receiver floor {_x(s.floors.sync_floor_ratio)}")
            parts.append(f"pause / scatter floor {_x(s.floors.pause_floor_ratio)}")
        parts.append(f"publish / detect floor {_x(s.publish_bound_ratio)}")
        out.append(f"- **{s.store}**: " + "; ".join(parts) + ".")
    passed = sum(b.status == "pass" for b in result.bars)
    na = sum(b.status == "n/a" for b in result.bars)
    counted = len(result.bars) - na
    na_text = f"; {na} not applicable to this run" if na else ""
    out.append(f"- The bar: {passed} of {counted} checks pass ({_failing(result)}{na_text}).")
    return out


def _failing(result: BenchResult) -> str:
    failed = [
        f"{b.name}" + (f" ({b.store})" if b.store else "")
        for b in result.bars
        if b.status == "fail"
    ]
    return "failing: " + ", ".join(failed) if failed else "none fails"


def _left(result: BenchResult) -> list[str]:
    """One line per failing check: what was measured against which bar."""
    out = [
        f"- **{b.name}**{f' ({b.store})' if b.store else ''}: "
        f"{_measured(b.measured, b.op, b.threshold)}, bar {b.op} {b.threshold:g} ({b.what})."
        for b in result.bars
        if b.status == "fail"
    ]
    if not result.exact:
        out.append("- **bit-exactness**: some receiver differs from the workload.")
    return out or ["Every check of the bar passes."]


def _command(result: BenchResult, source: str | os.PathLike[str]) -> str:
    """The ``deltastore bench`` command line of a run."""
    stores = ",".join(s.store.split("+", 1)[0] for s in result.stores)
    links = {s.link.name for s in result.stores if s.link is not None}
    link = f" --link {links.pop()}" if links else ""
    return (
        f".venv/bin/deltastore bench --size {result.workload.size} --store {stores}{link} "
        f"--json {Path(source).as_posix()}"
    )


def _label(result: BenchResult) -> str:
    """A run's name on the page: its size and how its object stores were reached."""
    links = sorted({s.link.name for s in result.stores if s.link is not None})
    how = f"through the `{', '.join(links)}` link" if links else "loopback"
    return f"{result.workload.size}, {how}"


def performance_doc(
    runs: Sequence[tuple[BenchResult, str | os.PathLike[str]]],
    doc: str | os.PathLike[str] = "docs/performance.md",
    trainers: Sequence[tuple[TrainerResult, str | os.PathLike[str]]] = (),
) -> str:
    """``docs/performance.md`` from results JSONs, each a ``(result, path)``: where the numbers
    come from, a summary, what is left, each run's full report (every system, the strongest
    baselines named, the floors, ratios, each check; a run through a shaped link beside the
    loopback one), the machines, and the measured limits the code rests on. ``trainers``:
    trainer-in-the-loop runs (``--mode trainer``), each with its summary, what is left and its
    report. Links are relative to ``doc``, the path the page is written to."""
    if not runs:
        raise ValueError("performance_doc needs at least one run")
    readme = _link(Path(__file__).resolve().parents[2] / "benchmarks" / "README.md", doc)
    sources = " ".join(Path(src).as_posix() for _, src in [*runs, *trainers])
    listed = [
        f"- {_label(r)}: `deltastore bench --size {r.workload.size}`, {r.workload.versions} "
        f"AdamW versions of a {r.workload.elements / 1e6:.0f}M-element bf16 model, "
        f"[{Path(src).name}]({_link(src, doc)}) (schema version {r.schema_version}, "
        f"{r.created[:10]}); machine: {_machine(r)}."
        for r, src in runs
    ] + [
        f"- trainer in the loop, {t.size}, AdamW {t.optimizer}: `deltastore bench --mode "
        f"trainer --optimizer {t.optimizer}`, {t.versions} "
        f"AdamW {t.optimizer} steps of a {t.elements / 1e6:.0f}M-parameter fp32 trainer, each "
        f"followed by a publish, [{Path(src).name}]({_link(src, doc)}) ({t.created[:10]})."
        for t, src in trainers
    ]
    out = [
        "# Performance",
        "",
        "<!-- Generated by `python -m deltastore.bench.report "
        f"{sources} --performance-doc {Path(doc).as_posix()}`; do not edit by hand. -->",
        "",
        "Every number on this page comes from the committed results JSONs of these runs of "
        "`deltastore bench`, and nothing else: method, workload, systems, floors, the shaped "
        f"link and every field are described in [benchmarks/README.md]({readme}). Within a run, "
        "all systems ran on the same versions through the same stores, each publisher and "
        "subscriber in a process of its own; every ratio is from one run.",
        "",
        *listed,
        "",
        "Regenerate after new runs:",
        "",
        "```sh",
        *[_command(r, src) for r, src in runs],
        *[trainer_command(t, src) for t, src in trainers],
        f".venv/bin/python -m deltastore.bench.report {sources} "
        f"--performance-doc {Path(doc).as_posix()}",
        "```",
        "",
        "## Summary",
        "",
    ]
    for r, _ in runs:
        out += [f"### {_label(r)}", "", *_summary(r), ""]
    for t, _ in trainers:
        out += [f"### trainer in the loop, {t.size}, AdamW {t.optimizer}", ""]
        out += [*trainer_summary(t), ""]
    out += ["## What is left", ""]
    for r, _ in runs:
        out += [f"### {_label(r)}", "", *_left(r), ""]
    for t, _ in trainers:
        left = trainer_left(t) or ["Every check of the trainer bar passes."]
        out += [f"### trainer in the loop, {t.size}, AdamW {t.optimizer}", "", *left, ""]
    for r, _ in runs:
        out += [f"## Results: {_label(r)} ({r.created[:10]})", ""]
        out += [markdown(r, level=3).rstrip("\n"), ""]
    for t, _ in trainers:
        out += [
            f"## Results: trainer in the loop, {t.size}, AdamW {t.optimizer} ({t.created[:10]})",
            "",
        ]
        out += [trainer_markdown(t, level=3).rstrip("\n"), ""]
    out += ["## Measured limits and pitfalls", "", LIMITS_AND_PITFALLS.strip(), ""]
    return "\n".join(out)


# --- plot ----------------------------------------------------------------------------------


class PlotUnavailable(ImportError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'deltastore[plot]'") from None
    return plt


def check_plot() -> None:
    """Raise :class:`PlotUnavailable` now rather than after a long run."""
    _pyplot()


def plot(result: BenchResult, path: str | os.PathLike[str]) -> None:
    """A PNG: median payload per system, then per store the median publish and sync times."""
    plt = _pyplot()
    stores = result.stores
    fig, axes = plt.subplots(1, 1 + len(stores), figsize=(5 * (1 + len(stores)), 4.5))
    axes = list(axes) if len(stores) else [axes]
    if stores:
        first = stores[0].systems
        axes[0].bar(list(first), [r.median.publish.payload_bytes for r in first.values()])
    axes[0].set_yscale("log")
    axes[0].set_title("payload per version (bytes)")
    for ax, s in zip(axes[1:], stores, strict=True):
        names = list(s.systems)
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [r.median.publish.total_s for r in s.systems.values()], 0.4)
        ax.bar([x + 0.2 for x in xs], [r.median.sync.total_s for r in s.systems.values()], 0.4)
        ax.set_xticks(list(xs), names)
        ax.set_yscale("log")
        ax.legend(["publish", "sync"])
        ax.set_title(f"seconds per version, store {s.store}")
    w = result.workload
    fig.suptitle(f"deltastore bench: {w.size} ({w.elements / 1e6:.0f}M elements), lr {w.lr:g}")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)


# --- command line --------------------------------------------------------------------------


def load_result(path: str | os.PathLike[str]) -> BenchResult:
    """A results JSON; :class:`ValueError` naming the schema version when it is not one this
    code reads."""
    raw = Path(path).read_text()
    try:
        return BenchResult.model_validate_json(raw)
    except ValidationError as exc:
        raise ValueError(
            f"{path} is not a results JSON of schema version {SCHEMA_VERSION} "
            f"(deltastore bench --json writes one): {exc.error_count()} errors, "
            f"first: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m deltastore.bench.report RESULTS.json [...] [--performance-doc PATH]``."""
    parser = argparse.ArgumentParser(
        prog="python -m deltastore.bench.report",
        description="Render a deltastore bench results JSON: the markdown report to stdout, "
        "or docs/performance.md generated from it.",
    )
    parser.add_argument(
        "results", type=Path, nargs="+", help="results JSONs (deltastore bench --json)"
    )
    parser.add_argument(
        "--performance-doc",
        type=Path,
        metavar="PATH",
        help="write the performance page (e.g. docs/performance.md) from every results JSON "
        "given, in order, instead of printing the reports",
    )
    args = parser.parse_args(argv)
    try:
        trainers = [(load_trainer_result(p), p) for p in args.results if _is_trainer(p)]
        runs = [(load_result(p), p) for p in args.results if not _is_trainer(p)]
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.performance_doc is None:
        texts = [markdown(r) for r, _ in runs] + [trainer_markdown(t) for t, _ in trainers]
        sys.stdout.write("\n".join(texts))
    else:
        args.performance_doc.write_text(performance_doc(runs, args.performance_doc, trainers))
    return 0


def _is_trainer(path: Path) -> bool:
    return path.is_file() and is_trainer_json(path.read_text())


def load_trainer_result(path: str | os.PathLike[str]) -> TrainerResult:
    """A trainer-in-the-loop results JSON (``deltastore bench --mode trainer --json``)."""
    try:
        return TrainerResult.model_validate_json(Path(path).read_text())
    except ValidationError as exc:
        raise ValueError(
            f"{path} is not a trainer results JSON of schema version 1: "
            f"{exc.error_count()} errors, first: {exc.errors()[0]['loc']}: "
            f"{exc.errors()[0]['msg']}"
        ) from None


if __name__ == "__main__":
    raise SystemExit(main())
