"""``deltastore bench --mode fleet``: what ``N`` followers cost the origin store, read directly
or through one mirror.

The ORIGIN is a moto S3 server (:func:`~deltastore.bench.runner.open_bench_store`). One
publisher writes to it over loopback: the bench's workload (:mod:`deltastore.bench.workload`,
cached; ``--size tiny`` by default), version 0 (the anchor) then ``versions`` deltas. Every
remote consumer reaches the origin through a shaped link (:mod:`deltastore.testing.link`,
``cross-region`` by default). For each followers count ``N`` and each side:

- ``direct``: ``N`` followers read the origin through the link;
- ``mirror``: one :class:`~deltastore.maintenance.mirror.Mirror` reads the origin through the
  link (``run_once`` once per poll interval) and writes to the MIRROR store (a local folder,
  or a second moto behind a ``lan`` link); the ``N`` followers read the mirror.

A follower is a :class:`~deltastore.Subscriber` (its own preallocated tensors, no lease,
unsigned, ``max_workers=2``, ``threads=1``) on a thread of the bench process, polling on a
fixed schedule: every ``poll_interval_s``, follower ``i`` of ``N`` offset by ``i / N`` of an
interval; at each tick ``latest()``, then ``sync()`` when it is behind. Its ``on_version``
callback stamps when it reached each version. The publisher commits a version (the time its
manifest's ``put_if_absent`` began, seen by a wrapper around its store), waits until every
follower has it (at most ``timeout_s``), then waits a varying share of an interval (the
golden-ratio sequence) so that commits fall at different phases of the polls. After the last
version an idle phase of ``idle_intervals`` polls counts what polling alone costs.

Every consumer's origin store is wrapped in a meter (:class:`_Meter`): one call = one store
operation, bytes = object bytes returned. Requests and bytes of version ``v`` are those made
in its window (its commit to the next commit); the version's stored bytes are read back from
the origin after the run. Results, checks: :mod:`deltastore.bench.fleet_schema`.

Runs in the bench process (threads: followers, the mirror loop, moto, the link's event loop).
:func:`run_fleet` is not reentrant; the meters and follower state are thread-safe as used.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deltastore.bench.fleet_schema import (
    FleetResult,
    FleetRun,
    Latency,
    Side,
    Traffic,
    VersionRow,
    fleet_checks,
    fleet_markdown,
)
from deltastore.bench.ops import digest, flat_buffer, load_average, stderr_log
from deltastore.bench.runner import (
    BenchStore,
    adamw_header,
    link_info,
    open_bench_store,
    run_header,
)
from deltastore.bench.workload import SIZES, Workload, WorkloadSpec
from deltastore.format.keys import MANIFEST_PREFIX, anchor_key, data_prefix, manifest_key
from deltastore.publish.publisher import Publisher
from deltastore.store import Store, open_store
from deltastore.store.wrapper import StoreWrapper
from deltastore.sync.subscriber import Subscriber
from deltastore.testing.link import LINKS, ShapedLink

Log = Callable[[str], None]
#: The mirror's reader id (its lease on the origin).
MIRROR_READER = "bench-fleet-mirror"
_READS = {"get", "get_range", "get_with_token"}


@dataclass
class FleetOptions:
    """What :func:`run_fleet` runs. ``followers``: the counts ``N``; ``versions``: deltas after
    the anchor; ``poll_interval_s``: every consumer's poll interval; ``link``: the profile
    (:data:`~deltastore.testing.link.LINKS`) between the remote consumers and the origin;
    ``mirror_store``: ``local`` (a folder) or ``moto`` (a second moto server behind a ``lan``
    link); ``sides``: which of ``direct`` and ``mirror`` to run; ``timeout_s``: the longest
    wait for every follower to reach a version."""

    size: str = "tiny"
    followers: Sequence[int] = (1, 8, 64)
    versions: int = 3
    poll_interval_s: float = 1.0
    idle_intervals: int = 3
    link: str = "cross-region"
    mirror_store: str = "local"
    sides: Sequence[Side] = ("direct", "mirror")
    lr: float = 1e-6
    seed: int = 0
    warmup: int = 1
    timeout_s: float = 60.0
    workdir: str | os.PathLike[str] | None = None
    log: Log = field(default=stderr_log, repr=False)


class _Ledger:
    """Every metered call: (consumer, ``time.monotonic()`` start, bytes returned)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: list[tuple[int, float, int]] = []

    def add(self, who: int, start: float, nbytes: int) -> None:
        with self._lock:
            self._rows.append((who, start, nbytes))

    def window(self, t0: float, t1: float, who: int | None = None) -> Traffic:
        """Calls started in ``[t0, t1)`` (by ``who`` only, when given) and their bytes."""
        with self._lock:
            rows = [r for r in self._rows if t0 <= r[1] < t1 and (who is None or r[0] == who)]
        return Traffic(requests=len(rows), bytes=sum(r[2] for r in rows))


