"""The JSON of ``deltastore bench --mode sharded`` (:class:`ShardedResult`), as pydantic models.

A sharded publish run: ``world`` shard writers (:class:`~deltastore.ShardWriter`, memory
snapshot), one process each, publish dim-0 row shards of the bench's model in bf16 and commit
each version together; per rank and per density of changed elements, what the publish costs in
memory beyond the writer's snapshot, next to the shard's own bf16 bytes. Times are seconds
(``time.perf_counter``), sizes bytes. ``mode`` tells this document from the other bench results.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deltastore.bench.schema import BarCheck, RunHeader

SHARDED_SCHEMA_VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ShardedSample(_Model):
    """One version as one rank saw it: ``publish`` (:meth:`ShardWriter.publish`), the commit
    (rank 0 runs ``commit_parts``), ``finish`` (the snapshot moved to the version).

    ``measure``: how the memory of this version was measured (one way per version, so that
    neither disturbs the other): ``rss``: peak VmHWM (reset through ``/proc/self/clear_refs``
    after a ``gc.collect()`` and ``malloc_trim(0)``) minus VmRSS on entry, over the whole
    version (publish, commit, finish): every allocation, torch's and zstd's included, plus the
    allocator's and threads' own (encoder and upload thread stacks, arenas); ``traced``:
    ``tracemalloc`` (numpy buffers and Python objects, zstd's output bytes included; not torch,
    not zstd's contexts), started on entry so that only this version's allocations count:
    ``peak_bytes`` over the whole version, ``publish_peak_bytes`` during ``publish``,
    ``held_bytes`` what ``publish`` left allocated for ``finish`` (the changes to write into the
    snapshot, an anchor's copy). Times of a ``traced`` version include tracemalloc's overhead
    (compare the ``rss`` ones)."""

    version: int
    kind: Literal["anchor", "delta"]
    #: Asked share of the shard's elements changed since the last version (None: the anchor).
    density: float | None
    measure: Literal["rss", "traced"]
    changed_elements: int
    total_elements: int
    changed_fraction: float
    payload_bytes: int
    publish_s: float
    commit_s: float
    finish_s: float
    peak_bytes: int
    #: ``peak_bytes`` / the shard's bf16 bytes.
    peak_ratio: float
    publish_peak_bytes: int | None = None
    held_bytes: int | None = None
    codecs: dict[str, int] = {}
    #: Why this version is an anchor or, for a delta, also has an anchor copy (the writers'
    #: anchor policy, "cost" by default); None for a plain delta. ``anchor_copy_bytes``: this
    #: rank's stored bytes of the copy (its rows' frames of new words), encoded in the same
    #: pass as the delta.
    anchor_reason: str | None = None
    anchor_copy_bytes: int | None = None


class RankRun(_Model):
    """One rank's process: its shard (elements and bf16 bytes of its rows of every tensor),
    its resident memory after the anchor (``snapshot_rss_bytes``: the snapshot, the shard and
    the code), its samples, and the xxh3 of its rows at the last version (per tensor)."""

    rank: int
    shard_elements: int
    shard_bf16_bytes: int
    baseline_rss_bytes: int
    snapshot_rss_bytes: int
    samples: list[ShardedSample]
    digests: dict[str, str]


class DensitySummary(_Model):
    """Per density (the anchor: ``density`` None), the largest of every rank's samples:
    ``rss_ratio`` and ``traced_ratio`` are peak bytes / the rank's shard bf16 bytes (the
    largest over ranks and repeats), ``publish_s`` the slowest ``rss`` publish. Deltas that
    also wrote an anchor copy are summarized on their own (``anchor_copy`` True)."""

    density: float | None
    anchor_copy: bool = False
    changed_fraction: float
    rss_ratio: float
    traced_ratio: float
    traced_held_ratio: float
    publish_s: float
    payload_ratio: float


class ShardedResult(RunHeader):
    """The whole run (``deltastore bench --mode sharded --json``).

    ``size``: the model's size name (``fsdp-2.5m``: the 2.5M-element model of the report this
    bench was written for, else a name of the bench's table); ``world`` writers, each a process
    of its own (spawn), dim-0 row shards as FSDP2 cuts them (``ceil(rows / world)`` rows per
    rank); ``options``: the writers' options; ``repeats``: versions per density and per way
    of measuring. ``exact``: a subscriber that followed the store holds, at the last version,
    every rank's rows bit for bit. Header fields (first in the JSON):
    :class:`~deltastore.bench.schema.RunHeader`."""

    mode: Literal["sharded"] = "sharded"
    schema_version: Literal[1] = 1
    size: str
    elements: int
    tensors: int
    world: int
    options: dict[str, int | str]
    densities: list[float]
    repeats: int
    seed: int
    ranks: list[RankRun]
    summary: list[DensitySummary]
    method: str
    #: The C allocator's setting in the ranks' processes: ``glibc default``, or the
    #: ``MALLOC_*`` environment variables set (e.g. ``MALLOC_MMAP_THRESHOLD_=131072``: every
    #: buffer of 128 KiB or more a mapping of its own, returned when freed, so that RSS shows
    #: the live peak without what glibc keeps of freed buffers).
    allocator: str = "glibc default"
    load_average: list[float] = Field(default_factory=list)
    bars: list[BarCheck]
    exact: bool
    wall_s: float
