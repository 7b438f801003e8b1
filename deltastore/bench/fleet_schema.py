"""The JSON of ``deltastore bench --mode fleet`` (:class:`FleetResult`, pydantic models), its
acceptance checks (:func:`fleet_checks`) and its report (:func:`fleet_markdown`).

What a fleet of followers costs the origin store, read directly or through a mirror: one
publisher commits versions to the ORIGIN (a moto S3 server, written over loopback); ``N``
followers (:class:`~deltastore.Subscriber`, threads of the bench process) poll every
``poll_interval_s`` and sync what is new, either ``direct`` (from the origin, through a shaped
cross-region link) or through a ``mirror`` (a second store fed by one
:class:`~deltastore.maintenance.mirror.Mirror` that reads the origin through that link, on the
same poll interval). Requests and bytes are counted at the origin, per consumer.

Times are seconds of wall time (``time.monotonic``), sizes bytes (object bodies the store
returned: ``get``, ``get_range``, ``get_with_token``; listings and uploads carry none here).
Percentiles are linear interpolations over the samples (``numpy.percentile``). ``mode`` tells
this document from the other bench results; ``benchmarks/README.md`` (Fleets) explains each
number. Immutable models and pure functions; thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from deltastore.bench.fmt import measured, nbytes, table
from deltastore.bench.schema import AdamWHeader, BarCheck, LinkInfo, RunHeader

FLEET_SCHEMA_VERSION = 1
#: Tolerance of the check "mirror origin bytes per version = 1x the stored bytes".
BYTES_TOLERANCE = 0.05
#: Largest spread (max - min over N) of the mirror's idle requests per poll interval.
REQUESTS_SPREAD = 0.5

#: How the followers read: ``direct`` from the origin, or from a ``mirror`` of it.
Side = Literal["direct", "mirror"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``samples`` (at least one), linear interpolation
    between the closest ranks (``numpy.percentile``'s default)."""
    if not samples:
        raise ValueError("a percentile needs at least one sample")
    return float(np.percentile(np.asarray(samples, dtype=np.float64), q))


class Latency(_Model):
    """Commit-to-sync times of one version, one sample per follower (in follower order): from
    the publisher's ``publish`` returning to the follower's ``on_version`` callback for that
    version. ``p50_s`` / ``p99_s``: :func:`percentile` of the samples; ``last_s``: the
    largest (the last follower). A follower that never reached the version has no sample
    (``missing`` counts them)."""

    samples_s: list[float]
    p50_s: float
    p99_s: float
    last_s: float
    missing: int

    @classmethod
    def of(cls, samples: Sequence[float], missing: int = 0) -> Latency:
        """The latency of ``samples`` (at least one)."""
        return cls(
            samples_s=list(samples),
            p50_s=percentile(samples, 50),
            p99_s=percentile(samples, 99),
            last_s=max(samples),
            missing=missing,
        )


class Traffic(_Model):
    """Store calls (``requests``: one per store operation, failed ones included) and the
    object bytes they returned (``bytes``), in one window."""

    requests: int
    bytes: int


class VersionRow(_Model):
    """One version of one run.

    ``kind``: ``anchor`` (the first version, whole) or ``delta``. ``stored_bytes``: what the
    version added to the origin (its data objects, its manifest and, where written, its
    anchor copy's JSON), read back after the commit. ``window_s``: from this version's
    commit to the next one's (the last: to the idle phase). ``origin``: every call the
    consumers (the followers, direct; the mirror) made at the origin inside the window;
    ``per_follower_*``: that over ``followers``; ``bytes_ratio`` = ``origin.bytes /
    stored_bytes`` (direct: about ``followers``; mirror: about 1); ``requests_per_interval``
    = ``origin.requests / (window_s / poll_interval_s)``. ``latency``: commit to each
    follower's sync. ``copy_s`` (mirror only): the duration of the mirror pass
    (``Mirror.run_once``) that copied the version; ``mirror_lag_s``: commit to the end of
    that pass."""

    version: int
    kind: Literal["anchor", "delta"]
    stored_bytes: int
    window_s: float
    origin: Traffic
    per_follower_requests: float
    per_follower_bytes: float
    bytes_ratio: float
    requests_per_interval: float
    latency: Latency
    copy_s: float | None
    mirror_lag_s: float | None


class FleetRun(_Model):
    """``followers`` followers reading ``side`` for every version.

    ``idle``: the consumers' calls at the origin in the idle phase after the last version
    (``idle_s`` long, nothing new: polls only); ``idle_requests_per_interval`` = ``idle.requests
    / (idle_s / poll_interval_s)`` (direct: about ``followers``; mirror: about 1).
    ``mirror_reads`` (mirror only): the followers' calls at the mirror store over the whole
    run. ``link_requests``: HTTP requests the shaped link in front of the origin saw during the
    run (server side); ``origin_requests``: the store calls counted at the origin over the
    same time. ``errors``: calls that raised in a follower's or the mirror's loop (each is
    retried at the next poll); ``exact``: every follower ended bit-exact at the last
    version."""

    side: Side
    followers: int
    versions: list[VersionRow]
    idle_s: float
    idle: Traffic
    idle_requests_per_interval: float
    mirror_reads: Traffic | None
    link_requests: int
    origin_requests: int
    errors: int
    first_error: str | None
    exact: bool
    wall_s: float


