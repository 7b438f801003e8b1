"""``deltastore bench --mode signing``: what Ed25519 signing costs a publish and a sync.

The workload is the bench's (:mod:`deltastore.bench.workload`, cached): version 0 (the base)
and version 1, one AdamW step later (at the default learning rate :data:`DEFAULT_LR`, ~1.7% of
the bf16 elements change). Two sides run the same operations through the same store:

- ``off``: ``Publisher(signing_key=None)``, ``Subscriber(trusted_keys=None, signing_key=None)``
  (explicit None: the environment's ``DELTASTORE_*`` keys are not read);
- ``on``: ``Publisher(signing_key=key)`` with an :class:`~deltastore.Ed25519Key` made for the
  run, ``Subscriber(trusted_keys=[key.public_key()], signing_key=None)``: every manifest's
  signature and every frame's BLAKE3 is checked.

Measured, per side: ``anchor publish`` (a new publisher, fresh prefix, publishes version 0),
``delta publish`` (it then publishes version 1), ``anchor sync`` (a fresh subscriber syncs
version 0 into preallocated tensors, zeroed untimed before) and ``delta sync`` (a subscriber
handed tensors at version 0, checked untimed with ``verify()``, syncs version 1). Times are
the whole ``Publisher.publish`` / ``Subscriber.sync`` call. Subscribers write no lease
(``lease_ttl=None``). Every sync is checked bit for bit against the workload's digest.

One untimed round comes first (it publishes the stores the syncs read and warms kernels and
caches), then ``repeats`` rounds; in each, every operation runs once per side, the side that
goes first alternating from round to round, and then the floors once: BLAKE3 of each
version's stored frames (read untimed from the signed store), the manifest's canonical bytes,
one Ed25519 signature and one check of them (the last three each the mean of :data:`INNER`
calls). Each comparison reports the median and minimum of its samples, ``on / off`` of both,
``on - off`` of the medians, and the floor it adds.

Runs in the bench process (no worker processes: memory is not measured here); holds the base,
the next version, the subscribers' tensors and one publisher's snapshot at a time (~4 dense
copies of the model). Not thread-safe.
"""

from __future__ import annotations

import datetime as dt
import gc
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from deltastore.bench.fmt import nbytes, table
from deltastore.bench.ops import digest, flat_buffer, load_average, stderr_log
from deltastore.bench.runner import (
    BenchStore,
    StoreUnavailable,
    adamw_header,
    open_bench_store,
    run_header,
)
from deltastore.bench.signing_schema import (
    Comparison,
    Floors,
    OpKind,
    SigningResult,
    StoreSigning,
    Timing,
)
from deltastore.bench.workload import SIZES, Workload, WorkloadSpec
from deltastore.format.ed25519 import Ed25519Key, PublicKey, frame_digest
from deltastore.format.manifest import Manifest
from deltastore.publish.publisher import Publisher, PublishReport
from deltastore.store import open_store
from deltastore.sync.subscriber import Subscriber

Log = Callable[[str], None]
Side = Literal["off", "on"]

#: The sides, in the order the first round runs them (each round after swaps it).
SIDES: tuple[Side, Side] = ("off", "on")
DEFAULT_SIZE = "medium"
#: The default learning rate: one AdamW step from the stationary state changes ~1.7% of the
#: bf16 elements (the transfer bench's 1e-6 changes ~0.8%).
DEFAULT_LR = 2.5e-6
#: Calls per sample of the sub-millisecond floors (canonical bytes, sign, verify).
INNER = 20
#: The id of the Ed25519 key made for a run.
KEY_ID = "bench-signing"
#: The operations compared, in report order: (name, kind, version).
OPERATIONS: tuple[tuple[str, OpKind, int], ...] = (
    ("anchor publish", "publish", 0),
    ("delta publish", "publish", 1),
    ("anchor sync", "sync", 0),
    ("delta sync", "sync", 1),
)


