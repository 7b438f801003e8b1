"""``deltastore bench --mode sharded``: the memory of a sharded publish, per rank and density.

``world`` shard writers (:class:`~deltastore.ShardWriter`, ``snapshot="memory"``), one
process each (spawn: a rank's memory is its own, as in a trainer), hold dim-0 row shards of the
bench's model in bf16 (``ceil(rows / world)`` rows per rank, as FSDP2's ``Shard(0)`` cuts
them; norms normal(1, 0.02), others normal(0, 0.02), seeded per rank). Version 0 is an anchor;
then, per density ``d`` of :attr:`ShardedOptions.densities`, ``repeats`` versions measured by
RSS and as many by tracemalloc (:class:`~deltastore.bench.sharded_schema.ShardedSample` says
how), each after changing ``d`` of every rank's elements (seeded; each changed bf16 word moves
by 1 to 3 units of its last place, as a small optimizer step does). The ranks start each
version together (a barrier), rank 0 commits it (``commit_parts``), every rank finishes it.
A :class:`~deltastore.Subscriber` then checks the last version bit for bit against every
rank's rows.

The bar: per rank and density, the peak over the snapshot at most :data:`PEAK_RATIO_MAX` times
the shard's bf16 bytes (both measures are checked and reported; RSS counts what tracemalloc
cannot see, and at small shards the allocator's and threads' own memory too).

Not thread-safe; the bench process holds no model while the ranks run.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import multiprocessing
import os
import shutil
import tempfile
import time
import traceback
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from deltastore.bench.analysis import _check
from deltastore.bench.ops import RssMeter, digest, load_average, rss_bytes, stderr_log
from deltastore.bench.schema import BarCheck
from deltastore.bench.sharded_schema import (
    DensitySummary,
    RankRun,
    ShardedResult,
    ShardedSample,
)
from deltastore.testing.sizes import SIZES, ModelConfig

Log = Callable[[str], None]

#: The model of the report this bench answers: ~2.56M elements (~1.3M per rank of two).
FSDP_2_5M = ModelConfig(
    vocab=2250, hidden=256, layers=2, intermediate=704, heads=4, kv_heads=1, head_dim=64
)
#: Model sizes of this mode: :data:`FSDP_2_5M` and the bench's table.
SHARDED_SIZES: dict[str, ModelConfig] = {"fsdp-2.5m": FSDP_2_5M, **SIZES}
DEFAULT_DENSITIES = (0.01, 0.03, 0.65)
#: The bar: peak bytes over the snapshot / the shard's bf16 bytes, per rank and density.
PEAK_RATIO_MAX = 2.0

METHOD = (
    "one process per rank (spawn), versions started together (a barrier); before each "
    "version gc.collect() and malloc_trim(0); rss: VmHWM (reset through clear_refs) minus "
    "VmRSS on entry, over publish + commit (rank 0) + finish; traced: tracemalloc started on "
    "entry (numpy and Python allocations of the version only; not torch's, not zstd's "
    "contexts). The snapshot exists before a delta's version starts: neither counts it."
)


@dataclass
class ShardedOptions:
    """What :func:`run_sharded` runs. ``size``: a name of :data:`SHARDED_SIZES`;
    ``densities``: shares of every rank's elements changed per version, each in (0, 1];
    ``repeats``: versions per density and per measure; ``writer``: ShardWriter options
    (``max_frame_bytes``, ``max_workers``, ...); ``workdir``: where the store goes (default: a
    temporary folder); ``in_process``: run the ranks as threads of this process (tests: no
    process start-up; the memory numbers are then the whole process's and not meaningful)."""

    size: str = "fsdp-2.5m"
    world: int = 2
    densities: Sequence[float] = DEFAULT_DENSITIES
    repeats: int = 2
    seed: int = 0
    writer: dict[str, Any] = field(default_factory=dict)
    workdir: str | os.PathLike[str] | None = None
    verify: bool = True
    in_process: bool = False
    log: Log = field(default=stderr_log, repr=False)


# --- a rank -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankTask:
    rank: int
    world: int
    url: str
    size: str
    densities: tuple[float, ...]
    repeats: int
    seed: int
    writer: tuple[tuple[str, Any], ...]
    measure_memory: bool = True


def shard_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[a, b)`` of rank ``rank``: FSDP2's even split, ``ceil(rows / world)`` per rank."""
    per = -(-rows // world)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def build_shard(size: str, rank: int, world: int, seed: int) -> dict[str, tuple[torch.Tensor, Any]]:
    """Rank ``rank``'s rows of every tensor of the model as bf16, with their global shapes."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    out: dict[str, tuple[torch.Tensor, Any]] = {}
    for name, shape in SHARDED_SIZES[size].shapes().items():
        a, b = shard_rows(shape[0], rank, world)
        t = torch.empty((b - a, *shape[1:]), dtype=torch.float32)
        t.normal_(1.0 if "norm" in name else 0.0, 0.02, generator=gen)
        out[name] = (t.to(torch.bfloat16), (tuple(shape), a))
    return out


def perturb(tensors: Sequence[torch.Tensor], density: float, seed: int) -> None:
    """Change ``density`` of the elements of every tensor in place: each chosen bf16 word moves
    by +-1 to 3 (never 0: the element changes)."""
    rng = np.random.default_rng(seed)
    for t in tensors:
        words = t.reshape(-1).view(torch.int16).numpy()
        idx = np.flatnonzero(rng.random(words.size) < density)
        step = rng.integers(1, 4, size=idx.size, dtype=np.int16)
        step *= rng.choice(np.array([-1, 1], dtype=np.int16), size=idx.size)
        words[idx] += step


def _malloc_trim() -> None:
    """Give freed heap back to the system (glibc; a no-op elsewhere)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name).malloc_trim(0)


@dataclass
class _Window:
    """What one measured version recorded."""

    peak: int = 0
    publish_peak: int | None = None
    held: int | None = None
    times: dict[str, float] = field(default_factory=dict)


@contextlib.contextmanager
def _measured(how: str, on: bool) -> Iterator[_Window]:
    """Measure the block's memory by ``how`` (``rss`` or ``traced``); ``on`` False: time only."""
    win = _Window()
    if not on:
        yield win
        return
    if how == "traced":
        tracemalloc.start()
        try:
            yield win
            win.peak = max(win.peak, tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        return
    with RssMeter(0.005) as meter:
        yield win
    win.peak = meter.extra_bytes


def _traced_mark(win: _Window) -> None:
    """After ``publish`` in a traced window: its peak, what it left allocated; reset the peak."""
    if tracemalloc.is_tracing():
        current, peak = tracemalloc.get_traced_memory()
        win.publish_peak, win.held = peak, current
        win.peak = peak
        tracemalloc.reset_peak()


def run_rank(task: RankTask, barrier: Any) -> RankRun:
    """One rank's run (see the module docstring)."""
    from deltastore.publish.sharded import RowSlice, ShardWriter, commit_parts

    torch.set_num_threads(1)
    baseline = rss_bytes()
    shard = build_shard(task.size, task.rank, task.world, task.seed)
    slices = {n: RowSlice(t, shape, a) for n, (t, (shape, a)) in shard.items()}
    numel = sum(t.numel() for t, _ in shard.values())
    writer = ShardWriter(task.url, task.rank, task.world, **dict(task.writer))
    samples: list[ShardedSample] = []

    def version(v: int, density: float | None, how: Literal["rss", "traced"]) -> None:
        gc.collect()
        _malloc_trim()
        barrier.wait()
        with _measured(how, task.measure_memory) as win:
            t0 = time.perf_counter()
            rep = writer.publish(slices, version=v)
            t1 = time.perf_counter()
            _traced_mark(win)
            if task.rank == 0:
                commit_parts(task.url, version=v, world=task.world, timeout_s=120)
            t2 = time.perf_counter()
            writer.finish(v, timeout_s=120)
            t3 = time.perf_counter()
        samples.append(
            ShardedSample(
                version=v,
                kind=rep.kind,
                density=density,
                measure=how,
                changed_elements=rep.changed_elements,
                total_elements=rep.total_elements,
                changed_fraction=rep.changed_elements / max(1, rep.total_elements),
                payload_bytes=rep.payload_bytes,
                publish_s=t1 - t0,
                commit_s=t2 - t1,
                finish_s=t3 - t2,
                peak_bytes=win.peak,
                peak_ratio=win.peak / max(1, 2 * numel),
                publish_peak_bytes=win.publish_peak,
                held_bytes=win.held,
                codecs=dict(rep.codecs),
                anchor_reason=rep.anchor_reason,
                anchor_copy_bytes=rep.anchor_copy_bytes,
            )
        )

    version(0, None, "rss")
    snapshot_rss = rss_bytes()
    v = 1
    for i, density in enumerate(task.densities):
        for rep in range(task.repeats):
            hows: tuple[Literal["rss", "traced"], ...] = ("rss", "traced")
            for how in hows:
                seed = ((task.seed * 7919 + i) * 1009 + rep) * 4 + (how == "traced")
                perturb([t for t, _ in shard.values()], density, seed * 131 + task.rank)
                version(v, density, how)
                v += 1
    digests = {n: digest([_words(t)]) for n, (t, _) in shard.items()}
    return RankRun(
        rank=task.rank,
        shard_elements=numel,
        shard_bf16_bytes=2 * numel,
        baseline_rss_bytes=baseline,
        snapshot_rss_bytes=snapshot_rss,
        samples=samples,
        digests=digests,
    )


def _words(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.int16).numpy()


def _entry(task: RankTask, barrier: Any, conn: Any) -> None:
    try:
        result: object = ("ok", run_rank(task, barrier))
    except BaseException as exc:  # reported to the parent, which raises
        with contextlib.suppress(Exception):
            barrier.abort()  # the other ranks stop waiting
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    conn.send(result)
    conn.close()


def _spawn_ranks(tasks: Sequence[RankTask]) -> list[RankRun]:
    """:func:`run_rank` of every task, each in a fresh process (spawn), all at once."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(tasks))
    procs, conns = [], []
    for task in tasks:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_entry, args=(task, barrier, send), name=f"bench-sharded-{task.rank}"
        )
        proc.start()
        send.close()
        procs.append(proc)
        conns.append(recv)
    out: list[RankRun] = []
    errors: list[str] = []
    for task, proc, recv in zip(tasks, procs, conns, strict=True):
        try:
            status, payload = recv.recv()
        except EOFError:
            status, payload = "error", f"died (exit code {proc.exitcode}; out of memory?)"
        finally:
            recv.close()
        proc.join()
        if status != "ok":
            errors.append(f"rank {task.rank}: {payload}")
        else:
            out.append(payload)
    if errors:
        raise RuntimeError("the sharded bench failed: " + "\n".join(errors))
    return out


def _threaded_ranks(tasks: Sequence[RankTask]) -> list[RankRun]:
    """:func:`run_rank` of every task on threads of this process (tests)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    barrier = threading.Barrier(len(tasks))
    with ThreadPoolExecutor(len(tasks)) as pool:
        futures = [pool.submit(run_rank, t, barrier) for t in tasks]
        return [f.result() for f in futures]


# --- the bench process -------------------------------------------------------------------------


def verify(url: str, size: str, world: int, ranks: Sequence[RankRun]) -> bool:
    """A subscriber syncs the store's last version; every rank's rows equal it bit for bit."""
    from deltastore.sync.subscriber import Subscriber

    sub: Any = Subscriber(url, lease_ttl=None)
    try:
        sub.sync()
        tensors = sub.tensors
        assert tensors is not None
        for run in ranks:
            for name, shape in SHARDED_SIZES[size].shapes().items():
                a, b = shard_rows(shape[0], run.rank, world)
                if digest([_words(tensors[name][a:b])]) != run.digests[name]:
                    return False
    finally:
        sub.close()
    return True


def summarize(ranks: Sequence[RankRun], densities: Sequence[float]) -> list[DensitySummary]:
    """Per density (the anchor first), the largest ratios over ranks and repeats; the deltas
    that also wrote an anchor copy apart from the others."""
    out = []
    for density in (None, *densities):
        for copy in (False, True):
            samples = [
                (r, s)
                for r in ranks
                for s in r.samples
                if s.density == density and (s.anchor_copy_bytes is not None) == copy
            ]
            if samples:
                out.append(_summary(density, copy, samples))
    return out


def _summary(
    density: float | None, copy: bool, samples: Sequence[tuple[RankRun, ShardedSample]]
) -> DensitySummary:
    rss = [s for _, s in samples if s.measure == "rss"]
    traced = [(r, s) for r, s in samples if s.measure == "traced"]
    return DensitySummary(
        density=density,
        anchor_copy=copy,
        changed_fraction=max(s.changed_fraction for _, s in samples),
        rss_ratio=max((s.peak_ratio for s in rss), default=0.0),
        traced_ratio=max((s.peak_ratio for _, s in traced), default=0.0),
        traced_held_ratio=max(
            ((s.held_bytes or 0) / r.shard_bf16_bytes for r, s in traced), default=0.0
        ),
        publish_s=max((s.publish_s for s in rss), default=0.0),
        payload_ratio=max(s.payload_bytes / (2 * s.total_elements) for _, s in samples),
    )


def bar_checks(summary: Sequence[DensitySummary]) -> list[BarCheck]:
    """Per density of the deltas, traced and RSS: the bar, peak over the snapshot <= 2x the
    shard's bf16 bytes plus O(changed), checked as (peak - the changes held for ``finish``)
    / shard bf16 bytes <= :data:`PEAK_RATIO_MAX` (the held changes: a bitmap or positions and
    an XOR mask per changed element, measured by tracemalloc at the same density); and the
    plain peak / shard bf16 bytes against the same number."""
    out = []
    held = {(s.density, s.anchor_copy): s.traced_held_ratio for s in summary}
    for s in summary:
        if s.density is None:
            continue
        copy = ", with an anchor copy" if s.anchor_copy else ""
        known = held.get((s.density, s.anchor_copy)) or held.get((s.density, False)) or 0.0
        for what, value in (("traced", s.traced_ratio), ("rss", s.rss_ratio)):
            where = f"({what}, {s.density:.0%} changed{copy})"
            out.append(
                _check(
                    f"publish peak - held changes / shard bf16 bytes {where}",
                    None,
                    value - known if value > 0 and known > 0 else None,
                    "<=",
                    PEAK_RATIO_MAX,
                    "the bar (2x the shard plus O(changed)): largest over ranks and repeats, "
                    "minus the changes publish holds for finish (tracemalloc, same density); "
                    "the snapshot not counted",
                    applicable=value > 0 and known > 0,  # 0: not measured that way
                )
            )
            out.append(
                _check(
                    f"publish peak / shard bf16 bytes {where}",
                    None,
                    value,
                    "<=",
                    PEAK_RATIO_MAX,
                    "largest over ranks and repeats, everything counted but the snapshot",
                    applicable=value > 0,  # 0: not measured (ranks in this process)
                )
            )
    return out


def run_sharded(options: ShardedOptions) -> ShardedResult:
    """Run the sharded publish bench (see the module docstring)."""
    from deltastore.bench.runner import run_header

    t_start = time.perf_counter()
    load_start = load_average()
    if options.size not in SHARDED_SIZES:
        raise ValueError(f"unknown size {options.size!r}; choose one of {list(SHARDED_SIZES)}")
    if options.world < 1 or options.repeats < 1:
        raise ValueError("world and repeats must be positive")
    if not options.densities or not all(0 < d <= 1 for d in options.densities):
        raise ValueError(f"densities must be in (0, 1], got {list(options.densities)}")
    config = SHARDED_SIZES[options.size]
    numel = config.numel()
    options.log(
        f"sharded bench: {options.size} ({numel / 1e6:.2f}M elements) on {options.world} "
        f"ranks, densities {', '.join(f'{d:g}' for d in options.densities)}"
    )
    root = tempfile.mkdtemp(prefix="deltastore-sharded-", dir=options.workdir)
    url = os.path.join(root, "store")
    tasks = [
        RankTask(
            rank=r,
            world=options.world,
            url=url,
            size=options.size,
            densities=tuple(options.densities),
            repeats=options.repeats,
            seed=options.seed,
            writer=tuple(sorted(options.writer.items())),
            measure_memory=not options.in_process,
        )
        for r in range(options.world)
    ]
    try:
        ranks = _threaded_ranks(tasks) if options.in_process else _spawn_ranks(tasks)
        ranks.sort(key=lambda r: r.rank)
        exact = verify(url, options.size, options.world, ranks) if options.verify else True
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = summarize(ranks, options.densities)
    for s in summary:
        options.log(
            f"  {_name(s)}: changed "
            f"{s.changed_fraction:.3f}, peak/shard rss {s.rss_ratio:.2f} traced "
            f"{s.traced_ratio:.2f} (held {s.traced_held_ratio:.2f}), publish {s.publish_s:.3f} s"
        )
    return ShardedResult(
        **dict(run_header()),
        size=options.size,
        elements=numel,
        tensors=len(config.shapes()),
        world=options.world,
        options={k: v for k, v in options.writer.items() if isinstance(v, int | str)},
        densities=list(options.densities),
        repeats=options.repeats,
        seed=options.seed,
        ranks=ranks,
        summary=summary,
        method=METHOD,
        allocator=" ".join(
            f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")
        )
        or "glibc default",
        load_average=[load_start, load_average()],
        bars=bar_checks(summary),
        exact=exact,
        wall_s=time.perf_counter() - t_start,
    )


def sharded_markdown(result: ShardedResult) -> str:
    """The report: per density the largest peak ratios, then every rank's samples."""
    m = result.machine
    lines = [
        f"## deltastore bench --mode sharded: {result.size}, {result.elements / 1e6:.2f}M "
        f"elements on {result.world} ranks",
        "",
        f"Machine: {m.cpu_model}, {m.cores} cores; deltastore {m.deltastore}; allocator "
        f"{result.allocator}. "
        f"{result.created}, wall {result.wall_s:.1f} s. Exact: {'yes' if result.exact else 'NO'}.",
        "",
        "| density | changed | peak/shard (rss) | peak/shard (traced) | held/shard (traced) "
        "| publish s | payload/dense |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in result.summary:
        lines.append(
            f"| {_name(s)} | {s.changed_fraction:.3f} | {s.rss_ratio:.2f} | {s.traced_ratio:.2f} "
            f"| {s.traced_held_ratio:.2f} | {s.publish_s:.3f} | {s.payload_ratio:.3f} |"
        )
    lines += ["", "| rank | shard bf16 B | version | measure | changed | publish s | peak B |"]
    lines.append("|---|---|---|---|---|---|---|")
    for r in result.ranks:
        for x in r.samples:
            lines.append(
                f"| {r.rank} | {r.shard_bf16_bytes} | {x.version} | {x.measure} "
                f"| {x.changed_fraction:.3f} | {x.publish_s:.3f} | {x.peak_bytes} |"
            )
    lines += [
        "",
        *(f"- {b.name}: {b.measured} {b.op} {b.threshold} ({b.status})" for b in result.bars),
    ]
    return "\n".join(lines) + "\n"


def _name(s: DensitySummary) -> str:
    if s.density is None:
        return "anchor"
    return f"{s.density:.0%}" + (" + anchor copy" if s.anchor_copy else "")