class FleetResult(AdamWHeader, RunHeader):
    """The whole run (``deltastore bench --mode fleet --json``).

    The workload: ``size`` (``elements``, ``tensors``, ``dense_bytes`` of bf16), the bench's
    (:mod:`deltastore.bench.workload`, cached in ``folder``): version 0, the anchor, then
    ``versions`` AdamW steps at ``lr``, published as deltas. ``origin``: the origin store's
    label and ``link`` the shaped link every remote consumer reaches it through (the publisher
    writes over loopback); ``mirror_store``: where the mirror writes (``local``: a folder the
    followers read directly; ``moto+lan``: a second moto server behind a ``lan`` link).
    ``runs``: one per followers count and side, in the order run; ``checks``: the acceptance
    checks (``status`` pass / fail / n/a; ``store`` the origin label). ``mirror``: whether
    :class:`~deltastore.maintenance.mirror.Mirror` was importable (else the mirror side is
    skipped, with a line in ``skipped``). ``exact``: every follower of every run bit-exact.
    Header fields (first in the JSON): :class:`~deltastore.bench.schema.RunHeader`,
    :class:`~deltastore.bench.schema.AdamWHeader`."""

    mode: Literal["fleet"] = "fleet"
    schema_version: Literal[1] = 1
    versions: int
    origin: str
    link: LinkInfo
    mirror_store: str
    poll_interval_s: float
    followers: list[int]
    mirror: bool
    runs: list[FleetRun]
    checks: list[BarCheck]
    exact: bool
    skipped: list[str]
    load_average: list[float] = Field(default_factory=list)
    wall_s: float


# --- the checks ----------------------------------------------------------------------------


def _bar(
    name: str, store: str, value: float | None, op: str, threshold: float, what: str
) -> BarCheck:
    """A check; ``n/a`` when ``value`` is None, ``reported`` for op ``report``."""
    if op == "report":
        status = "reported"
    elif value is None:
        status = "n/a"
    else:
        ok = {"<=": value <= threshold, ">=": value >= threshold}[op]
        status = "pass" if ok else "fail"
    return BarCheck(
        name=name,
        store=store,
        measured=value,
        op=op,  # type: ignore[arg-type]
        threshold=threshold,
        passed=status == "pass",
        what=what,
        status=status,  # type: ignore[arg-type]
    )


def _last_p99(run: FleetRun) -> float:
    """p99 over the deltas of the last follower's commit-to-sync time."""
    return percentile([r.latency.last_s for r in run.versions if r.kind == "delta"], 99)


def _copy_p99(run: FleetRun) -> float | None:
    copies = [r.copy_s for r in run.versions if r.kind == "delta" and r.copy_s is not None]
    return percentile(copies, 99) if copies else None


def fleet_checks(runs: Sequence[FleetRun], interval: float, store: str) -> list[BarCheck]:
    """The acceptance checks (per followers count where both sides ran; pure):

    - ``mirror origin bytes per version``: with a mirror, the largest ``|origin bytes / stored
      bytes - 1|`` over the versions, <= :data:`BYTES_TOLERANCE` (1x, for any N);
    - ``direct origin bytes per version``: the median of the same, direct (reported: ~N);
    - ``mirror origin requests per poll interval``: max - min over N of the idle requests per
      interval, with a mirror, <= :data:`REQUESTS_SPREAD` (n/a with one N);
    - ``mirror commit-to-last-follower p99``: over the deltas, <= direct's + one poll interval
      + the p99 of the mirror's copy time."""
    by = {(r.side, r.followers): r for r in runs}
    counts = sorted({r.followers for r in runs})
    out: list[BarCheck] = []
    for n in counts:
        m, d = by.get(("mirror", n)), by.get(("direct", n))
        if m is not None:
            worst = max(abs(r.bytes_ratio - 1) for r in m.versions)
            out.append(
                _bar(
                    f"mirror origin bytes per version (N={n})",
                    store,
                    worst,
                    "<=",
                    BYTES_TOLERANCE,
                    "origin bytes / the version's stored bytes: its largest distance from 1",
                )
            )
        if d is not None:
            ratio = float(np.median([r.bytes_ratio for r in d.versions]))
            what = "origin bytes / the version's stored bytes, median (about N)"
            out.append(
                _bar(f"direct origin bytes per version (N={n})", store, ratio, "report", 0.0, what)
            )
        if m is not None and d is not None:
            copy = _copy_p99(m)
            limit = _last_p99(d) + interval + (copy or 0.0)
            out.append(
                _bar(
                    f"mirror commit-to-last-follower p99 (N={n})",
                    store,
                    _last_p99(m) if copy is not None else None,
                    "<=",
                    limit,
                    "p99 over the deltas, s; bound: direct's p99 + one poll interval + the "
                    "mirror's p99 copy time",
                )
            )
    idle = [by[("mirror", n)].idle_requests_per_interval for n in counts if ("mirror", n) in by]
    spread = max(idle) - min(idle) if len(idle) > 1 else None
    what = "idle origin requests per poll interval with a mirror: max - min over N"
    out.append(
        _bar("mirror origin requests per poll interval", store, spread, "<=", REQUESTS_SPREAD, what)
    )
    return out


