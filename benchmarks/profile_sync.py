"""Profile the local sync of one delta: deltastore's Subscriber.sync against the receiver floors.

Loads the cached benchmark workload (``deltastore bench --size <size>`` writes it under
``~/.cache/deltastore/bench/``), publishes its base and measured versions once into a local
store (kept under ``--store``, reused by later runs), then times ``Subscriber.sync`` from the
base to ``--version`` ``--repeats`` times, each with fresh tensors at the parent (a copy of the
base, checked by ``Subscriber.verify`` untimed, as the benchmark does), with the peak extra RSS
of each sync (the benchmark's meter), and checks every result bit-exact. Then it measures the
receiver floor and the pause floor (one bare scatter) with :mod:`deltastore.bench.floors` on
the same changes, into the same buffer, and prints the ratios the bar (benchmarks/README.md) uses.

    .venv/bin/python benchmarks/profile_sync.py                      # medium, v0 -> v1
    .venv/bin/python benchmarks/profile_sync.py --size small --repeats 9
    .venv/bin/py-spy record -o profile.svg --native -- \\
        .venv/bin/python benchmarks/profile_sync.py --repeats 20 --no-floors

Times are wall times; on a shared machine compare runs made back to back.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from deltastore.bench import floors
from deltastore.bench.ops import RssMeter, digest
from deltastore.bench.workload import Workload, WorkloadSpec, default_workdir
from deltastore.format.keys import manifest_key
from deltastore.publish.publisher import Publisher
from deltastore.store import open_store
from deltastore.sync.subscriber import Subscriber


def publish_once(url: str, wl: Workload, last: int) -> None:
    """Publish versions ``0..last`` of the workload into ``url`` unless already there."""
    store = open_store(url)
    if store.exists(manifest_key(last)):
        return
    if store.exists(manifest_key(0)):
        raise SystemExit(f"{url} holds a partial chain; remove it and run again")
    pub = Publisher(store)
    flat = wl.read(0)
    for v in range(last + 1):
        if v:
            wl.read_into(v, flat)
        rep = pub.publish(wl.tensors(flat), version=v)
        print(f"published v{v}: {rep.payload_bytes / 1e6:.2f} MB", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="medium")
    ap.add_argument("--version", type=int, default=1, help="the delta to sync (from v - 1)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--store", default=None, help="store folder (default /tmp/deltastore-prof-*)")
    ap.add_argument("--workers", type=int, default=4, help="Subscriber max_workers")
    ap.add_argument("--no-floors", action="store_true")
    args = ap.parse_args(argv)

    spec = WorkloadSpec(size=args.size)
    wl = Workload.load(Path(default_workdir()) / spec.key)
    version = args.version
    if not 1 <= version < wl.files:
        raise SystemExit(f"--version must be in [1, {wl.files - 1}]")
    url = args.store or str(Path(tempfile.gettempdir()) / f"deltastore-prof-{spec.key}")
    publish_once(url, wl, wl.files - 1)
    store = open_store(url)

    parent = wl.read(version - 1)
    flat = parent.copy()
    expect = wl.index.digests[version]
    totals, pauses, rss, cpus = [], [], [], []
    for _ in range(args.repeats):
        np.copyto(flat, parent)
        sub = Subscriber(
            store, tensors=wl.tensors(flat), version=version - 1, max_workers=args.workers
        )
        sub.verify()
        with RssMeter() as meter:
            t0, c0 = time.perf_counter(), time.process_time()
            rep = sub.sync(version)
            total, cpu = time.perf_counter() - t0, time.process_time() - c0
        if digest([flat]) != expect:
            raise SystemExit("sync is not bit-exact")
        totals.append(total)
        cpus.append(cpu)
        pauses.append(rep.pause_s)
        rss.append(meter.extra_bytes)
        print(
            f"sync {total * 1e3:7.1f} ms (cpu {cpu * 1e3:6.1f})  "
            f"pause {rep.pause_s * 1e3:6.1f} ms  "
            f"verify {rep.verify_s * 1e3:5.1f} ms  fetch+decode(thread-s) "
            f"{(rep.fetch_s + rep.decode_s) * 1e3:6.1f} ms  rss +{meter.extra_bytes / 1e6:.1f} MB",
            file=sys.stderr,
        )
    changed = wl.index.changed[version]
    model = wl.dense_bytes
    print(f"\n{args.size}: {changed} changes of {wl.numel} elements, v{version - 1} -> v{version}")
    print(f"sync   min {min(totals) * 1e3:.1f} ms  median {statistics.median(totals) * 1e3:.1f} ms")
    print(f"pause  min {min(pauses) * 1e3:.1f} ms  median {statistics.median(pauses) * 1e3:.1f} ms")
    print(f"cpu    min {min(cpus) * 1e3:.1f} ms  median {statistics.median(cpus) * 1e3:.1f} ms")
    print(f"rss    max +{max(rss) / 1e6:.1f} MB = {max(rss) / model * 100:.2f}% of the model")
    if not args.no_floors:
        fl = floors.measure(store, wl, flat, version)
        print(
            f"floor  {fl.receiver_floor_s * 1e3:.1f} ms (decompress {fl.decompress_s * 1e3:.1f}, "
            f"gather {fl.gather_s * 1e3:.1f}, checksum {fl.checksum_s * 1e3:.1f}, "
            f"scatter {fl.scatter_s * 1e3:.1f}); bare scatter {fl.scatter_floor_s * 1e3:.1f} ms"
        )
        rf, sf = fl.receiver_floor_s, fl.scatter_floor_s
        print(
            f"sync / floor {statistics.median(totals) / rf:.2f} (min {min(totals) / rf:.2f})   "
            f"pause / scatter floor {statistics.median(pauses) / sf:.2f} "
            f"(min {min(pauses) / sf:.2f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
