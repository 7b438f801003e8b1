"""The benchmark's JSON output (``deltastore bench --json PATH``), as pydantic models.

:class:`BenchResult` is the document; ``schema_version`` changes whenever a field changes
meaning or goes away (adding a field keeps it). Times are seconds (``time.perf_counter``),
sizes bytes. Every ``*_fraction`` is relative to the model's dense bytes unless said otherwise.
Ratios are ``baseline / deltastore``: above 1 means deltastore is smaller, faster or leaner.
``benchmarks/README.md`` explains each number.

Version 2: ``dense`` is the strongest dense load (the fastest of the methods its
receiver times, :class:`MethodResult`), the old whole-object load is ``dense-naive`` (reported,
never in a ratio); :class:`StoreResult` gains the receiver floors and the anchor's size.
Version 1 documents cannot be read by this model.

Added in version 2 without a change of meaning: request counts (``requests``,
``round_trips``: the store requests of a publish or sync and how many of them ran one after
the other; deltastore's ``commit_round_trips`` after its data objects; deltastore's poll),
and the shaped link a store was reached through (:class:`LinkInfo`), with the floors it sets;
:attr:`BarCheck.status` (``n/a`` for a check this run cannot answer, which no longer counts
as passed); the memory floor and the XOR entropy floor (:class:`FloorSample`, :class:`Floors`),
each sync's process CPU (:attr:`SyncTimes.cpu_s`) and deltastore's CPU per change, the
serving thread beside deltastore's syncs (:class:`Serving`), and reported checks without a
bar (:attr:`BarCheck.op` ``report``, status ``reported``). Documents written before a field
existed read with it None.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

SCHEMA_VERSION = 2

SystemName = Literal["deltastore", "dense", "dense-naive", "coo", "xor-dense"]
#: Every system, deltastore first.
SYSTEMS: tuple[SystemName, ...] = ("deltastore", "dense", "dense-naive", "coo", "xor-dense")
#: The baselines deltastore is compared with (ratios, bar checks). ``dense-naive`` is reported
#: beside them and never used for a ratio: ``dense`` is the strongest dense load.
BASELINES: tuple[SystemName, ...] = ("dense", "coo", "xor-dense")


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PublishTimes(_Model):
    """One publish: stored bytes and where the time went (``total_s``: the whole call).
    deltastore's also: its store requests, how many ran one after the other, and how many of
    those came after its data objects were stored (None for the baselines)."""

    payload_bytes: int
    detect_s: float
    encode_s: float
    upload_s: float
    total_s: float
    requests: int | None = None
    round_trips: int | None = None
    commit_round_trips: int | None = None


class SyncTimes(_Model):
    """One sync. ``apply_s``: writing into the receiver's tensors; ``pause_s``: the span in
    which the tensors are being modified (deltastore: its write phase; dense: the copy, or
    for ranged GETs the whole load, as ranges are copied in while others are in flight; coo:
    the scatter; xor-dense: decompress and XOR, which run interleaved in place)."""

    fetch_s: float
    decode_s: float
    verify_s: float
    apply_s: float
    pause_s: float
    total_s: float
    #: Store requests of the sync, counted by the worker for every system
    #: (:class:`~deltastore.store.counting.CountingStore`), and how many ran one after the
    #: other (:func:`~deltastore.store.counting.critical_path`).
    requests: int | None = None
    round_trips: int | None = None
    #: CPU seconds (user + system, every thread) the worker process spent in the sync
    #: (``time.process_time``), less the RSS meter's own sampling thread.
    cpu_s: float | None = None


class PublishSample(_Model):
    """A measured publish of one version, with the publisher process's peak extra RSS."""

    version: int
    changed_elements: int
    bytes_per_changed: float
    times: PublishTimes
    rss_extra_bytes: int


class SyncSample(_Model):
    """A measured sync of one version; ``exact``: the receiver's tensors hash (XXH3-64) to
    the workload's digest of that version. ``method``: which of the receiver's load methods
    ran (systems that time several, e.g. dense's ``load_file+copy_`` and
    ``safe_open+copy_``); None for a system with one method."""

    version: int
    times: SyncTimes
    rss_extra_bytes: int
    digest: str
    exact: bool
    method: str | None = None