# --- the report ----------------------------------------------------------------------------


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def fleet_markdown(result: FleetResult) -> str:
    """The report: per run and version the origin's traffic and the followers' latency, the
    idle polls, then the checks."""
    m, lk = result.machine, result.link
    load = ", ".join(f"{x:.1f}" for x in result.load_average)
    lines = [
        f"## deltastore bench --mode fleet: {result.size}, {result.elements / 1e6:.1f}M "
        f"elements ({nbytes(result.dense_bytes)} bf16)",
        "",
        f"Machine: {m.cpu_model}, {m.cores} cores; deltastore {m.deltastore}. {result.created}, "
        f"wall {result.wall_s:.0f} s, load average {load}. Origin {result.origin} "
        f"({1e3 * lk.latency_s:.0f} ms, {lk.total_bits_per_s / 1e9:g} Gbit/s); mirror store "
        f"{result.mirror_store}; followers {', '.join(map(str, result.followers))}, polling "
        f"every {result.poll_interval_s:g} s; versions 0 (anchor) to {result.versions}. "
        f"Origin traffic: the consumers' store calls and object bytes in each version's window "
        f"(commit to next commit); latency: commit to each follower's sync. "
        f"Exact: {'yes' if result.exact else 'NO'}.",
        "",
    ]
    head = ["N", "side", "version", "stored", "origin req", "origin bytes", "bytes/follower"]
    head += ["bytes ratio", "req/interval", "p50 s", "p99 s", "last s", "copy s"]
    rows = [
        [
            str(r.followers),
            r.side,
            f"{v.version} ({v.kind})",
            nbytes(v.stored_bytes),
            str(v.origin.requests),
            nbytes(v.origin.bytes),
            nbytes(v.per_follower_bytes),
            f"{v.bytes_ratio:.2f}",
            f"{v.requests_per_interval:.1f}",
            _s(v.latency.p50_s),
            _s(v.latency.p99_s),
            _s(v.latency.last_s) + (f" ({v.latency.missing} missing)" if v.latency.missing else ""),
            _s(v.copy_s),
        ]
        for r in result.runs
        for v in r.versions
    ]
    lines += ["### Per version", "", *table(head, rows), ""]
    ihead = ["N", "side", "idle req/interval", "origin req", "link req", "mirror reads"]
    ihead += ["errors", "exact", "wall s"]
    irows = [
        [
            str(r.followers),
            r.side,
            f"{r.idle_requests_per_interval:.2f}",
            str(r.origin_requests),
            str(r.link_requests),
            "-"
            if r.mirror_reads is None
            else f"{r.mirror_reads.requests} req, {nbytes(r.mirror_reads.bytes)}",
            str(r.errors),
            "yes" if r.exact else "NO",
            f"{r.wall_s:.1f}",
        ]
        for r in result.runs
    ]
    lines += ["### Per run", "", *table(ihead, irows), ""]
    errors = [f"- {r.side} N={r.followers}: {r.first_error}" for r in result.runs if r.first_error]
    if errors:
        lines += ["First error of each run that had any:", "", *errors, ""]
    chead = ["check", "measured", "op", "threshold", "status", "what"]
    crows = [
        [
            c.name,
            measured(c.measured, c.op, c.threshold),
            c.op,
            "-" if c.op == "report" else f"{c.threshold:.3f}",
            c.status,
            c.what,
        ]
        for c in result.checks
    ]
    lines += ["### Checks", "", *table(chead, crows), ""]
    lines += [f"- skipped: {s}" for s in result.skipped]
    return "\n".join(lines).rstrip("\n") + "\n"


__all__ = [
    "BYTES_TOLERANCE",
    "FLEET_SCHEMA_VERSION",
    "REQUESTS_SPREAD",
    "FleetResult",
    "FleetRun",
    "Latency",
    "Side",
    "Traffic",
    "VersionRow",
    "fleet_checks",
    "fleet_markdown",
    "percentile",
]
