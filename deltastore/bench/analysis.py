"""From measured samples to medians, ratios, floors and the performance bar (benchmarks/README.md).

Pure functions of the measured samples; thread-safe."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TypeVar

from pydantic import BaseModel

from deltastore.bench.schema import (
    BASELINES,
    BarCheck,
    Floors,
    FloorSample,
    Medians,
    MethodResult,
    PublishSample,
    PublishTimes,
    Ratios,
    ScalingResult,
    Serving,
    ServingSample,
    StoreResult,
    SyncSample,
    SyncTimes,
    SystemName,
)

M = TypeVar("M", bound=BaseModel)

#: The bar (benchmarks/README.md), thresholds by name. Ratios "vs dense" are against the
#: strongest dense.
BYTES_PER_CHANGED_MAX = 1.30
PUBLISH_BOUND_MAX = 1.5
#: dense sync / deltastore sync: an object store (>= 20x faster); a local store's ratio is
#: reported without a bar.
SYNC_VS_DENSE_REMOTE_MIN = 20.0
SUBSCRIBER_RSS_MAX = 0.05
#: Through a shaped link (docs/stores.md): dense sync / deltastore sync, against the strongest
#: dense (parallel ranged GETs through the same link); sequential round trips of a sync
#: (deltastore is told the version, as every baseline: the manifest, then its frames; a
#: follower that finds it by polling pays the poll too); requests of a poll that finds
#: nothing new.
SYNC_VS_DENSE_LINK_MIN = 30.0
SYNC_ROUND_TRIPS_MAX = 3
POLL_REQUESTS_MAX = 1
#: Kept from the schema-1 bar (the schema-2 bar bounds the pause by the scatter floor too).
PAUSE_FRACTION_MAX = 0.20
SCALING_MAX = 1.3
#: deltastore sync / receiver floor (local stores), pause / scatter floor (every store).
SYNC_FLOOR_MAX = 2.0
PAUSE_FLOOR_MAX = 1.5
#: Anchor bytes / dense bf16 bytes.
ANCHOR_FRACTION_MAX = 0.70
#: deltastore sync / memory floor (every store).
MEMORY_FLOOR_MAX = 1.3
#: deltastore sync / the shaped link's floor for it: on the large model, on other sizes.
LINK_FLOOR_LARGE_MAX = 1.3
LINK_FLOOR_MAX = 1.5
#: deltastore payload per changed element / the XOR entropy floor.
ENTROPY_FLOOR_MAX = 1.05
#: Serving thread progress during a sync / idle (every store).
SERVING_PROGRESS_MIN = 0.9


def _median_model(cls: type[M], items: Sequence[M]) -> M:
    """A model whose every field is the median of that field over ``items`` (integers
    rounded; None when any item has none)."""
    values: dict[str, object] = {}
    for name in cls.model_fields:
        got = [getattr(x, name) for x in items]
        if any(v is None for v in got):
            values[name] = None
            continue
        med = statistics.median(got)
        values[name] = round(med) if all(isinstance(v, int) for v in got) else med
    return cls(**values)


def medians(
    publish: Sequence[PublishSample], sync: Sequence[SyncSample], dense_bytes: int
) -> Medians:
    pub_rss = statistics.median(s.rss_extra_bytes for s in publish)
    sub_rss = statistics.median(s.rss_extra_bytes for s in sync)
    return Medians(
        bytes_per_changed=statistics.median(s.bytes_per_changed for s in publish),
        publish=_median_model(PublishTimes, [s.times for s in publish]),
        sync=_median_model(SyncTimes, [s.times for s in sync]),
        publisher_rss_extra_bytes=pub_rss,
        subscriber_rss_extra_bytes=sub_rss,
        publisher_rss_extra_fraction=pub_rss / dense_bytes,
        subscriber_rss_extra_fraction=sub_rss / dense_bytes,
    )


def _ratio(baseline: float, ours: float) -> float | None:
    return baseline / ours if ours > 0 else None


def method_results(samples: Sequence[SyncSample]) -> dict[str, MethodResult]:
    """Per load method (in first-seen order), its samples and medians; empty when the
    samples name no method (a receiver with one method)."""
    by: dict[str, list[SyncSample]] = {}
    for sample in samples:
        if sample.method is not None:
            by.setdefault(sample.method, []).append(sample)
    return {
        name: MethodResult(
            method=name,
            sync=group,
            median=_median_model(SyncTimes, [s.times for s in group]),
            subscriber_rss_extra_bytes=statistics.median(s.rss_extra_bytes for s in group),
            exact=all(s.exact for s in group),
        )
        for name, group in by.items()
    }


def fastest(methods: dict[str, MethodResult]) -> str:
    """The method with the lowest median sync time (the first of equals)."""
    return min(methods, key=lambda name: methods[name].median.total_s)


def _median_or_none(values: Sequence[float | None]) -> float | None:
    """The median of ``values``; None when there are none or any is None."""
    if not values or any(v is None for v in values):
        return None
    return statistics.median(v for v in values if v is not None)


def floors(samples: Sequence[FloorSample], sync: SyncTimes | None) -> Floors | None:
    """Medians of the floor samples and deltastore's median sync (``sync``) against them;
    the payload against the XOR entropy floor per version (each sample's payload)."""
    if not samples:
        return None
    receiver = statistics.median(s.receiver_floor_s for s in samples)
    scatter = statistics.median(s.scatter_floor_s for s in samples)
    memory = _median_or_none([s.memory_floor_s for s in samples])
    per_change = _median_or_none(
        [s.rmw_s / s.changed_elements if s.rmw_s is not None else None for s in samples]
    )
    entropy = _median_or_none([s.xor_entropy_floor for s in samples])
    payload = _median_or_none(
        [
            s.payload_bytes / s.changed_elements / s.xor_entropy_floor
            if s.xor_entropy_floor
            else None
            for s in samples
        ]
    )
    return Floors(
        samples=list(samples),
        receiver_floor_median_s=receiver,
        scatter_floor_median_s=scatter,
        sync_floor_ratio=sync.total_s / receiver if sync and receiver > 0 else None,
        pause_floor_ratio=sync.pause_s / scatter if sync and scatter > 0 else None,
        memory_floor_median_s=memory,
        memory_floor_ratio=sync.total_s / memory if sync and memory else None,
        rmw_per_change_median_s=per_change,
        xor_entropy_floor_median=entropy,
        payload_entropy_ratio=payload,
    )


def serving(samples: Sequence[ServingSample], sync: SyncTimes | None) -> Serving | None:
    """The serving thread's median progress, and its syncs against deltastore's median
    measured sync (``sync``)."""
    if not samples:
        return None
    progress = [s.progress for s in samples if s.progress is not None]
    median = statistics.median(s.sync_s for s in samples)
    return Serving(
        samples=list(samples),
        progress_median=statistics.median(progress) if progress else None,
        sync_median_s=median,
        sync_slowdown=median / sync.total_s if sync and sync.total_s > 0 else None,
    )


def cpu_per_change(sync: Sequence[SyncSample], changed: Sequence[int]) -> float | None:
    """The median over versions of a sync's CPU seconds / that version's changed elements
    (``changed[v - 1]`` for version ``v``); None when a sample has no CPU time."""
    return _median_or_none(
        [
            s.times.cpu_s / changed[s.version - 1] if s.times.cpu_s is not None else None
            for s in sync
        ]
    )


def ratios(ours: Medians, baseline: Medians) -> Ratios:
    """Baseline / deltastore for each headline number."""
    return Ratios(
        payload=_ratio(baseline.publish.payload_bytes, ours.publish.payload_bytes),
        publish=_ratio(baseline.publish.total_s, ours.publish.total_s),
        sync=_ratio(baseline.sync.total_s, ours.sync.total_s),
        publisher_rss=_ratio(baseline.publisher_rss_extra_bytes, ours.publisher_rss_extra_bytes),
        subscriber_rss=_ratio(baseline.subscriber_rss_extra_bytes, ours.subscriber_rss_extra_bytes),
    )


def is_local(store: str) -> bool:
    """Whether a store label names a local folder (the page-cache case of the sync bar);
    ``moto`` and ``moto+<link>`` (moto behind a shaped link) are object stores."""
    if store == "local" or store == "moto" or store.startswith("moto+"):
        return store == "local"
    return "://" not in store or store.startswith("file://")


def holds(value: float, op: str, threshold: float) -> bool:
    """Whether ``value op threshold`` (op one of ``<=``, ``>=``, ``<``, ``>``)."""
    return {
        "<=": value <= threshold,
        ">=": value >= threshold,
        "<": value < threshold,
        ">": value > threshold,
    }[op]


def _check(
    name: str,
    store: str | None,
    measured: float | None,
    op: str,
    threshold: float,
    what: str,
    *,
    applicable: bool = True,
) -> BarCheck:
    """A bar check: ``pass`` when ``measured op threshold`` holds, ``fail`` when it does not
    or nothing was measured, ``n/a`` (measured None) when this run cannot answer it,
    ``reported`` for op ``report`` (no bar; ``threshold`` 0)."""
    if op == "report":
        status, threshold = "reported", 0.0
    elif not applicable:
        status, measured = "n/a", None
    elif measured is not None and holds(measured, op, threshold):
        status = "pass"
    else:
        status = "fail"
    return BarCheck(
        name=name,
        store=store,
        measured=measured,
        op=op,  # type: ignore[arg-type]
        threshold=threshold,
        passed=status == "pass",
        what=what,
        status=status,  # type: ignore[arg-type]
    )


def _report(name: str, store: str | None, measured: float | None, what: str) -> BarCheck:
    """A number reported beside the bar, with no threshold (op ``report``)."""
    return _check(name, store, measured, "report", 0.0, what)


def bar_checks(
    stores: Sequence[StoreResult], scaling: ScalingResult | None, size: str | None = None
) -> list[BarCheck]:
    """The bar points that this run's systems and stores can answer (every ratio
    against the strongest dense, ``dense``; the floors measured in the same run). ``size``:
    the benchmarked size (the link floor's bar is tighter on ``large``)."""
    out: list[BarCheck] = []
    with_ds = [s for s in stores if "deltastore" in s.systems]
    if with_ds:
        first = with_ds[0]
        ds = first.systems["deltastore"].median
        out.append(
            _check(
                "payload bytes per changed element",
                None,
                ds.bytes_per_changed,
                "<=",
                BYTES_PER_CHANGED_MAX,
                "deltastore's median payload / changed elements",
            )
        )
        fl = first.floors
        if fl is not None and fl.xor_entropy_floor_median is not None:
            out.append(
                _check(
                    "payload vs XOR entropy floor",
                    None,
                    fl.payload_entropy_ratio,
                    "<=",
                    ENTROPY_FLOOR_MAX,
                    f"deltastore's payload {ds.bytes_per_changed:.4f} B per changed element / "
                    "the order-0 entropy of its gaps and XOR masks "
                    f"{fl.xor_entropy_floor_median:.4f} B per changed element (medians; the "
                    "ratio is the median of each version's)",
                )
            )
        for base in ("coo", "xor-dense"):
            if base in first.ratios:
                out.append(
                    _check(
                        f"payload smaller than {base}",
                        None,
                        first.ratios[base].payload,
                        ">",
                        1.0,
                        f"{base} payload / deltastore payload (medians)",
                    )
                )
        if first.anchor_fraction is not None:
            out.append(
                _check(
                    "anchor size",
                    None,
                    first.anchor_fraction,
                    "<=",
                    ANCHOR_FRACTION_MAX,
                    "deltastore's anchor (stored bytes) / dense bf16 bytes",
                )
            )
    for s in with_ds:
        out += _store_checks(s, size)
    if scaling is not None:
        # small against small is 1 by construction: that answers nothing (n/a, not a pass)
        same = scaling.target.size == scaling.small.size
        out.append(
            _check(
                "scaling with model size",
                scaling.store,
                scaling.ratio,
                "<=",
                SCALING_MAX,
                f"sync of {scaling.changed_elements} changes on {scaling.target.size} / on "
                f"{scaling.small.size}"
                + (": the benchmarked size is the small model, nothing to compare" if same else ""),
                applicable=not same,
            )
        )
    return out


def _store_checks(s: StoreResult, size: str | None = None) -> list[BarCheck]:
    """The bar points of one store that deltastore ran through (``size``: the benchmarked
    size)."""
    local = is_local(s.store)
    out = [
        _check(
            "publish vs detect lower bound",
            s.store,
            s.publish_bound_ratio,
            "<=",
            PUBLISH_BOUND_MAX,
            "deltastore publish / one chunked not_equal+flatnonzero pass (the publish floor)",
        )
    ]
    if "dense" in s.ratios:
        dense = s.systems["dense"]
        over = f" over the {s.link.name} link" if s.link else ""
        what = f"strongest dense ({dense.method}) / deltastore sync (medians){over}"
        if local and not s.link:  # from the page cache: reported, no bar
            out.append(_report("sync faster than dense", s.store, s.ratios["dense"].sync, what))
        else:
            out.append(
                _check(
                    "sync faster than dense over the link" if s.link else "sync faster than dense",
                    s.store,
                    s.ratios["dense"].sync,
                    ">=",
                    SYNC_VS_DENSE_LINK_MIN if s.link else SYNC_VS_DENSE_REMOTE_MIN,
                    what,
                )
            )
    ds_sync = s.systems["deltastore"].median.sync.total_s
    if s.link is not None and s.link.deltastore_floor_s:
        out.append(
            _check(
                "sync vs link floor",
                s.store,
                ds_sync / s.link.deltastore_floor_s,
                "<=",
                LINK_FLOOR_LARGE_MAX if size == "large" else LINK_FLOOR_MAX,
                f"deltastore sync / the {s.link.name} link's floor for it (two requests one "
                f"after the other and the payload: {s.link.deltastore_floor_s:.3f} s; medians)",
            )
        )
    if not local:
        ds = s.systems["deltastore"]
        out.append(
            _check(
                "sync round trips",
                s.store,
                ds.median.sync.round_trips,
                "<=",
                SYNC_ROUND_TRIPS_MAX,
                "deltastore's median sequential store requests per sync of one delta",
            )
        )
        out.append(
            _check(
                "poll requests",
                s.store,
                ds.poll_requests,
                "<=",
                POLL_REQUESTS_MAX,
                "store requests of deltastore's poll that finds nothing new",
            )
        )
    fl = s.floors
    if local and fl is not None:
        out.append(
            _check(
                "sync vs receiver floor",
                s.store,
                fl.sync_floor_ratio,
                "<=",
                SYNC_FLOOR_MAX,
                "deltastore sync / (zstd decompress + gather + checksum + scatter) (medians)",
            )
        )
    out.append(
        _check(
            "subscriber extra peak RSS",
            s.store,
            s.systems["deltastore"].median.subscriber_rss_extra_fraction,
            "<=",
            SUBSCRIBER_RSS_MAX,
            "deltastore subscriber peak extra RSS / model bytes",
        )
    )
    out.append(
        _check(
            "pause fraction",
            s.store,
            s.pause_fraction,
            "<=",
            PAUSE_FRACTION_MAX,
            "deltastore pause / sync time (medians)",
        )
    )
    if fl is not None:
        out.append(
            _check(
                "pause vs scatter floor",
                s.store,
                fl.pause_floor_ratio,
                "<=",
                PAUSE_FLOOR_MAX,
                "deltastore pause / one bare scatter of the same words (medians)",
            )
        )
    if fl is not None and fl.memory_floor_median_s is not None:
        threads = fl.samples[0].threads
        out.append(
            _check(
                "sync vs memory floor",
                s.store,
                fl.memory_floor_ratio,
                "<=",
                MEMORY_FLOOR_MAX,
                f"deltastore sync / (zstd decompress + one native XOR pass over the changed "
                f"words, each on {threads} threads) (medians)",
            )
        )
    if s.cpu_per_change_s is not None:
        rmw = fl.rmw_per_change_median_s if fl is not None else None
        beside = (
            f"; the memory floor's XOR pass: {rmw * 1e9:.2f} ns per change (wall)"
            if rmw is not None
            else ""
        )
        out.append(
            _report(
                "cpu per change",
                s.store,
                s.cpu_per_change_s * 1e9,
                "deltastore subscriber process CPU (user + system, every thread) per changed "
                f"element, ns (median over versions){beside}",
            )
        )
    if s.serving is not None:
        out.append(
            _check(
                "serving thread progress",
                s.store,
                s.serving.progress_median,
                ">=",
                SERVING_PROGRESS_MIN,
                "a pure-Python thread's progress during deltastore's sync / idle (median; "
                f"those syncs took {s.serving.sync_median_s:.3f} s, "
                f"{_times(s.serving.sync_slowdown)} the measured ones)",
            )
        )
    return out


def _times(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def baseline_ratios(systems: dict[str, Medians]) -> dict[str, Ratios]:
    """Ratios of every baseline present against deltastore (empty without deltastore)."""
    ours = systems.get("deltastore")
    if ours is None:
        return {}
    names: tuple[SystemName, ...] = BASELINES
    return {b: ratios(ours, systems[b]) for b in names if b in systems}