@dataclass
class SigningOptions:
    """What :func:`run_signing` runs. ``stores``: as :class:`~deltastore.bench.BenchOptions`
    (``local``: a temporary folder, ``moto``: a moto S3 server, or store URLs with
    ``storage_options``); ``repeats``: timed rounds (at least 1); ``lr``, ``seed``,
    ``warmup``: the workload's (:class:`~deltastore.bench.workload.WorkloadSpec`, one measured
    version)."""

    size: str = DEFAULT_SIZE
    stores: Sequence[str] = ("local",)
    repeats: int = 5
    lr: float = DEFAULT_LR
    seed: int = 0
    warmup: int = 1
    workdir: str | os.PathLike[str] | None = None
    storage_options: dict[str, Any] | None = None
    log: Log = field(default=stderr_log, repr=False)


def _clear(url: str, storage_options: dict[str, Any] | None) -> None:
    """Delete every object under ``url``."""
    target = open_store(url, storage_options)
    for key in target.list():
        target.delete(key)


def _signed(m: Manifest) -> bool:
    """Whether ``m`` carries an Ed25519 signature and a BLAKE3 in every frame."""
    frames = [f for t in m.tensors.values() for f in t.frames]
    return (
        m.signature is not None
        and m.signature.algorithm == "ed25519"
        and all(f.blake3 is not None for f in frames)
    )


def _unsigned(m: Manifest) -> bool:
    """Whether ``m`` carries neither a signature nor any frame's BLAKE3."""
    return m.signature is None and all(
        f.blake3 is None for t in m.tensors.values() for f in t.frames
    )


