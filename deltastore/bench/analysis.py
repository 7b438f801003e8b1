"""From measured samples to medians, ratios and the performance bar (issue 6)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TypeVar

from pydantic import BaseModel

from deltastore.bench.schema import (
    BASELINES,
    BarCheck,
    Medians,
    PublishSample,
    PublishTimes,
    Ratios,
    ScalingResult,
    StoreResult,
    SyncSample,
    SyncTimes,
    SystemName,
)

M = TypeVar("M", bound=BaseModel)

#: The bar (issue 6), thresholds by name.
BYTES_PER_CHANGED_MAX = 1.5
PUBLISH_BOUND_MAX = 2.5
SYNC_VS_DENSE_REMOTE_MIN = 20.0
SYNC_VS_DENSE_LOCAL_MIN = 3.0
SUBSCRIBER_RSS_MAX = 0.05
PAUSE_FRACTION_MAX = 0.20
SCALING_MAX = 1.5


def _median_model(cls: type[M], items: Sequence[M]) -> M:
    """A model whose every field is the median of that field over ``items``."""
    values = {}
    for name, info in cls.model_fields.items():
        med = statistics.median(getattr(x, name) for x in items)
        values[name] = round(med) if info.annotation in (int, "int") else med
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
    """Whether a store label names a local folder (the page-cache case of the sync bar)."""
    if store in ("local", "moto"):
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
    name: str, store: str | None, measured: float | None, op: str, threshold: float, what: str
) -> BarCheck:
    passed = measured is not None and holds(measured, op, threshold)
    return BarCheck(
        name=name,
        store=store,
        measured=measured,
        op=op,  # type: ignore[arg-type]
        threshold=threshold,
        passed=passed,
        what=what,
    )


def bar_checks(stores: Sequence[StoreResult], scaling: ScalingResult | None) -> list[BarCheck]:
    """The bar points that this run's systems and stores can answer."""
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
    for s in with_ds:
        out.append(
            _check(
                "publish vs detect lower bound",
                s.store,
                s.publish_bound_ratio,
                "<=",
                PUBLISH_BOUND_MAX,
                "deltastore publish / one chunked not_equal+flatnonzero pass",
            )
        )
        if "dense" in s.ratios:
            local = is_local(s.store)
            out.append(
                _check(
                    "sync faster than dense",
                    s.store,
                    s.ratios["dense"].sync,
                    ">=",
                    SYNC_VS_DENSE_LOCAL_MIN if local else SYNC_VS_DENSE_REMOTE_MIN,
                    "dense download+load / deltastore sync (medians)",
                )
            )
        sub = s.systems["deltastore"].median.subscriber_rss_extra_fraction
        out.append(
            _check(
                "subscriber extra peak RSS",
                s.store,
                sub,
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
    if scaling is not None:
        out.append(
            _check(
                "scaling with model size",
                scaling.store,
                scaling.ratio,
                "<=",
                SCALING_MAX,
                f"sync of {scaling.changed_elements} changes on {scaling.target.size} / on "
                f"{scaling.small.size}",
            )
        )
    return out


def baseline_ratios(systems: dict[str, Medians]) -> dict[str, Ratios]:
    """Ratios of every baseline present against deltastore (empty without deltastore)."""
    ours = systems.get("deltastore")
    if ours is None:
        return {}
    names: tuple[SystemName, ...] = BASELINES
    return {b: ratios(ours, systems[b]) for b in names if b in systems}