class _Meter(StoreWrapper):
    """``inner`` with every call recorded in ``ledger`` as consumer ``who`` (failed calls too,
    with 0 bytes)."""

    def __init__(self, inner: Store, ledger: _Ledger, who: int) -> None:
        super().__init__(inner)
        self.ledger, self.who = ledger, who

    def _call(self, name: str, key: str, fn: Callable[[], Any]) -> Any:
        start, nbytes = time.monotonic(), 0
        try:
            out = fn()
            if name in _READS and out is not None:
                nbytes = len(out[0] if isinstance(out, tuple) else out)
            return out
        finally:
            self.ledger.add(self.who, start, nbytes)


class _CommitClock(StoreWrapper):
    """The publisher's store; ``commits[v]``: when the create of ``v``'s manifest began (the
    earliest a reader can see it: a read that starts while the create is in flight belongs
    to the new version's window, and latencies count from here)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.commits: dict[int, float] = {}

    def _call(self, name: str, key: str, fn: Callable[[], Any]) -> Any:
        start = time.monotonic()
        out = fn()
        if name == "put_if_absent" and key.startswith(MANIFEST_PREFIX):
            self.commits[int(key[len(MANIFEST_PREFIX) :].split(".")[0])] = start
        return out


class _Loop(threading.Thread):
    """A consumer polling on ``start + phase + k * interval`` until ``stop``; ``step`` runs at
    each tick, its errors counted (the loop goes on at the next tick)."""

    def __init__(self, name: str, start: float, phase: float, interval: float) -> None:
        super().__init__(name=name, daemon=True)
        self.t0, self.phase, self.interval = start, phase, interval
        self.stop = threading.Event()
        self.errors = 0
        self.first_error: str | None = None

    def step(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        k = 0
        while True:
            tick = self.t0 + self.phase + k * self.interval
            if self.stop.wait(max(0.0, tick - time.monotonic())):
                return
            try:
                self.step()
            except Exception as exc:  # counted and reported; retried at the next tick
                self.errors += 1
                if self.first_error is None:
                    self.first_error = f"{self.name}: {type(exc).__name__}: {exc}"
            k = max(k + 1, int((time.monotonic() - self.t0 - self.phase) / self.interval) + 1)


class _Follower(_Loop):
    """One follower: ``latest()``, then ``sync()`` when behind; ``reached[v]``: when its
    ``on_version`` saw ``v``."""

    def __init__(self, i: int, n: int, store: Store, tensors: Any, start: float, dt_: float):
        super().__init__(f"follower-{i}", start, dt_ * i / n, dt_)
        self.sub: Subscriber[Any] = Subscriber(
            store,
            tensors=tensors,
            trusted_keys=None,
            signing_key=None,
            lease_ttl=None,
            max_workers=2,
            threads=1,
        )
        self.reached: dict[int, float] = {}
        self.at = -1  # newest version reached (read by the publisher's thread)

    def _on_version(self, m: Any) -> None:
        self.reached[m.version] = time.monotonic()
        self.at = max(self.at, m.version)

    def step(self) -> None:
        newest = self.sub.latest()
        if newest is not None and newest != self.sub.version:
            self.sub.sync(newest, on_version=self._on_version)

    def when(self, version: int) -> float | None:
        """When it first held ``version`` or a later one (None: never)."""
        later = [t for v, t in self.reached.items() if v >= version]
        return min(later) if later else None


class _MirrorLoop(_Loop):
    """The mirror: ``run_once`` per tick; ``passes[v]``: (start, end) of the pass that copied
    ``v``."""

    def __init__(self, source: Store, dest: Store, start: float, interval: float) -> None:
        super().__init__("mirror", start, 0.0, interval)
        from deltastore.maintenance.mirror import Mirror

        self.mirror = Mirror(
            source, dest, trusted_keys=None, signing_key=None, reader_id=MIRROR_READER
        )
        self.passes: dict[int, tuple[float, float]] = {}

    def step(self) -> None:
        t0 = time.monotonic()
        report = self.mirror.run_once()
        t1 = time.monotonic()
        for v in report.copied:
            self.passes[v] = (t0, t1)


@dataclass
class _Env:
    """What every run shares: the workload, the origin and its link, the followers' buffers."""

    options: FleetOptions
    wl: Workload
    words: list[np.ndarray]
    origin: BenchStore
    link: ShapedLink
    remote_options: dict[str, Any]
    mirror: BenchStore | None
    flats: list[np.ndarray]


