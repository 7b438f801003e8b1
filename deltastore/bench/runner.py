"""``run_bench``: the workload, every system through every store, scaling, the bar.

For each store, each system runs as a publisher process (all measured versions) and then as
a subscriber process (all measured versions), against its own prefix of the store; then its
objects are deleted. The bench process itself only orchestrates (and serves moto S3).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import platform
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import safetensors
import torch
import zstandard

from deltastore._version import __version__
from deltastore.bench.analysis import (
    bar_checks,
    baseline_ratios,
    cpu_per_change,
    fastest,
    floors,
    medians,
    method_results,
    serving,
)
from deltastore.bench.ops import cpu_model, memory_bytes, stderr_log
from deltastore.bench.schema import (
    SYSTEMS,
    AdamWHeader,
    BenchResult,
    FloorSample,
    LinkInfo,
    Machine,
    Medians,
    RunHeader,
    ScalingResult,
    ScalingSide,
    ServingSample,
    StoreResult,
    SystemResult,
    WorkloadHeader,
    WorkloadInfo,
)
from deltastore.bench.worker import PublishRun, SyncRun, Task, spawn
from deltastore.bench.workload import SIZES, Workload, WorkloadSpec
from deltastore.store import open_store
from deltastore.testing.link import LINKS, LinkProfile, ShapedLink

Log = Callable[[str], None]
_BUCKET = "deltastore-bench"


@dataclass
class BenchOptions:
    """What :func:`run_bench` runs. ``stores``: ``"local"`` (a temporary folder), ``"moto"``
    (a moto S3 server on 127.0.0.1, needs s3fs and moto) or store URLs (each system writes
    under ``<url>/<run id>/<system>``, with ``storage_options``)."""

    size: str = "large"
    stores: Sequence[str] = ("local", "moto")
    versions: int = 3
    lr: float = 1e-6
    seed: int = 0
    warmup: int = 1
    workdir: str | os.PathLike[str] | None = None
    storage_options: dict[str, Any] | None = None
    systems: Sequence[str] = SYSTEMS
    #: Changed elements of the scaling versions, as a share of the small model (0: skip).
    scaling_fraction: float = 0.005
    scaling_versions: int = 3
    #: A shaped link (:data:`deltastore.testing.link.LINKS`) in front of the moto store.
    link: str | None = None
    log: Log = field(default=stderr_log, repr=False)

    def spec(self, size: str | None = None) -> WorkloadSpec:
        return WorkloadSpec(
            size=size or self.size,
            lr=self.lr,
            seed=self.seed,
            warmup=self.warmup,
            versions=self.versions,
        )


class StoreUnavailable(RuntimeError):
    """A store the bench cannot use here (e.g. moto or s3fs not installed)."""


@dataclass(frozen=True)
class BenchStore:
    label: str
    root: str
    storage_options: dict[str, Any] | None
    link: LinkProfile | None = None

    def url(self, system: str) -> str:
        return f"{self.root.rstrip('/')}/{system}"


@contextmanager
def _moto(run_id: str, link: LinkProfile | None = None) -> Iterator[BenchStore]:
    try:
        import boto3  # type: ignore[import-untyped, unused-ignore]
        import s3fs  # noqa: F401
        from moto.server import ThreadedMotoServer
    except ImportError as exc:
        raise StoreUnavailable(
            f"the moto store needs s3fs, boto3 and moto[server] ({exc}): "
            "pip install 'deltastore[s3]' 'moto[server]'"
        ) from None
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    with contextlib.ExitStack() as stack:
        stack.callback(server.stop)
        endpoint = f"http://127.0.0.1:{port}"
        creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **creds).create_bucket(
            Bucket=_BUCKET
        )
        if link is not None:  # every system's requests go through it
            endpoint = stack.enter_context(ShapedLink(port, link)).endpoint
        options = {
            "key": "testing",
            "secret": "testing",
            "endpoint_url": endpoint,
            # moto serves a range by reading the whole object: s3fs reads an object larger
            # than its block size (50 MiB) as concurrent ranges, which reads a 2 GB object
            # 41 times (~25 MB/s instead of ~250 MB/s). One GET per whole-object read.
            "default_block_size": 1 << 40,
            # completing a 2 GB multipart upload takes moto longer than botocore's 60 s.
            "config_kwargs": {"read_timeout": 900},
        }
        label = "moto" if link is None else f"moto+{link.name}"
        yield BenchStore(label, f"s3://{_BUCKET}/{run_id}", options, link)


@contextmanager
def open_bench_store(
    name: str,
    run_id: str,
    storage_options: dict[str, Any] | None = None,
    link: LinkProfile | None = None,
) -> Iterator[BenchStore]:
    """The store ``name`` for one run; temporary folders and servers go away afterwards.
    ``link``: the shaped link in front of the moto store."""
    if name == "local":
        root = tempfile.mkdtemp(prefix="deltastore-bench-")
        try:
            yield BenchStore("local", root, None)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    elif name == "moto":
        with _moto(run_id, link) as store:
            yield store
    else:
        yield BenchStore(name, f"{name.rstrip('/')}/{run_id}", storage_options)


def _clear(url: str, storage_options: dict[str, Any] | None) -> None:
    store = open_store(url, storage_options)
    for key in store.list():
        store.delete(key)


def machine_info() -> Machine:
    return Machine(
        cpu_model=cpu_model(),
        cores=os.cpu_count() or 0,
        memory_bytes=memory_bytes(),
        platform=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
        numpy=np.__version__,
        zstandard=zstandard.__version__,
        safetensors=safetensors.__version__,
        deltastore=__version__,
    )


def link_info(p: LinkProfile, dense_bytes: int, payload_bytes: int | None = None) -> LinkInfo:
    """The :class:`LinkInfo` of the shaped link ``p``: its profile, ``dense_floor_s`` (one
    request, then ``dense_bytes`` at the total bandwidth) and ``deltastore_floor_s`` (two
    requests one after the other, then ``payload_bytes``, deltastore's median payload), None
    when ``payload_bytes`` is. Seconds; bytes are 8 bits on the link."""
    ds_floor = None
    if payload_bytes is not None:
        ds_floor = 2 * p.latency_s + 8 * payload_bytes / p.total_bits_per_s
    return LinkInfo(
        name=p.name,
        latency_s=p.latency_s,
        conn_bits_per_s=p.conn_bits_per_s,
        total_bits_per_s=p.total_bits_per_s,
        dense_floor_s=p.latency_s + 8 * dense_bytes / p.total_bits_per_s,
        deltastore_floor_s=ds_floor,
    )


def run_header() -> RunHeader:
    """The :class:`RunHeader` of a run ending now: ``created`` the current UTC time to the
    second, and this machine. A mode's runner calls it as it builds its result, after the
    measurements (``created`` marks the run's end), and passes the fields on with
    ``Result(**dict(run_header()), ...)``."""
    now = dt.datetime.now(dt.timezone.utc)
    return RunHeader(created=now.isoformat(timespec="seconds"), machine=machine_info())


def workload_header(wl: Workload, generated: bool) -> WorkloadHeader:
    """The :class:`WorkloadHeader` of ``wl``, read off its index (size name, seed) and its
    files (elements, tensors, bf16 bytes, folder); ``generated``: whether this run made it,
    as :meth:`Workload.ensure` says."""
    return WorkloadHeader(
        size=wl.index.size,
        elements=wl.numel,
        tensors=len(wl.index.tensors),
        dense_bytes=wl.dense_bytes,
        seed=wl.index.seed,
        folder=str(wl.folder),
        generated_now=generated,
    )


def adamw_header(wl: Workload, generated: bool) -> AdamWHeader:
    """:func:`workload_header` with the workload's learning rate and warm-up steps (its
    index's: those of the :class:`WorkloadSpec` it was generated from)."""
    return AdamWHeader(
        **dict(workload_header(wl, generated)), lr=wl.index.lr, warmup=wl.index.warmup
    )


@dataclass(frozen=True)
class Scaling:
    """Scaling versions to append to deltastore's run: flipped words per version, versions."""

    flips: int
    reps: int


def _run_system(
    system: str, store: BenchStore, wl: Workload, log: Log, scaling: Scaling | None = None
) -> tuple[PublishRun, SyncRun]:
    url, opts, folder = store.url(system), store.storage_options, str(wl.folder)
    flips, reps = (scaling.flips, scaling.reps) if scaling else (0, 0)
    t0 = time.perf_counter()
    pub: PublishRun = spawn(
        Task("publish", system, url, folder, opts, system == "deltastore", flips, reps)
    )
    t1 = time.perf_counter()
    sub: SyncRun = spawn(
        Task(
            "sync",
            system,
            url,
            folder,
            opts,
            flips=flips,
            expect=tuple(pub.flip_digests),
            floors=system == "deltastore",
            serving=system == "deltastore",
        )
    )
    t2 = time.perf_counter()
    _clear(url, opts)
    pub_s = ", ".join(f"{s.times.total_s:.2f}" for s in pub.samples)
    sync_s = ", ".join(
        f"{s.times.total_s:.2f}" + (f" ({s.method})" if s.method else "") for s in sub.samples
    )
    floor_s = ", ".join(
        f"{f.receiver_floor_s:.3f}/{f.scatter_floor_s:.3f}/{f.memory_floor_s or 0:.3f}"
        for f in sub.floors
    )
    serve = ", ".join(f"{s.progress or 0:.2f} ({s.sync_s:.3f} s)" for s in sub.serving)
    log(
        f"  [{store.label}] {wl.index.size} {system}: publish {pub_s} s, sync {sync_s} s"
        + (f", floors (receiver/scatter/memory) {floor_s} s" if floor_s else "")
        + (f", serving thread progress {serve}" if serve else "")
        + (f", scaling syncs {', '.join(f'{t:.3f}' for t in sub.flip_sync_s)} s" if reps else "")
        + f" (workers {t1 - t0:.0f} + {t2 - t1:.0f} s, "
        + f"setup {pub.setup_s:.0f} + {sub.setup_s:.0f} s)"
        + ("" if all(s.exact for s in sub.samples) and sub.flip_exact else "  NOT BIT-EXACT")
    )
    return pub, sub


def _system_result(system: str, pub: PublishRun, sub: SyncRun, dense_bytes: int) -> SystemResult:
    """The system's result; for a receiver with several methods, ``sync`` and the medians
    are the fastest method's (by median sync time), every method is in ``methods``."""
    methods = method_results(sub.samples)
    method = fastest(methods) if methods else sub.method
    sync = methods[method].sync if methods else sub.samples
    return SystemResult(
        system=system,  # type: ignore[arg-type]
        publisher_setup_s=pub.setup_s,
        subscriber_setup_s=sub.setup_s,
        publish=pub.samples,
        sync=sync,
        median=medians(pub.samples, sync, dense_bytes),
        publisher_rss_extra_max_bytes=max(s.rss_extra_bytes for s in pub.samples),
        subscriber_rss_extra_max_bytes=max(s.rss_extra_bytes for s in sync),
        exact=all(s.exact for s in sub.samples),
        publish_method=pub.method,
        method=method,
        methods=methods,
        poll_requests=sub.poll_requests,
        poll_round_trips=sub.poll_round_trips,
    )


def _scaling_side(wl: Workload, sub: SyncRun) -> ScalingSide:
    return ScalingSide(
        size=wl.index.size,
        elements=wl.numel,
        sync_s=sub.flip_sync_s,
        median_s=float(np.median(sub.flip_sync_s)),
        exact=sub.flip_exact,
    )


def run_store(
    store: BenchStore,
    wl: Workload,
    systems: Sequence[str],
    log: Log = stderr_log,
    scaling: Scaling | None = None,
) -> tuple[StoreResult, ScalingSide | None]:
    """Every system through ``store``, deltastore's derived numbers there, and (with
    ``scaling``) the scaling syncs appended to deltastore's run."""
    results: dict[str, SystemResult] = {}
    meds: dict[str, Medians] = {}
    bound: list[float] = []
    floor_samples: list[FloorSample] = []
    serving_samples: list[ServingSample] = []
    anchor: int | None = None
    side = None
    for system in systems:
        extra = scaling if system == "deltastore" else None
        pub, sub = _run_system(system, store, wl, log, extra)
        results[system] = _system_result(system, pub, sub, wl.dense_bytes)
        meds[system] = results[system].median
        bound += pub.bound_s
        floor_samples += sub.floors
        serving_samples += sub.serving
        anchor = pub.anchor_bytes if pub.anchor_bytes is not None else anchor
        if extra is not None:
            side = _scaling_side(wl, sub)
    bound_med = float(np.median(bound)) if bound else None
    ds = meds.get("deltastore")
    link = None
    if store.link is not None:
        payload = ds.publish.payload_bytes if ds else None
        link = link_info(store.link, wl.dense_bytes, payload)
    result = StoreResult(
        store=store.label,
        systems=results,
        detect_bound_s=bound,
        detect_bound_median_s=bound_med,
        publish_bound_ratio=ds.publish.total_s / bound_med if ds and bound_med else None,
        pause_fraction=ds.sync.pause_s / ds.sync.total_s if ds and ds.sync.total_s else None,
        ratios=baseline_ratios(meds),
        floors=floors(floor_samples, ds.sync if ds else None),
        anchor_bytes=anchor,
        anchor_fraction=anchor / wl.dense_bytes if anchor is not None else None,
        link=link,
        cpu_per_change_s=cpu_per_change(
            results["deltastore"].sync, [wl.index.changed[v] for v in range(1, wl.files)]
        )
        if "deltastore" in results
        else None,
        serving=serving(serving_samples, ds.sync if ds else None),
    )
    return result, side


def _workload_info(wl: Workload, generated: bool) -> WorkloadInfo:
    idx = wl.index
    measured = range(1, wl.files)
    return WorkloadInfo(
        **dict(adamw_header(wl, generated)),
        versions=idx.versions,
        changed_elements=[idx.changed[i] for i in measured],
        changed_fraction=[wl.changed_fraction(i) for i in measured],
        digests=[idx.digests[i] for i in measured],
        generate_s=idx.generate_s,
    )


def run_bench(options: BenchOptions) -> BenchResult:
    """Run the whole benchmark (see ``benchmarks/README.md``)."""
    t0 = time.perf_counter()
    log = options.log
    unknown = set(options.systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {sorted(unknown)}; choose from {list(SYSTEMS)}")
    systems = [s for s in SYSTEMS if s in options.systems]
    link = LINKS[options.link] if options.link is not None else None
    if link is not None and "moto" not in options.stores:
        raise ValueError("the shaped link is in front of the moto store: add moto to the stores")
    wl, generated = Workload.ensure(options.spec(), options.workdir, log)
    changed = ", ".join(f"{100 * wl.changed_fraction(i):.3f}%" for i in range(1, wl.files))
    log(
        f"workload {wl.folder.name}: {wl.numel / 1e6:.0f}M elements, changed per version: "
        f"{changed}" + (f" (generated in {wl.index.generate_s:.0f} s)" if generated else "")
    )
    run_id = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S-") + uuid.uuid4().hex[:6]
    stores: list[StoreResult] = []
    skipped: list[str] = []
    scaling: ScalingResult | None = None
    flips = round(options.scaling_fraction * SIZES["small"].numel())
    for name in options.stores:
        # Scaling rides on deltastore's run through the first usable store.
        want = scaling is None and flips > 0 and "deltastore" in systems
        extra = Scaling(flips, options.scaling_versions) if want else None
        try:
            with open_bench_store(name, run_id, options.storage_options, link) as store:
                log(f"store {store.label}: {store.root}")
                result, target = run_store(store, wl, systems, log, extra)
                stores.append(result)
                if target is not None:
                    small = target
                    if options.size != "small":
                        small_wl, _ = Workload.ensure(options.spec("small"), options.workdir, log)
                        _, sub = _run_system("deltastore", store, small_wl, log, extra)
                        small = _scaling_side(small_wl, sub)
                    scaling = ScalingResult(
                        changed_elements=flips,
                        store=store.label,
                        small=small,
                        target=target,
                        ratio=target.median_s / small.median_s,
                    )
        except StoreUnavailable as exc:
            log(f"store {name} skipped: {exc}")
            skipped.append(f"{name}: {exc}")
    exact = all(r.exact for s in stores for r in s.systems.values()) and (
        scaling is None or (scaling.small.exact and scaling.target.exact)
    )
    return BenchResult(
        **dict(run_header()),
        workload=_workload_info(wl, generated),
        stores=stores,
        scaling=scaling,
        bars=bar_checks(stores, scaling, wl.index.size),
        exact=exact,
        skipped=skipped,
        wall_s=time.perf_counter() - t0,
    )
