"""The benchmark's JSON output (``deltastore bench --json PATH``), as pydantic models.

:class:`BenchResult` is the document; ``schema_version`` changes whenever a field changes
meaning or goes away (adding a field keeps it). Times are seconds (``time.perf_counter``),
sizes bytes. Every ``*_fraction`` is relative to the model's dense bytes unless said otherwise.
Ratios are ``baseline / deltastore``: above 1 means deltastore is smaller, faster or leaner.
``benchmarks/README.md`` explains each number.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

SCHEMA_VERSION = 1

SystemName = Literal["deltastore", "dense", "coo", "xor-dense"]
#: Every system, deltastore first.
SYSTEMS: tuple[SystemName, ...] = ("deltastore", "dense", "coo", "xor-dense")
BASELINES: tuple[SystemName, ...] = ("dense", "coo", "xor-dense")


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PublishTimes(_Model):
    """One publish: stored bytes and where the time went (``total_s``: the whole call)."""

    payload_bytes: int
    detect_s: float
    encode_s: float
    upload_s: float
    total_s: float


class SyncTimes(_Model):
    """One sync. ``apply_s``: writing into the receiver's tensors; ``pause_s``: the span in
    which the tensors are being modified (deltastore: its write phase; dense: the copy; coo:
    the scatter; xor-dense: decompress and XOR, which run interleaved in place)."""

    fetch_s: float
    decode_s: float
    verify_s: float
    apply_s: float
    pause_s: float
    total_s: float


class PublishSample(_Model):
    """A measured publish of one version, with the publisher process's peak extra RSS."""

    version: int
    changed_elements: int
    bytes_per_changed: float
    times: PublishTimes
    rss_extra_bytes: int


class SyncSample(_Model):
    """A measured sync of one version; ``exact``: the receiver's tensors hash (XXH3-64) to
    the workload's digest of that version."""

    version: int
    times: SyncTimes
    rss_extra_bytes: int
    digest: str
    exact: bool


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


class SystemResult(_Model):
    """One system through one store: every version measured, their medians, and whether the
    receiver was bit-exact at every version. ``*_setup_s``: the untimed setup of each side
    (deltastore: publishing the anchor; checking the receiver's tensors against it)."""

    system: SystemName
    publisher_setup_s: float
    subscriber_setup_s: float
    publish: list[PublishSample]
    sync: list[SyncSample]
    median: Medians
    publisher_rss_extra_max_bytes: int
    subscriber_rss_extra_max_bytes: int
    exact: bool


class Ratios(_Model):
    """Baseline / deltastore, from the medians (None where deltastore's value is 0)."""

    payload: float | None
    publish: float | None
    sync: float | None
    publisher_rss: float | None
    subscriber_rss: float | None


class StoreResult(_Model):
    """All systems through one store, plus deltastore's derived numbers there.

    ``detect_bound_s``: per version, one chunked ``np.not_equal`` + ``np.flatnonzero`` pass
    over the same old/new words (in deltastore's publisher process, just before its publish);
    ``publish_bound_ratio``: deltastore's median publish time / the median bound;
    ``pause_fraction``: deltastore's median pause / its median sync time."""

    store: str
    systems: dict[str, SystemResult]
    detect_bound_s: list[float]
    detect_bound_median_s: float | None
    publish_bound_ratio: float | None
    pause_fraction: float | None
    ratios: dict[str, Ratios]


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


class BarCheck(_Model):
    """One point of the performance bar: ``measured op threshold`` must hold."""

    name: str
    store: str | None
    measured: float | None
    op: Literal["<=", ">=", "<", ">"]
    threshold: float
    passed: bool
    what: str


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


class WorkloadInfo(_Model):
    """The versions measured. Lists are per measured version (the base is not in them);
    ``generate_s`` is the generation time, whether it happened in this run or not."""

    size: str
    elements: int
    tensors: int
    dense_bytes: int
    lr: float
    seed: int
    warmup: int
    versions: int
    changed_elements: list[int]
    changed_fraction: list[float]
    digests: list[str]
    generated_now: bool
    generate_s: float
    folder: str


class BenchResult(_Model):
    """The whole run (``deltastore bench --json``)."""

    schema_version: Literal[1] = 1
    created: str
    machine: Machine
    workload: WorkloadInfo
    stores: list[StoreResult]
    scaling: ScalingResult | None
    bars: list[BarCheck]
    exact: bool
    skipped: list[str]
    wall_s: float
