"""Worker processes: every publisher and subscriber runs in a process of its own, so one
side's memory never hides the other's and the bench process holds no model while they run.

A publisher worker reads the base version, lets its sender set up (untimed), then for each
measured version reads it into a buffer (untimed) and publishes it inside an
:class:`~deltastore.bench.ops.RssMeter`. deltastore's publisher worker also times the detect
lower bound on the same old/new words just before each publish (two alternating buffers hold
them). A subscriber worker starts from a copy of the base version and syncs each version
inside an :class:`RssMeter`, then (untimed) hashes its words and compares with the workload.
A receiver with several load methods (dense) loads each version by every method in turn (the
order rotates from one version to the next), its words overwritten with zeros (untimed)
before each, so every method is timed, metered and checked on its own.

Scaling (deltastore only): after the measured versions the publisher publishes ``reps``
versions that each differ from the one before in exactly ``flips`` words (bit 0 flipped at
seeded random positions over the whole model) and reports their digests; the subscriber
syncs them, timed, and checks the digests.

Every measured sync also reports the process CPU it took (``time.process_time`` around it,
less the RSS meter's sampling thread).

Serving (deltastore only): after the scaling syncs, the subscriber puts its words back at the
base version (untimed), starts a fresh receiver on them (its check untimed) and syncs every
measured version again with the serving thread running (:mod:`deltastore.bench.serving`), so
that the measured syncs above run without it.

Floors (deltastore only): after all its syncs, the subscriber times the receiver, pause and
memory floors of each measured version (:mod:`deltastore.bench.floors`) into its own
tensors, on one pool of threads. The publisher reports the stored size of the anchor its
sender published during setup.

Workers are started from a fork server that imported this module once (a fresh interpreter
with torch costs seconds per worker); each is still a separate process with its own memory.
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any, Literal

import numpy as np

from deltastore.bench import floors, serving
from deltastore.bench.dense import DenseNaiveReceiver, DenseNaiveSender, DenseReceiver, DenseSender
from deltastore.bench.ops import Differ, RssMeter, digest, flip_positions, rss_bytes
from deltastore.bench.schema import FloorSample, PublishSample, ServingSample, SyncSample
from deltastore.bench.systems import (
    CooReceiver,
    CooSender,
    DeltastoreReceiver,
    DeltastoreSender,
    Receiver,
    Sender,
    XorDenseReceiver,
    XorDenseSender,
)
from deltastore.bench.workload import Workload
from deltastore.store import open_store
from deltastore.store.counting import CountingStore, critical_path
from deltastore.sync.priority import DEFAULT_PRIORITY

SENDERS: dict[str, type[Sender]] = {
    "deltastore": DeltastoreSender,
    "dense": DenseSender,
    "dense-naive": DenseNaiveSender,
    "coo": CooSender,
    "xor-dense": XorDenseSender,
}
RECEIVERS: dict[str, type[Receiver]] = {
    "deltastore": DeltastoreReceiver,
    "dense": DenseReceiver,
    "dense-naive": DenseNaiveReceiver,
    "coo": CooReceiver,
    "xor-dense": XorDenseReceiver,
}


@dataclass(frozen=True)
class Task:
    """What one worker does; ``url``/``storage_options`` name this system's own store."""

    role: Literal["publish", "sync"]
    system: str
    url: str
    workload: str
    storage_options: dict[str, Any] | None = None
    #: publish: also time the detect lower bound before each version.
    bound: bool = False
    #: Scaling versions after the measured ones (deltastore only): words flipped per version,
    #: versions, and (sync) the digests the publisher reported for them.
    flips: int = 0
    reps: int = 0
    expect: tuple[str, ...] = ()
    #: sync: time the receiver floors of every measured version after the syncs.
    floors: bool = False
    #: sync: replay the measured versions with the serving thread running (deltastore).
    serving: bool = False


@dataclass
class PublishRun:
    """A publisher worker's results; ``anchor_bytes``: what its setup stored as the anchor
    (deltastore), ``method``: how its sender publishes."""

    setup_s: float = 0.0
    samples: list[PublishSample] = field(default_factory=list)
    bound_s: list[float] = field(default_factory=list)
    flip_digests: list[str] = field(default_factory=list)
    anchor_bytes: int | None = None
    method: str = ""


@dataclass
class SyncRun:
    """A subscriber worker's results: ``samples`` in the order run (a receiver with several
    methods has one per version and method), its single ``method`` or ``methods``."""

    setup_s: float = 0.0
    samples: list[SyncSample] = field(default_factory=list)
    flip_sync_s: list[float] = field(default_factory=list)
    flip_exact: bool = True
    floors: list[FloorSample] = field(default_factory=list)
    serving: list[ServingSample] = field(default_factory=list)
    method: str = ""
    methods: tuple[str, ...] = ()
    poll_requests: int | None = None
    poll_round_trips: int | None = None