class _FloorData:
    """One version's inputs to the floors: its signed manifest, the canonical bytes, and
    every frame's stored bytes (memoryviews into whole objects read once, untimed)."""

    def __init__(self, store: BenchStore, version: int, signed: Manifest, unsigned: Manifest):
        target = open_store(store.url("sync-on"), store.storage_options)
        frames = [f for t in signed.tensors.values() for f in t.frames]
        blobs = {o: memoryview(target.get(o)) for o in sorted({f.object for f in frames})}
        self.version = version
        self.manifest = signed
        self.canonical = signed.canonical_bytes()
        self.unsigned_bytes = len(unsigned.canonical_bytes())
        self.views = [blobs[f.object][f.offset : f.offset + f.length] for f in frames]
        self.payload_bytes = sum(f.length for f in frames)
        self.samples: dict[str, list[float]] = {
            k: [] for k in ("blake3", "canonical", "sign", "verify")
        }

    def measure(self, key: Ed25519Key, public: PublicKey) -> None:
        """One sample of each floor (the sub-millisecond ones: the mean of INNER calls)."""
        t0 = time.perf_counter()
        for view in self.views:
            frame_digest(view)
        self.samples["blake3"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(INNER):
            self.manifest.canonical_bytes()
        self.samples["canonical"].append((time.perf_counter() - t0) / INNER)
        t0 = time.perf_counter()
        for _ in range(INNER):
            sig = key.sign(self.canonical)
        self.samples["sign"].append((time.perf_counter() - t0) / INNER)
        ok = True
        t0 = time.perf_counter()
        for _ in range(INNER):
            ok = public.verify(self.canonical, sig) and ok
        self.samples["verify"].append((time.perf_counter() - t0) / INNER)
        if not ok:
            raise AssertionError("the bench's own Ed25519 signature did not verify")

    def floors(self) -> Floors:
        s = self.samples
        return Floors(
            version=self.version,
            payload_bytes=self.payload_bytes,
            frames=len(self.views),
            manifest_bytes=len(self.canonical),
            unsigned_manifest_bytes=self.unsigned_bytes,
            inner=INNER,
            blake3=Timing.of(s["blake3"]),
            canonical=Timing.of(s["canonical"]),
            sign=Timing.of(s["sign"]),
            verify=Timing.of(s["verify"]),
        )


class _StoreRun:
    """The comparisons through one store (see the module docstring)."""

    def __init__(
        self,
        store: BenchStore,
        wl: Workload,
        words: tuple[np.ndarray, np.ndarray],
        key: Ed25519Key,
        options: SigningOptions,
    ) -> None:
        self.store, self.wl, self.options = store, wl, options
        self.base = words[0]
        self.versions = [wl.tensors(w) for w in words]
        self.flat = flat_buffer(wl.numel)  # the subscribers' tensors
        self.tensors = wl.tensors(self.flat)
        self.key, self.public = key, key.public_key()
        self.samples: dict[tuple[str, Side], list[float]] = {}
        self.payload: dict[int, int] = {}
        self.exact = True

    # --- one operation of one side -----------------------------------------------------

    def _note(self, name: str, side: Side, seconds: float, timed: bool) -> None:
        if timed:
            self.samples.setdefault((name, side), []).append(seconds)

    def publish(self, side: Side, prefix: str, timed: bool) -> tuple[PublishReport, ...]:
        """A new publisher under ``prefix`` publishes version 0 then version 1."""
        pub = Publisher(
            self.store.url(prefix),
            storage_options=self.store.storage_options,
            signing_key=self.key if side == "on" else None,
        )
        reports = []
        for name, version in (("anchor publish", 0), ("delta publish", 1)):
            t0 = time.perf_counter()
            rep = pub.publish(self.versions[version], version=version)
            self._note(name, side, time.perf_counter() - t0, timed)
            reports.append(rep)
        del pub
        gc.collect()  # its snapshot, before the next publisher makes one
        return tuple(reports)

    def _subscriber(self, side: Side, version: int | None) -> Subscriber[Any]:
        return Subscriber(
            self.store.url(f"sync-{side}"),
            storage_options=self.store.storage_options,
            tensors=self.tensors,
            version=version,
            trusted_keys=[self.public] if side == "on" else None,
            signing_key=None,
            lease_ttl=None,
        )

    def sync(self, side: Side, timed: bool) -> None:
        """A fresh subscriber syncs version 0; a follower at version 0 syncs version 1."""
        self.flat.fill(0)  # untimed: the anchor sync must write every word
        sub = self._subscriber(side, None)
        t0 = time.perf_counter()
        rep = sub.sync(0)
        self._note("anchor sync", side, time.perf_counter() - t0, timed)
        self._check(0, rep.kind == "anchor", side)
        np.copyto(self.flat, self.base)
        sub = self._subscriber(side, 0)
        sub.verify()  # untimed: the check of tensors handed over at a version
        t0 = time.perf_counter()
        rep = sub.sync(1)
        self._note("delta sync", side, time.perf_counter() - t0, timed)
        self._check(1, rep.kind == "delta", side)

    def _check(self, version: int, kind_ok: bool, side: Side) -> None:
        ok = kind_ok and digest([self.flat]) == self.wl.index.digests[version]
        if not ok:
            self.options.log(f"  [{self.store.label}] {side}: sync of {version} NOT BIT-EXACT")
        self.exact = self.exact and ok

    # --- the run ---------------------------------------------------------------------

    def run(self) -> StoreSigning:
        label, log = self.store.label, self.options.log
        for side in SIDES:  # untimed: the stores the syncs read; warms kernels and caches
            reports = self.publish(side, f"sync-{side}", timed=False)
            if side == "on":
                self.payload = {r.version: r.payload_bytes for r in reports}
        for side in SIDES:
            self.sync(side, timed=False)
        manifests = {
            side: [self._subscriber(side, None).manifest(v) for v in (0, 1)] for side in SIDES
        }
        signed = all(_signed(m) for m in manifests["on"])
        unsigned = all(_unsigned(m) for m in manifests["off"])
        data = [_FloorData(self.store, v, manifests["on"][v], manifests["off"][v]) for v in (0, 1)]
        for rep in range(self.options.repeats):
            order = SIDES if rep % 2 == 0 else SIDES[::-1]
            for side in order:
                prefix = f"publish-{side}-{rep}"
                self.publish(side, prefix, timed=True)
                _clear(self.store.url(prefix), self.store.storage_options)
            for side in order:
                self.sync(side, timed=True)
            for d in data:
                d.measure(self.key, self.public)
            each = "; ".join(
                f"{name} {self.samples[name, 'off'][-1]:.3f} / {self.samples[name, 'on'][-1]:.3f}"
                for name, _, _ in OPERATIONS
            )
            log(f"  [{label}] round {rep + 1}/{self.options.repeats} (off / on, s): {each}")
        floors = [d.floors() for d in data]
        return StoreSigning(
            store=label,
            comparisons=[self._compare(n, k, v, floors[v]) for n, k, v in OPERATIONS],
            floors=floors,
            signed=signed,
            unsigned=unsigned,
            exact=self.exact,
        )

    def _compare(self, name: str, kind: OpKind, version: int, floor: Floors) -> Comparison:
        return compare(
            name,
            kind,
            version,
            self.payload[version],
            Timing.of(self.samples[name, "off"]),
            Timing.of(self.samples[name, "on"]),
            floor,
            exact=self.exact if kind == "sync" else True,
        )


def floor_s(kind: OpKind, floor: Floors) -> float:
    """What signing adds to one operation at least (medians, seconds): BLAKE3 of the
    version's frames, its canonical bytes, and a signature (publish) or a check (sync)."""
    last = floor.sign if kind == "publish" else floor.verify
    return floor.blake3.median_s + floor.canonical.median_s + last.median_s


def compare(
    name: str,
    kind: OpKind,
    version: int,
    payload_bytes: int,
    off: Timing,
    on: Timing,
    floor: Floors,
    *,
    exact: bool,
) -> Comparison:
    """The comparison of ``off`` and ``on`` (ratios of the medians and of the minimums, the
    extra median time) with the floor of ``kind`` (:func:`floor_s`)."""
    return Comparison(
        name=name,
        op=kind,
        version=version,
        payload_bytes=payload_bytes,
        off=off,
        on=on,
        ratio_median=on.median_s / max(off.median_s, 1e-12),
        ratio_min=on.min_s / max(off.min_s, 1e-12),
        extra_median_s=on.median_s - off.median_s,
        floor_s=floor_s(kind, floor),
        exact=exact,
    )


def run_signing(options: SigningOptions) -> SigningResult:
    """Run the comparisons through every store (see the module docstring)."""
    t_start = time.perf_counter()
    load_start = load_average()
    if options.size not in SIZES:
        raise ValueError(f"unknown size {options.size!r}; choose one of {sorted(SIZES)}")
    if options.repeats < 1:
        raise ValueError("repeats must be at least 1")
    log = options.log
    spec = WorkloadSpec(
        size=options.size, lr=options.lr, seed=options.seed, warmup=options.warmup, versions=1
    )
    wl, generated = Workload.ensure(spec, options.workdir, log)
    changed = wl.index.changed[1]
    log(
        f"signing: workload {wl.folder.name}: {wl.numel / 1e6:.0f}M elements, delta "
        f"{100 * changed / wl.numel:.2f}% changed; {options.repeats} rounds"
    )
    words = (wl.read(0), wl.read(1))
    key = Ed25519Key.generate(KEY_ID)
    run_id = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S-") + uuid.uuid4().hex[:6]
    stores: list[StoreSigning] = []
    skipped: list[str] = []
    for name in options.stores:
        try:
            with open_bench_store(name, run_id, options.storage_options) as store:
                log(f"store {store.label}: {store.root}")
                stores.append(_StoreRun(store, wl, words, key, options).run())
        except StoreUnavailable as exc:
            log(f"store {name} skipped: {exc}")
            skipped.append(f"{name}: {exc}")
    return SigningResult(
        **dict(run_header()),
        **dict(adamw_header(wl, generated)),
        changed_elements=changed,
        density=changed / wl.numel,
        repeats=options.repeats,
        key_id=KEY_ID,
        stores=stores,
        exact=all(s.exact for s in stores),
        skipped=skipped,
        load_average=[load_start, load_average()],
        wall_s=time.perf_counter() - t_start,
    )


# --- the report ----------------------------------------------------------------------------


def ms(seconds: float, signed: bool = False) -> str:
    """Seconds as milliseconds, with 3 significant digits or so (``+`` first when
    ``signed`` and not negative)."""
    v = 1e3 * seconds
    digits = 0 if abs(v) >= 100 else 1 if abs(v) >= 1 else 2 if abs(v) >= 0.1 else 3
    return f"{v:+.{digits}f} ms" if signed else f"{v:.{digits}f} ms"


def spread(t: Timing) -> float:
    """The largest sample over the smallest: how far apart the repeats of one side are (an
    on / off ratio closer to 1 than this is within the run's noise)."""
    return max(t.samples_s) / max(t.min_s, 1e-12)


def summary_line(c: Comparison, floor: Floors) -> str:
    """``delta publish: 1.01x (+2.1 ms; floor: BLAKE3 of 12.3 MB = 2.0 ms + canonical bytes
    0.3 ms + sign 0.05 ms)``."""
    last = ("sign", floor.sign) if c.op == "publish" else ("verify", floor.verify)
    return (
        f"{c.name}: {c.ratio_median:.3f}x ({ms(c.extra_median_s, signed=True)}; floor: "
        f"BLAKE3 of {nbytes(floor.payload_bytes)} = {ms(floor.blake3.median_s)} + canonical "
        f"bytes {ms(floor.canonical.median_s)} + {last[0]} {ms(last[1].median_s)} = "
        f"{ms(c.floor_s)})"
    )


def signing_markdown(result: SigningResult) -> str:
    """The report: per store, the comparisons (ratios, extra time, floors) and the floors."""
    m = result.machine
    load = ", ".join(f"{x:.1f}" for x in result.load_average)
    lines = [
        f"## deltastore bench --mode signing: {result.size}, {result.elements / 1e6:.0f}M "
        f"elements ({result.dense_bytes / 1e6:.0f} MB bf16)",
        "",
        f"Machine: {m.cpu_model}, {m.cores} cores; deltastore {m.deltastore}. {result.created}, "
        f"wall {result.wall_s:.0f} s, load average {load}. Unsigned (off) vs Ed25519-signed "
        f"(on), {result.repeats} interleaved rounds, median and minimum; the delta changes "
        f"{100 * result.density:.2f}% of the elements (lr {result.lr:g}). "
        f"Exact: {'yes' if result.exact else 'NO'}. Spread: each side's largest sample over "
        "its smallest; an on/off ratio nearer 1 than that is within this run's noise, and "
        "the floors are the least signing adds.",
        "",
    ]
    for s in result.stores:
        floors = {f.version: f for f in s.floors}
        checks = (
            "signed manifests carry ed25519 + per-frame blake3: "
            f"{'yes' if s.signed else 'NO'}; unsigned carry neither: "
            f"{'yes' if s.unsigned else 'NO'}"
        )
        rows = [
            [
                c.name,
                f"{c.payload_bytes / 1e6:.2f}",
                f"{c.off.median_s:.4f}",
                f"{c.on.median_s:.4f}",
                f"{c.off.min_s:.4f}",
                f"{c.on.min_s:.4f}",
                f"{c.ratio_median:.3f}",
                f"{c.ratio_min:.3f}",
                ms(c.extra_median_s, signed=True),
                ms(c.floor_s),
                f"{spread(c.off):.2f} / {spread(c.on):.2f}",
            ]
            for c in s.comparisons
        ]
        head = ["operation", "payload MB", "off median s", "on median s", "off min s"]
        head += ["on min s", "on/off median", "on/off min", "on - off", "floor"]
        head += ["spread off / on"]
        lines += [f"### {s.store}", "", f"{checks}.", "", *table(head, rows), ""]
        lines += [f"- {summary_line(c, floors[c.version])}" for c in s.comparisons]
        frows = [
            [
                str(f.version),
                f"{f.payload_bytes / 1e6:.2f}",
                str(f.frames),
                ms(f.blake3.median_s),
                f"{f.payload_bytes / max(f.blake3.median_s, 1e-12) / 1e9:.2f}",
                f"{f.manifest_bytes / 1e3:.1f} / {f.unsigned_manifest_bytes / 1e3:.1f}",
                ms(f.canonical.median_s),
                ms(f.sign.median_s),
                ms(f.verify.median_s),
            ]
            for f in s.floors
        ]
        fhead = ["version", "payload MB", "frames", "BLAKE3", "BLAKE3 GB/s"]
        fhead += ["manifest kB (signed / unsigned)", "canonical bytes", "sign", "verify"]
        lines += ["", "Floors (medians; one thread):", "", *table(fhead, frows), ""]
    lines += [f"- skipped: {s}" for s in result.skipped]
    return "\n".join(lines) + "\n"


__all__ = [
    "DEFAULT_LR",
    "DEFAULT_SIZE",
    "INNER",
    "OPERATIONS",
    "SigningOptions",
    "compare",
    "floor_s",
    "run_signing",
    "signing_markdown",
    "spread",
    "summary_line",
]