class Medians(_Model):
    """Medians over the measured versions (each field on its own: the parts of a split need
    not add up to its total; integers are rounded)."""

    bytes_per_changed: float
    publish: PublishTimes
    sync: SyncTimes
    publisher_rss_extra_bytes: float
    subscriber_rss_extra_bytes: float
    publisher_rss_extra_fraction: float
    subscriber_rss_extra_fraction: float


class MethodResult(_Model):
    """One load method of a receiver that times several (each version is loaded by every
    method in turn, into tensors first overwritten with zeros so each load is checked on its
    own): its samples, the median of each sync time and of the extra RSS, bit-exactness."""

    method: str
    sync: list[SyncSample]
    median: SyncTimes
    subscriber_rss_extra_bytes: float
    exact: bool


class SystemResult(_Model):
    """One system through one store: every version measured, their medians, and whether the
    receiver was bit-exact at every version. ``*_setup_s``: the untimed setup of each side
    (deltastore: publishing the anchor; checking the receiver's tensors against it).

    ``publish_method``/``method``: how the sender publishes and which receiver method
    ``sync`` and ``median`` hold (for a receiver that times several, the one with the lowest
    median sync time); ``methods``: every method timed, the chosen one included (empty for a
    system with one method); ``exact`` covers every method."""

    system: SystemName
    publisher_setup_s: float
    subscriber_setup_s: float
    publish: list[PublishSample]
    sync: list[SyncSample]
    median: Medians
    publisher_rss_extra_max_bytes: int
    subscriber_rss_extra_max_bytes: int
    exact: bool
    publish_method: str
    method: str
    methods: dict[str, MethodResult]
    #: deltastore: the requests of one poll that finds nothing new, after all its syncs, and
    #: how many ran one after the other (None for the baselines).
    poll_requests: int | None = None
    poll_round_trips: int | None = None


class Ratios(_Model):
    """Baseline / deltastore, from the medians (None where deltastore's value is 0)."""

    payload: float | None
    publish: float | None
    sync: float | None
    publisher_rss: float | None
    subscriber_rss: float | None


class FloorSample(_Model):
    """The receiver's floors for one measured version, timed in deltastore's subscriber
    process on its own tensors after all its syncs (receiver and pause floors: one thread,
    numpy, int64 positions).

    ``decompress_s``: zstd decompression of every stored frame of the version (``frames``
    frames, ``payload_bytes`` bytes); ``gather_s``: one gather of the changed words;
    ``checksum_s``: the O(changed) Adler-32 update (``delta_sums``) per tensor;
    ``scatter_s``: one scatter of the new words, all in the same pass per tensor;
    ``receiver_floor_s``: their sum. ``scatter_floor_s``: one bare scatter of the same words
    into the same tensors, timed on its own (the pause floor).

    The memory floor, on a pool of ``threads`` threads (as many as deltastore's subscriber
    decodes on): ``pool_decompress_s`` zstd decompression of the same frames, split across
    the threads; ``rmw_s`` one native read-modify-write pass XORing ``old ^ new`` into the
    changed words (:mod:`deltastore.kernels.floor`), the changes split into equal runs across
    the threads; ``memory_floor_s`` their sum.

    The XOR entropy floor, from the same changes: ``gap_entropy_bytes`` the order-0 entropy
    of the gaps (unchanged elements before each change in its tensor, as symbols) and
    ``mask_entropy_bytes`` that of the XOR masks (16-bit symbols), in bytes;
    ``xor_entropy_floor`` their sum / ``changed_elements`` (bytes per changed element)."""

    version: int
    changed_elements: int
    frames: int
    payload_bytes: int
    decompress_s: float
    gather_s: float
    checksum_s: float
    scatter_s: float
    receiver_floor_s: float
    scatter_floor_s: float
    threads: int | None = None
    pool_decompress_s: float | None = None
    rmw_s: float | None = None
    memory_floor_s: float | None = None
    gap_entropy_bytes: float | None = None
    mask_entropy_bytes: float | None = None
    xor_entropy_floor: float | None = None