def _mirror_available() -> bool:
    try:
        from deltastore.maintenance.mirror import Mirror  # noqa: F401
    except ImportError:
        return False
    return True


def _stored_bytes(store: Store, version: int) -> int:
    """Bytes of what ``version`` added to ``store``: data objects, manifest, anchor copy."""
    keys = [*store.list(data_prefix(version)), manifest_key(version)]
    keys += [k for k in [anchor_key(version)] if store.exists(k)]
    return sum(len(store.get(k)) for k in keys)


def _clear(store: Store) -> None:
    for key in store.list():
        store.delete(key)


@contextmanager
def _mirror_dest(env: _Env, prefix: str) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """The mirror store of one run (url, options); emptied afterwards."""
    if env.mirror is None:
        root = tempfile.mkdtemp(prefix="deltastore-fleet-mirror-")
        try:
            yield root, None
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return
    url = env.mirror.url(prefix)
    try:
        yield url, env.mirror.storage_options
    finally:
        _clear(open_store(url, env.mirror.storage_options))


def _run(env: _Env, side: Side, n: int) -> FleetRun:
    """``n`` followers reading ``side``, every version published once (module docstring)."""
    opts, log, wl = env.options, env.options.log, env.wl
    interval = opts.poll_interval_s
    prefix = f"{side}-n{n}"
    url = env.origin.url(prefix)
    ledger, reads = _Ledger(), _Ledger()
    clock = _CommitClock(open_store(url, env.origin.storage_options))
    t_run = time.monotonic()
    env.link.reset()
    with ExitStack() as stack:
        dest_url, dest_options = stack.enter_context(_mirror_dest(env, prefix))
        start = time.monotonic() + 0.2
        loops: list[_Loop] = []
        mirror: _MirrorLoop | None = None
        if side == "mirror":
            source = _Meter(open_store(url, env.remote_options), ledger, -1)
            mirror = _MirrorLoop(source, open_store(dest_url, dest_options), start, interval)
            loops.append(mirror)
        followers = []
        for i in range(n):
            env.flats[i].fill(0)
            if side == "direct":
                store: Store = _Meter(open_store(url, env.remote_options), ledger, i)
            else:
                store = _Meter(open_store(dest_url, dest_options), reads, i)
            followers.append(_Follower(i, n, store, wl.tensors(env.flats[i]), start, interval))
        loops += followers
        for loop in loops:
            loop.start()
        pub = Publisher(clock, signing_key=None)
        commits: list[float] = []
        kinds: list[str] = []
        time.sleep(0.2 + interval)
        for v, words in enumerate(env.words):
            report = pub.publish(wl.tensors(words), version=v)
            commits.append(clock.commits[v])
            kinds.append(report.kind)
            deadline = time.monotonic() + opts.timeout_s
            while min(f.at for f in followers) < v and time.monotonic() < deadline:
                time.sleep(0.01)
            slowest = max((f.when(v) or deadline) - commits[v] for f in followers)
            log(f"  [{side} n={n}] v{v} ({report.kind}): last follower {slowest:.3f} s")
            time.sleep(interval * (((v + 1) * 0.6180339887) % 1.0))
        t_idle = time.monotonic()
        time.sleep(opts.idle_intervals * interval)
        t_end = time.monotonic()
        for loop in loops:
            loop.stop.set()
        for loop in loops:
            loop.join()
        if mirror is not None:
            mirror.mirror.close()
        last = len(env.words) - 1
        exact = all(
            f.sub.version == last and digest([env.flats[i]]) == wl.index.digests[last]
            for i, f in enumerate(followers)
        )
        stored = [_stored_bytes(clock.inner, v) for v in range(len(env.words))]
        _clear(clock.inner)
    link_requests = sum(1 for r in env.link.snapshot() if t_run <= r.start < t_end)
    rows = []
    for v, commit in enumerate(commits):
        end = commits[v + 1] if v + 1 < len(commits) else t_idle
        traffic = ledger.window(commit, end)
        times = [f.when(v) for f in followers]
        samples = [t - commit for t in times if t is not None]
        copy = mirror.passes.get(v) if mirror is not None else None
        rows.append(
            VersionRow(
                version=v,
                kind="anchor" if kinds[v] == "anchor" else "delta",
                stored_bytes=stored[v],
                window_s=end - commit,
                origin=traffic,
                per_follower_requests=traffic.requests / n,
                per_follower_bytes=traffic.bytes / n,
                bytes_ratio=traffic.bytes / max(stored[v], 1),
                requests_per_interval=traffic.requests * interval / max(end - commit, 1e-9),
                latency=Latency.of(samples or [float(opts.timeout_s)], missing=n - len(samples)),
                copy_s=None if copy is None else copy[1] - copy[0],
                mirror_lag_s=None if copy is None else copy[1] - commit,
            )
        )
    idle = ledger.window(t_idle, t_end)
    errors = [(lp.errors, lp.first_error) for lp in loops if lp.errors]
    first_error = errors[0][1] if errors else None
    if first_error is not None:
        log(f"  [{side} n={n}] {sum(e for e, _ in errors)} errors; first: {first_error}")
    return FleetRun(
        side=side,
        followers=n,
        versions=rows,
        idle_s=t_end - t_idle,
        idle=idle,
        idle_requests_per_interval=idle.requests * interval / (t_end - t_idle),
        mirror_reads=reads.window(t_run, t_end) if side == "mirror" else None,
        link_requests=link_requests,
        origin_requests=ledger.window(t_run, t_end).requests,
        errors=sum(e for e, _ in errors),
        first_error=first_error,
        exact=exact and all(r.latency.missing == 0 for r in rows),
        wall_s=t_end - t_run,
    )