def run_publisher(task: Task) -> PublishRun:
    wl = Workload.load(task.workload)
    store = open_store(task.url, task.storage_options)
    base = wl.read(0)
    buffers = [base, base.copy()] if task.bound else [base]  # both faulted in before `baseline`
    sender = SENDERS[task.system](store, wl)
    t0 = time.perf_counter()
    sender.start(base)
    out = PublishRun(setup_s=time.perf_counter() - t0, method=sender.method)
    if isinstance(sender, DeltastoreSender):
        out.anchor_bytes = sender.anchor_bytes
    differ = Differ()
    baseline = rss_bytes()
    new = base
    for version in range(1, wl.files):
        new, old = buffers[version % len(buffers)], buffers[(version - 1) % len(buffers)]
        wl.read_into(version, new)
        if task.bound:
            olds, news = wl.views(old), wl.views(new)
            out.bound_s.append(differ.lower_bound(list(olds.values()), list(news.values())))
        with RssMeter(baseline=baseline) as rss:
            times = sender.publish(version, new)
        changed = wl.index.changed[version]
        out.samples.append(
            PublishSample(
                version=version,
                changed_elements=changed,
                bytes_per_changed=times.payload_bytes / changed if changed else 0.0,
                times=times,
                rss_extra_bytes=rss.extra_bytes,
            )
        )
    for rep in range(1, task.reps + 1):
        new[flip_positions(wl.numel, task.flips, seed=rep)] ^= np.int16(1)
        sender.publish(wl.files - 1 + rep, new)
        out.flip_digests.append(digest([new]))
    return out


def run_subscriber(task: Task) -> SyncRun:
    wl = Workload.load(task.workload)
    store = CountingStore(open_store(task.url, task.storage_options))
    flat = wl.read(0)
    receiver = RECEIVERS[task.system](store, wl, flat)
    t0 = time.perf_counter()
    receiver.start()
    methods = receiver.methods
    out = SyncRun(setup_s=time.perf_counter() - t0, method=receiver.method, methods=methods)
    baseline = rss_bytes()
    for version in range(1, wl.files):
        turn = (version - 1) % max(1, len(methods))
        order: tuple[str | None, ...] = (methods[turn:] + methods[:turn]) or (None,)
        for method in order:
            if method is not None:
                flat.fill(0)  # each method loads every word, checked on its own
            cpu = time.process_time()
            with RssMeter(baseline=baseline) as rss, store.window() as calls:
                times = receiver.sync(version, method)
            cpu = time.process_time() - cpu - rss.cpu_s
            times = times.model_copy(
                update={"requests": len(calls), "round_trips": critical_path(calls), "cpu_s": cpu}
            )
            got = digest([flat])
            out.samples.append(
                SyncSample(
                    version=version,
                    times=times,
                    rss_extra_bytes=rss.extra_bytes,
                    digest=got,
                    exact=got == wl.index.digests[version],
                    method=method,
                )
            )
    if isinstance(receiver, DeltastoreReceiver):  # a poll that finds nothing new
        with store.window() as calls:
            receiver.sub.latest()
        out.poll_requests, out.poll_round_trips = len(calls), critical_path(calls)
    for rep, expect in enumerate(task.expect, start=1):
        t0 = time.perf_counter()
        receiver.sync(wl.files - 1 + rep)
        out.flip_sync_s.append(time.perf_counter() - t0)
        out.flip_exact = out.flip_exact and digest([flat]) == expect
    if task.serving and isinstance(receiver, DeltastoreReceiver):
        wl.read_into(0, flat)
        replay = DeltastoreReceiver(store, wl, flat)
        replay.priority = DEFAULT_PRIORITY  # as an engine's background sync runs
        replay.start()
        out.serving = serving.measure(replay.sync, range(1, wl.files))
    if task.floors:
        with floors.FloorPool() as pool:
            out.floors = [floors.measure(store, wl, flat, v, pool) for v in range(1, wl.files)]
    return out


_RUNNERS = {"publish": run_publisher, "sync": run_subscriber}


def _entry(task: Task, conn: Connection) -> None:
    try:
        result: object = ("ok", _RUNNERS[task.role](task))
    except BaseException as exc:  # reported to the parent, which raises
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    conn.send(result)
    conn.close()


class WorkerError(ChildProcessError):
    """A worker process failed or died."""


def _context() -> ForkServerContext | SpawnContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return multiprocessing.get_context("spawn")


def spawn(task: Task) -> Any:
    """Run ``task`` in a new process and return its result."""
    ctx = _context()
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_entry, args=(task, send), name=f"bench-{task.role}-{task.system}")
    proc.start()
    send.close()
    try:
        status, payload = recv.recv()
    except EOFError:
        proc.join()
        raise WorkerError(
            f"{task.role} worker of {task.system} died (exit code {proc.exitcode}; out of memory?)"
        ) from None
    finally:
        recv.close()
    proc.join()
    if status != "ok":
        raise WorkerError(f"{task.role} worker of {task.system} failed: {payload}")
    return payload
