"""``deltastore bench --mode crossover``: the density of changes below which deltastore's sync
beats the strongest dense load, per store.

The workload is one chain of versions from one base (the initial weights, AdamW in its
stationary state: :mod:`deltastore.testing.synthetic`): a warm-up step (:data:`WARMUP`,
synced by every worker, in no median), then ``versions`` AdamW steps at each
learning rate of :attr:`CrossoverOptions.lrs` in turn, rising (the share of bf16 words a
step changes grows with the learning rate: ~0.05% at 5e-8, ~0.8% at 1e-6, ~19% at 5e-5 for
this generator). It is cached in the bench's workload format (:mod:`deltastore.bench.workload`,
folder ``crossover-<size>-seed<seed>-w1-v<versions>-lr<lr,...>``: base + one flat file per
version, ~12 GB for the medium model's default sweep), generated tensor by tensor in reused
buffers as the transfer bench's workload is.

Per store, in worker processes of their own (:mod:`deltastore.bench.worker`, the transfer
bench's systems): deltastore publishes the whole chain (one anchor, untimed) and one
subscriber syncs it, told each version; the strongest dense load (``dense``: every load method
on every version, the fastest by median) runs on the first point's versions, since it moves
the whole model whatever the density: once before deltastore and once after, pooled. Per
point: the median of deltastore's syncs and ``ratio`` = dense median / that; the crossover
(:func:`crossing`) is interpolated log-log between the two points where the ratio crosses 1.

Not thread-safe; the bench process holds no model while the workers run.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import json
import math
import os
import shutil
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from deltastore.bench.analysis import fastest, method_results
from deltastore.bench.crossover_schema import (
    Crossing,
    CrossoverResult,
    DenseLoad,
    DensityPoint,
    StoreCrossover,
)
from deltastore.bench.ops import Differ, load_average, stderr_log
from deltastore.bench.runner import (
    BenchStore,
    StoreUnavailable,
    link_info,
    open_bench_store,
    run_header,
    workload_header,
)
from deltastore.bench.schema import BarCheck
from deltastore.bench.worker import PublishRun, SyncRun, Task, spawn
from deltastore.bench.workload import (
    INDEX,
    MARKER,
    SIZES,
    TensorInfo,
    Workload,
    WorkloadIndex,
    default_workdir,
)
from deltastore.store import open_store
from deltastore.testing.link import LINKS
from deltastore.testing.synthetic import AdamWTensor

Log = Callable[[str], None]

#: The default sweep: learning rates whose steps change ~0.05%, 0.15%, 0.35%, 0.8%, 1.7%,
#: 3.5%, 7.5% and 19% of the model's bf16 words (measured on the small model).
DEFAULT_LRS = (5e-8, 1.5e-7, 4e-7, 1e-6, 2.5e-6, 6e-6, 1.5e-5, 5e-5)
DEFAULT_SIZE = "medium"
#: The dense slice's folder inside the chain's (symlinks to the base and the first versions).
DENSE_SLICE = "dense-slice"
#: Versions at the start of the chain (one step at the first learning rate) that every
#: worker syncs and no median counts: a worker's first sync pays one-off costs (compiling
#: native kernels, first page faults) that are not the density's.
WARMUP = 1


@dataclass
class CrossoverOptions:
    """What :func:`run_crossover` runs. ``lrs``: one density point each, in any order (sorted
    rising); ``versions``: AdamW steps (versions) per point; ``stores``: as
    :class:`~deltastore.bench.BenchOptions` (``local``, ``moto``, store URLs); ``link``: a
    shaped link (:data:`~deltastore.testing.link.LINKS`) in front of moto."""

    size: str = DEFAULT_SIZE
    stores: Sequence[str] = ("local", "moto")
    lrs: Sequence[float] = DEFAULT_LRS
    versions: int = 3
    seed: int = 0
    workdir: str | os.PathLike[str] | None = None
    storage_options: dict[str, Any] | None = None
    link: str | None = None
    log: Log = field(default=stderr_log, repr=False)


# --- the workload: one chain through every learning rate ------------------------------------


def chain_key(size: str, lrs: Sequence[float], versions: int, seed: int) -> str:
    """The cache folder's name of a sweep's chain."""
    return (
        f"crossover-{size}-seed{seed}-w{WARMUP}-v{versions}-lr{','.join(f'{lr:g}' for lr in lrs)}"
    )


def _set_lr(tensor: AdamWTensor, lr: float) -> None:
    # AdamWTensor fixes its learning rate at construction; the chain changes it between
    # steps, keeping the weights and the optimizer state.
    for group in tensor._opt.param_groups:
        group["lr"] = lr


def generate_chain(
    size: str, lrs: Sequence[float], versions: int, seed: int, folder: Path
) -> WorkloadIndex:
    """Write the chain (base, then ``versions`` steps at each of ``lrs``) into ``folder``
    (replacing it) in the workload format; returns its index (``lr``: the first rate)."""
    t0 = time.perf_counter()
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    layout, offset = [], 0
    for name, shape in SIZES[size].shapes().items():
        n = math.prod(shape)
        layout.append(TensorInfo(name=name, shape=tuple(shape), offset=offset, numel=n))
        offset += n
    files = 1 + WARMUP + len(lrs) * versions
    handles = [open(folder / f"v{i:03d}.bin", "wb") for i in range(files)]  # noqa: SIM115
    hashes = [xxhash.xxh3_64() for _ in range(files)]
    changed = [0] * files
    differ = Differ()
    largest = max(t.numel for t in layout)
    f32 = [np.zeros(largest, dtype=np.float32) for _ in range(4)]
    words = [np.zeros(largest, dtype=np.int16) for _ in range(2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workload generator: the random numbers use the pool
    try:
        with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
            for position, info in enumerate(layout):
                tensor = AdamWTensor(
                    info.name, info.shape, position=position, lr=lrs[0], seed=seed,
                    buffers=f32, pool=pool,
                )  # fmt: skip
                prev: np.ndarray | None = None
                for i in range(files):
                    if i > 0:
                        _set_lr(tensor, lrs[max(0, i - 1 - WARMUP) // versions])
                        tensor.step()
                    cur = words[i % 2][: info.numel]
                    tensor.bf16_into(cur)
                    data = cur.data.cast("B")
                    handles[i].write(data)
                    hashes[i].update(data)
                    if prev is not None:
                        changed[i] += differ.count(prev, cur)
                    prev = cur
    finally:
        torch.set_num_threads(threads)
        for fh in handles:
            fh.close()
    index = WorkloadIndex(
        size=size,
        lr=lrs[0],
        seed=seed,
        warmup=0,
        versions=files - 1,
        numel=offset,
        tensors=layout,
        changed=changed,
        digests=[h.hexdigest() for h in hashes],
        generate_s=time.perf_counter() - t0,
    )
    _write_index(folder, index)
    return index


def _write_index(folder: Path, index: WorkloadIndex) -> None:
    """``index.json`` then the marker, as :mod:`deltastore.bench.workload` writes them."""
    raw = json.dumps(index.model_dump(mode="json"), indent=1).encode()
    (folder / INDEX).write_bytes(raw)
    (folder / MARKER).write_text(hashlib.sha256(raw).hexdigest() + "\n")


def ensure_chain(options: CrossoverOptions, lrs: Sequence[float]) -> tuple[Workload, bool]:
    """The cached chain of ``lrs`` (generated first when missing); and whether it was."""
    base = Path(options.workdir).expanduser() if options.workdir else default_workdir()
    folder = base / chain_key(options.size, lrs, options.versions, options.seed)
    try:
        return Workload.load(folder), False
    except FileNotFoundError:
        pass
    files = 1 + WARMUP + len(lrs) * options.versions
    options.log(
        f"generating the crossover chain {folder.name} ({SIZES[options.size].numel() / 1e6:.0f}M "
        f"elements, {files} versions, {files * 2 * SIZES[options.size].numel() / 1e9:.1f} GB) "
        f"in {folder}"
    )
    generate_chain(options.size, lrs, options.versions, options.seed, folder)
    return Workload.load(folder), True


def dense_slice(chain: Workload, versions: int) -> Workload:
    """A workload of the chain's base, its warm-up and the first point's ``versions``
    versions (symlinks), for the dense load, whose time does not depend on the density."""
    folder = chain.folder / DENSE_SLICE
    try:
        return Workload.load(folder)
    except FileNotFoundError:
        pass
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    versions += WARMUP
    for i in range(versions + 1):
        (folder / chain.path(i).name).symlink_to(Path("..") / chain.path(i).name)
    idx = chain.index
    sub = idx.model_copy(
        update={
            "versions": versions,
            "changed": idx.changed[: versions + 1],
            "digests": idx.digests[: versions + 1],
        }
    )
    _write_index(folder, sub)
    return Workload.load(folder)


# --- the crossover -------------------------------------------------------------------------


def crossing(densities: Sequence[float], ratios: Sequence[float]) -> Crossing:
    """Where ``ratios`` (dense / deltastore, one per density, all > 0) crosses 1, by rising
    density: interpolated log-log between the last point where deltastore is faster (ratio
    > 1) and the next point; ``below the sweep`` when it is not faster at the lowest density,
    ``above the sweep`` when it is faster at every density."""
    if len(densities) != len(ratios) or not densities:
        raise ValueError("one ratio per density, at least one point")
    if not all(d > 0 for d in densities) or not all(r > 0 for r in ratios):
        raise ValueError("densities and ratios must be positive")
    pts = sorted(zip(densities, ratios, strict=True))
    wins = [r > 1 for _, r in pts]
    changes = sum(a != b for a, b in itertools.pairwise(wins))
    if not wins[0]:
        return Crossing(status="below the sweep", density=None, between=None, sign_changes=changes)
    for (da, ra), (db, rb) in itertools.pairwise(pts):
        if ra > 1 >= rb:
            t = math.log(ra) / (math.log(ra) - math.log(rb))
            at = math.exp(math.log(da) + t * (math.log(db) - math.log(da)))
            return Crossing(status="crossed", density=at, between=(da, db), sign_changes=changes)
    return Crossing(status="above the sweep", density=None, between=None, sign_changes=changes)


def check(store: str, cross: Crossing) -> BarCheck:
    """The ``crossover density`` of one store, a reported check (op ``report``, status
    ``reported``: no bar); ``measured`` None outside the sweep, ``what`` says which side."""
    side = "" if cross.density is not None else f"; {cross.status}"
    return BarCheck(
        name="crossover density",
        store=store,
        measured=cross.density,
        op="report",
        threshold=0.0,
        passed=False,
        what="changed / elements below which deltastore's median sync beats the strongest "
        f"dense load's median (log-log interpolation of dense / deltastore across 1){side}",
        status="reported",
    )


# --- running -------------------------------------------------------------------------------


def _workers(system: str, store: BenchStore, wl: Workload) -> tuple[PublishRun, SyncRun]:
    """``system`` publishes every version of ``wl`` then syncs them (a process each); its
    objects are deleted afterwards."""
    url, opts, folder = store.url(system), store.storage_options, str(wl.folder)
    try:
        pub: PublishRun = spawn(Task("publish", system, url, folder, opts))
        sub: SyncRun = spawn(Task("sync", system, url, folder, opts))
    finally:
        target = open_store(url, opts)
        for key in target.list():
            target.delete(key)
    return pub, sub


def _dense(runs: Sequence[tuple[PublishRun, SyncRun]]) -> DenseLoad:
    """The dense load of every run pooled (the warm-up versions left out)."""
    syncs = [s for _, sub in runs for s in sub.samples]
    methods = method_results([s for s in syncs if s.version > WARMUP])
    best = fastest(methods)
    kept = methods[best]
    return DenseLoad(
        method=best,
        median_s=kept.median.total_s,
        methods={name: m.median.total_s for name, m in methods.items()},
        runs=len(runs),
        versions=[s.version for s in kept.sync],
        sync_s=[s.times.total_s for s in kept.sync],
        publish_median_s=statistics.median(
            s.times.total_s for pub, _ in runs for s in pub.samples if s.version > WARMUP
        ),
        exact=all(s.exact for s in syncs),
    )


def _points(
    chain: Workload, lrs: Sequence[float], per: int, pub: PublishRun, sub: SyncRun, dense: float
) -> list[DensityPoint]:
    by_pub = {s.version: s for s in pub.samples}
    by_sub = {s.version: s for s in sub.samples}
    out = []
    for k, lr in enumerate(lrs):
        versions = list(range(1 + WARMUP + k * per, 1 + WARMUP + (k + 1) * per))
        syncs = [by_sub[v] for v in versions]
        changed = [chain.index.changed[v] for v in versions]
        dens = [c / chain.numel for c in changed]
        median = statistics.median(s.times.total_s for s in syncs)
        out.append(
            DensityPoint(
                lr=lr,
                versions=versions,
                changed_elements=changed,
                densities=dens,
                density=statistics.median(dens),
                deltastore_sync_s=[s.times.total_s for s in syncs],
                deltastore_median_s=median,
                fetch_median_s=statistics.median(s.times.fetch_s for s in syncs),
                decode_median_s=statistics.median(s.times.decode_s for s in syncs),
                pause_median_s=statistics.median(s.times.pause_s for s in syncs),
                payload_median_bytes=round(
                    statistics.median(by_pub[v].times.payload_bytes for v in versions)
                ),
                publish_median_s=statistics.median(by_pub[v].times.total_s for v in versions),
                dense_median_s=dense,
                ratio=dense / max(median, 1e-9),
                exact=all(s.exact for s in syncs),
            )
        )
    return out


def run_store(
    store: BenchStore, chain: Workload, lrs: Sequence[float], per: int, log: Log
) -> StoreCrossover:
    """The sweep through one store: dense on the first point's versions, deltastore on the
    whole chain, dense again (its runs bracket deltastore's in time: the pooled median is
    less at the mercy of a busy machine), the points and the crossover."""
    part = dense_slice(chain, per)
    before = _workers("dense", store, part)
    pub, sub = _workers("deltastore", store, chain)
    dense = _dense([before, _workers("dense", store, part)])
    each = ", ".join(f"{name} {t:.3f}" for name, t in dense.methods.items())
    log(f"  [{store.label}] dense: median sync {each} s; strongest {dense.method}")
    points = _points(chain, lrs, per, pub, sub, dense.median_s)
    for p in points:
        log(
            f"  [{store.label}] lr {p.lr:g}: {100 * p.density:.3f}% changed, deltastore "
            f"{p.deltastore_median_s:.3f} s (payload {p.payload_median_bytes / 1e6:.1f} MB), "
            f"dense {p.dense_median_s:.3f} s, dense/deltastore {p.ratio:.2f}"
            + ("" if p.exact else "  NOT BIT-EXACT")
        )
    cross = crossing([p.density for p in points], [p.ratio for p in points])
    link = link_info(store.link, chain.dense_bytes) if store.link is not None else None
    return StoreCrossover(
        store=store.label,
        link=link,
        dense=dense,
        points=points,
        crossover=cross,
        publisher_setup_s=pub.setup_s,
        subscriber_setup_s=sub.setup_s,
        publish_method=pub.method,
        sync_method=sub.method,
        exact=dense.exact and all(s.exact for s in sub.samples),
    )


def run_crossover(options: CrossoverOptions) -> CrossoverResult:
    """Run the sweep (see the module docstring)."""
    t_start = time.perf_counter()
    load_start = load_average()
    if options.size not in SIZES:
        raise ValueError(f"unknown size {options.size!r}; choose one of {sorted(SIZES)}")
    if options.versions < 1 or not options.lrs or not all(lr > 0 for lr in options.lrs):
        raise ValueError("versions must be >= 1 and every learning rate > 0")
    lrs = sorted(set(options.lrs))
    link = LINKS[options.link] if options.link is not None else None
    if link is not None and "moto" not in options.stores:
        raise ValueError("the shaped link is in front of the moto store: add moto to the stores")
    log = options.log
    chain, generated = ensure_chain(options, lrs)
    log(
        f"crossover chain {chain.folder.name}: {chain.numel / 1e6:.0f}M elements, "
        f"{len(lrs)} points of {options.versions} versions"
    )
    run_id = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S-") + uuid.uuid4().hex[:6]
    stores: list[StoreCrossover] = []
    skipped: list[str] = []
    for name in options.stores:
        try:
            with open_bench_store(name, run_id, options.storage_options, link) as store:
                log(f"store {store.label}: {store.root}")
                stores.append(run_store(store, chain, lrs, options.versions, log))
        except StoreUnavailable as exc:
            log(f"store {name} skipped: {exc}")
            skipped.append(f"{name}: {exc}")
    for s in stores:
        c = s.crossover
        where = f"{100 * c.density:.3f}% changed" if c.density is not None else c.status
        log(f"crossover [{s.store}]: {where}")
    return CrossoverResult(
        **dict(run_header()),
        **dict(workload_header(chain, generated)),
        lrs=lrs,
        versions_per_point=options.versions,
        warmup_versions=WARMUP,
        generate_s=chain.index.generate_s,
        stores=stores,
        bars=[check(s.store, s.crossover) for s in stores],
        exact=all(s.exact for s in stores),
        skipped=skipped,
        load_average=[load_start, load_average()],
        wall_s=time.perf_counter() - t_start,
    )


# --- the report ----------------------------------------------------------------------------


def _where(c: Crossing) -> str:
    if c.density is None:
        if c.status == "below the sweep":
            return "below the sweep (deltastore not faster even at its lowest density)"
        return "above the sweep (deltastore faster at every density)"
    assert c.between is not None
    note = f"; the ratio crosses 1 {c.sign_changes} times" if c.sign_changes > 1 else ""
    return (
        f"**{100 * c.density:.3f}% changed** (between {100 * c.between[0]:.3f}% and "
        f"{100 * c.between[1]:.3f}%{note})"
    )


def crossover_markdown(result: CrossoverResult) -> str:
    """The report: per store, the crossover and one row per density point."""
    m = result.machine
    load = ", ".join(f"{x:.1f}" for x in result.load_average)
    lines = [
        f"## deltastore bench --mode crossover: {result.size}, {result.elements / 1e6:.0f}M "
        f"elements ({result.dense_bytes / 1e6:.0f} MB bf16)",
        "",
        f"Machine: {m.cpu_model}, {m.cores} cores; deltastore {m.deltastore}. {result.created}, "
        f"wall {result.wall_s:.0f} s, load average {load}. "
        f"{len(result.lrs)} points of {result.versions_per_point} versions (AdamW steps), one "
        f"chain from one base. Exact: {'yes' if result.exact else 'NO'}.",
        "",
    ]
    for s in result.stores:
        d = s.dense
        link = f" (link {s.link.name})" if s.link else ""
        lines += [
            f"### {s.store}{link}",
            "",
            f"Crossover: {_where(s.crossover)}. Dense: {d.method}, median {d.median_s:.3f} s "
            f"({', '.join(f'{k} {v:.3f} s' for k, v in d.methods.items())}).",
            "",
            "| lr | changed | deltastore sync s | fetch s | decode s | pause s | payload MB "
            "| dense s | dense/deltastore |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for p in s.points:
            lines.append(
                f"| {p.lr:g} | {100 * p.density:.3f}% | {p.deltastore_median_s:.3f} "
                f"| {p.fetch_median_s:.3f} | {p.decode_median_s:.3f} | {p.pause_median_s:.3f} "
                f"| {p.payload_median_bytes / 1e6:.2f} | {p.dense_median_s:.3f} | {p.ratio:.2f} |"
            )
        lines.append("")
    lines += [
        f"- {s.store}: crossover density "
        + (
            f"{100 * s.crossover.density:.3f}% changed"
            if s.crossover.density is not None
            else s.crossover.status
        )
        + " (reported, no bar)"
        for s in result.stores
    ]
    lines += [f"- skipped: {s}" for s in result.skipped]
    return "\n".join(lines) + "\n"