class Floors(_Model):
    """deltastore's receiver floors in one store: per version, the medians, and deltastore's
    median sync time / median receiver floor and median pause / median scatter floor.

    ``memory_floor_median_s`` and ``memory_floor_ratio`` (median sync / it);
    ``rmw_per_change_median_s``: the median over versions of the memory floor's RMW pass /
    changed elements (seconds per change); ``xor_entropy_floor_median`` (bytes per changed
    element) and ``payload_entropy_ratio``: the median over versions of deltastore's payload
    per changed element / that version's XOR entropy floor."""

    samples: list[FloorSample]
    receiver_floor_median_s: float
    scatter_floor_median_s: float
    sync_floor_ratio: float | None
    pause_floor_ratio: float | None
    memory_floor_median_s: float | None = None
    memory_floor_ratio: float | None = None
    rmw_per_change_median_s: float | None = None
    xor_entropy_floor_median: float | None = None
    payload_entropy_ratio: float | None = None


class ServingSample(_Model):
    """One replayed deltastore sync of ``version`` with the serving thread running (a Python
    thread doing fixed pure-Python work in units, :mod:`deltastore.bench.serving`): the sync's
    wall time ``sync_s``, the units the thread completed during it (``busy_units``) and in
    two windows with the process otherwise idle, one just before the sync and one as long as
    the sync right after it (``idle_units`` in ``idle_s``, both windows together), and
    ``progress`` = busy units per second / idle units per second (None when the idle
    windows completed none)."""

    version: int
    sync_s: float
    busy_units: int
    idle_s: float
    idle_units: int
    progress: float | None


class Serving(_Model):
    """The serving thread beside deltastore's syncs in one store: per version, the median
    ``progress``, the median sync time with the thread running and that / deltastore's
    median measured sync time (``sync_slowdown``; the measured syncs run without it)."""

    samples: list[ServingSample]
    progress_median: float | None
    sync_median_s: float
    sync_slowdown: float | None


class LinkInfo(_Model):
    """The shaped link (:mod:`deltastore.testing.link`) a store was reached through: latency
    per request (s), bandwidth per connection and in total (bits/s), each way. The floors
    are what the link alone costs a sync at the measured medians: ``dense_floor_s`` one
    request and the model's bytes at the total bandwidth; ``deltastore_floor_s`` two requests
    one after the other (the manifest, then the frames) and its payload."""

    name: str
    latency_s: float
    conn_bits_per_s: float
    total_bits_per_s: float
    dense_floor_s: float
    deltastore_floor_s: float | None


class StoreResult(_Model):
    """All systems through one store, plus deltastore's derived numbers there.

    ``detect_bound_s``: per version, one chunked ``np.not_equal`` + ``np.flatnonzero`` pass
    over the same old/new words (in deltastore's publisher process, just before its publish):
    the publish floor; ``publish_bound_ratio``: deltastore's median publish time / the median
    bound; ``pause_fraction``: deltastore's median pause / its median sync time; ``floors``:
    the receiver and pause floors; ``anchor_bytes``: the stored bytes of deltastore's anchor
    (the base version, published untimed before the measured versions) and
    ``anchor_fraction`` that / the model's dense bytes; ``cpu_per_change_s``: the median over
    versions of deltastore's sync CPU seconds (:attr:`SyncTimes.cpu_s`) / changed elements;
    ``serving``: the serving thread's progress beside deltastore's syncs."""

    store: str
    systems: dict[str, SystemResult]
    detect_bound_s: list[float]
    detect_bound_median_s: float | None
    publish_bound_ratio: float | None
    pause_fraction: float | None
    ratios: dict[str, Ratios]
    floors: Floors | None
    anchor_bytes: int | None
    anchor_fraction: float | None
    link: LinkInfo | None = None
    cpu_per_change_s: float | None = None
    serving: Serving | None = None


class ScalingSide(_Model):
    """deltastore syncs of versions with exactly ``changed_elements`` flipped words."""

    size: str
    elements: int
    sync_s: list[float]
    median_s: float
    exact: bool


class ScalingResult(_Model):
    """The same number of changes synced on the small model and on the benchmarked size;
    ``ratio`` = target median / small median (1.0 by construction when both are small)."""

    changed_elements: int
    store: str
    small: ScalingSide
    target: ScalingSide
    ratio: float