# --- the run -------------------------------------------------------------------------------


def run_fleet(options: FleetOptions) -> FleetResult:
    """Every followers count, each side (module docstring); the workload generated first when
    it is not cached."""
    t_start, load_start = time.perf_counter(), load_average()
    if options.size not in SIZES:
        raise ValueError(f"unknown size {options.size!r}; choose one of {sorted(SIZES)}")
    if not options.followers or min(options.followers) < 1:
        raise ValueError("followers: give counts of at least 1")
    if options.link not in LINKS:
        raise ValueError(f"unknown link {options.link!r}; choose one of {', '.join(LINKS)}")
    if options.mirror_store not in ("local", "moto"):
        raise ValueError("mirror_store: local or moto")
    log = options.log
    spec = WorkloadSpec(
        size=options.size,
        lr=options.lr,
        seed=options.seed,
        warmup=options.warmup,
        versions=options.versions,
    )
    wl, generated = Workload.ensure(spec, options.workdir, log)
    words = [wl.read(i) for i in range(wl.files)]
    have_mirror = _mirror_available()
    skipped = [] if have_mirror else ["mirror: deltastore.maintenance.mirror is not importable"]
    sides = [s for s in options.sides if s == "direct" or have_mirror]
    run_id = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S-") + uuid.uuid4().hex[:6]
    profile = LINKS[options.link]
    runs: list[FleetRun] = []
    with ExitStack() as stack:
        origin = stack.enter_context(open_bench_store("moto", run_id))
        assert origin.storage_options is not None
        port = int(origin.storage_options["endpoint_url"].rsplit(":", 1)[1])
        link = stack.enter_context(ShapedLink(port, profile))
        remote = {**origin.storage_options, "endpoint_url": link.endpoint}
        mirror = None
        if options.mirror_store == "moto":
            # moto's state is per process: the second server's objects go under a prefix of
            # their own (one bucket in both)
            mirror = stack.enter_context(
                open_bench_store("moto", f"{run_id}-mirror", link=LINKS["lan"])
            )
        env = _Env(
            options=options,
            wl=wl,
            words=words,
            origin=origin,
            link=link,
            remote_options=remote,
            mirror=mirror,
            flats=[flat_buffer(wl.numel) for _ in range(max(options.followers))],
        )
        log(
            f"fleet: workload {wl.folder.name} ({wl.numel / 1e6:.1f}M elements), versions 0-"
            f"{options.versions}, poll {options.poll_interval_s:g} s, origin moto+"
            f"{profile.name}, mirror {options.mirror_store}"
        )
        for n in options.followers:
            for side in sides:
                run = _run(env, side, n)
                runs.append(run)
                log(
                    f"  [{side} n={n}] idle {run.idle_requests_per_interval:.2f} requests per "
                    f"interval; exact {'yes' if run.exact else 'NO'}; {run.wall_s:.1f} s"
                )
    label = f"moto+{profile.name}"
    return FleetResult(
        **dict(run_header()),
        **dict(adamw_header(wl, generated)),
        versions=options.versions,
        origin=label,
        link=link_info(profile, wl.dense_bytes),
        mirror_store="local" if options.mirror_store == "local" else "moto+lan",
        poll_interval_s=options.poll_interval_s,
        followers=list(options.followers),
        mirror=have_mirror,
        runs=runs,
        checks=fleet_checks(runs, options.poll_interval_s, label),
        exact=all(r.exact for r in runs),
        skipped=skipped,
        load_average=[load_start, load_average()],
        wall_s=time.perf_counter() - t_start,
    )


__all__ = ["MIRROR_READER", "FleetOptions", "fleet_markdown", "run_fleet"]
