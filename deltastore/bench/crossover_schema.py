"""The JSON of ``deltastore bench --mode crossover`` (:class:`CrossoverResult`), as pydantic models.

A sweep of densities of changed elements (one AdamW learning rate per point), each synced by
deltastore and compared with the strongest dense load through the same store; per store, the
crossover density: below it deltastore's sync is faster than dense's load. Times are seconds
(``time.perf_counter``), sizes bytes, densities shares of the model's elements (changed /
elements, 0.01 = 1%). Ratios are ``dense / deltastore``: above 1 means deltastore is faster.
``mode`` tells this document from the other bench results. ``benchmarks/README.md``
(Crossover density) explains each number.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deltastore.bench.schema import BarCheck, LinkInfo, RunHeader, WorkloadHeader

CROSSOVER_SCHEMA_VERSION = 1

#: Where the crossover lies: interpolated between two points of the sweep, below its lowest
#: density (deltastore is not faster even there) or above its highest (faster everywhere).
CrossingStatus = Literal["crossed", "below the sweep", "above the sweep"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DensityPoint(_Model):
    """One point of the sweep through one store: the versions made at learning rate ``lr``
    (each one AdamW step from the one before), their densities (``densities``, per version;
    ``density``, their median), deltastore's sync of each (``deltastore_sync_s``: the whole
    ``Subscriber.sync`` call, told the version) and their medians (each field on its own), the
    dense time of the store (:attr:`DenseLoad.median_s`) and ``ratio`` = dense / deltastore
    median sync. ``exact``: deltastore's receiver hashed to the workload's digest at every
    version of the point."""

    lr: float
    versions: list[int]
    changed_elements: list[int]
    densities: list[float]
    density: float
    deltastore_sync_s: list[float]
    deltastore_median_s: float
    fetch_median_s: float
    decode_median_s: float
    pause_median_s: float
    payload_median_bytes: int
    publish_median_s: float
    dense_median_s: float
    ratio: float
    exact: bool


class DenseLoad(_Model):
    """The strongest dense load through one store (``dense`` of the transfer bench: every
    load method timed on every version, the one with the lowest median kept), on the first
    point's versions: it moves the whole model whatever the density. ``runs`` runs per store
    (each a publisher and a subscriber process), one before deltastore's and one after, their
    samples pooled. ``methods``: every method's median sync (s); ``versions``, ``sync_s``: the
    kept method's syncs, run after run."""

    method: str
    median_s: float
    methods: dict[str, float]
    runs: int
    versions: list[int]
    sync_s: list[float]
    publish_median_s: float
    exact: bool


class Crossing(_Model):
    """Where dense / deltastore crosses 1, scanning the points by rising density: ``density``
    is interpolated log-log (log ratio linear in log density) between the last point where
    deltastore is faster (ratio > 1) and the next one, ``between`` their densities (None
    outside the sweep); ``sign_changes``: how often the ratio crosses 1 over the whole sweep
    (more than 1: not monotone, e.g. noise near 1)."""

    status: CrossingStatus
    density: float | None
    between: tuple[float, float] | None
    sign_changes: int


class StoreCrossover(_Model):
    """The sweep through one store (``store``: its label, ``moto+cross-region`` behind a shaped
    link, :class:`LinkInfo`, whose ``deltastore_floor_s`` is None here: the payload varies
    per point). ``*_setup_s``: deltastore's untimed setup (publishing the anchor; checking
    the receiver's tensors against it). ``exact``: every sync of both systems bit-exact, the
    warm-up versions' included."""

    store: str
    link: LinkInfo | None
    dense: DenseLoad
    points: list[DensityPoint]
    crossover: Crossing
    publisher_setup_s: float
    subscriber_setup_s: float
    publish_method: str
    sync_method: str
    exact: bool


class CrossoverResult(WorkloadHeader, RunHeader):
    """The whole run (``deltastore bench --mode crossover --json``).

    The workload: ``size`` (``elements``, ``tensors``, ``dense_bytes`` of bf16), one chain of
    versions from one base (the initial weights, AdamW in its stationary state),
    ``warmup_versions`` steps at the first learning rate (synced by every worker, counted in
    no median: a worker's first sync pays one-off costs), then ``versions_per_point`` AdamW
    steps at each of ``lrs`` in turn; ``folder`` caches it.
    ``bars``: per store the reported check ``crossover density`` (op ``report``, status
    ``reported``: this mode has no bar; ``measured`` None outside the sweep).
    ``exact``: every receiver, deltastore's and dense's, bit-exact at every version.
    Header fields (first in the JSON): :class:`~deltastore.bench.schema.RunHeader`,
    :class:`~deltastore.bench.schema.WorkloadHeader`."""

    mode: Literal["crossover"] = "crossover"
    schema_version: Literal[1] = 1
    lrs: list[float]
    versions_per_point: int
    warmup_versions: int
    generate_s: float
    stores: list[StoreCrossover]
    bars: list[BarCheck]
    exact: bool
    skipped: list[str]
    load_average: list[float] = Field(default_factory=list)
    wall_s: float