BarStatus = Literal["pass", "fail", "n/a", "reported"]


class BarCheck(_Model):
    """One point of the performance bar: ``measured op threshold`` must hold.

    ``status``: ``pass`` (it holds), ``fail`` (it does not, or nothing was measured), ``n/a``
    (this run cannot answer it: scaling with model size when the benchmarked size is the
    small model itself; ``measured`` is then None), ``reported`` (op ``report``: a number
    reported beside the bar, with no threshold to hold; ``threshold`` is then 0 and means
    nothing). ``passed`` is ``status == "pass"``. Documents written before ``status``
    existed get it from ``passed``."""

    name: str
    store: str | None
    measured: float | None
    op: Literal["<=", ">=", "<", ">", "report"]
    threshold: float
    passed: bool
    what: str
    status: BarStatus

    @model_validator(mode="before")
    @classmethod
    def _status_from_passed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "status" not in data:
            return {**data, "status": "pass" if data.get("passed") else "fail"}
        return data

    @model_validator(mode="after")
    def _passed_agrees(self) -> BarCheck:
        if self.passed != (self.status == "pass"):
            raise ValueError(f"bar check {self.name!r}: passed={self.passed}, status {self.status}")
        if (self.op == "report") != (self.status == "reported"):
            raise ValueError(f"bar check {self.name!r}: op {self.op}, status {self.status}")
        return self


class Machine(_Model):
    cpu_model: str
    cores: int
    memory_bytes: int
    platform: str
    python: str
    torch: str
    numpy: str
    zstandard: str
    safetensors: str
    deltastore: str


class RunHeader(_Model):
    """When and on what a run ran, the first fields of every mode's result: ``created``, the
    run's end as ISO 8601 in UTC to the second (``2026-12-03T09:15:02+00:00``), and the
    ``machine``. :func:`deltastore.bench.runner.run_header` makes them."""

    created: str
    machine: Machine


class WorkloadHeader(_Model):
    """The cached workload a run measured (:mod:`deltastore.bench.workload`, or a chain of its
    own cached the same way): its ``size`` name, the model's ``elements`` and ``tensors``,
    ``dense_bytes`` of one version in bf16 (2 bytes an element), the generator's ``seed``,
    the ``folder`` it is cached in and ``generated_now``: whether this run generated it.
    :func:`deltastore.bench.runner.workload_header` reads them off the workload."""

    size: str
    elements: int
    tensors: int
    dense_bytes: int
    seed: int
    folder: str
    generated_now: bool


class AdamWHeader(WorkloadHeader):
    """A :class:`WorkloadHeader` of AdamW steps at one learning rate: ``lr``, and ``warmup``
    steps from the stationary state before the base (version 0).
    :func:`deltastore.bench.runner.adamw_header` reads them off the workload."""

    lr: float
    warmup: int


class WorkloadInfo(AdamWHeader):
    """The versions measured: ``versions`` AdamW steps after the base. Lists are per measured
    version (the base is not in them); ``generate_s`` is the generation time, whether it
    happened in this run or not."""

    versions: int
    changed_elements: list[int]
    changed_fraction: list[float]
    digests: list[str]
    generate_s: float


class BenchResult(RunHeader):
    """The whole run (``deltastore bench --json``). Header fields (first in the JSON):
    :class:`RunHeader`."""

    schema_version: Literal[2] = 2
    workload: WorkloadInfo
    stores: list[StoreResult]
    scaling: ScalingResult | None
    bars: list[BarCheck]
    exact: bool
    skipped: list[str]
    wall_s: float


def load_result(path: str | os.PathLike[str]) -> BenchResult:
    """A results JSON; :class:`ValueError` naming the schema version when it is not one this
    code reads."""
    raw = Path(path).read_text()
    try:
        return BenchResult.model_validate_json(raw)
    except ValidationError as exc:
        raise ValueError(
            f"{path} is not a results JSON of schema version {SCHEMA_VERSION} "
            f"(deltastore bench --json writes one): {exc.error_count()} errors, "
            f"first: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}"
        ) from None
