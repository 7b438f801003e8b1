"""The JSON of ``deltastore bench --mode signing`` (:class:`SigningResult`), as pydantic models.

What signing costs: the same publishes and syncs of one synthetic model, unsigned (writer
``signing_key=None``, reader ``trusted_keys=None``) and Ed25519-signed (writer with an
:class:`~deltastore.Ed25519Key`, reader trusting its public key), in interleaved repeats;
beside them, the floors of the work signing adds (BLAKE3 of the version's stored frames, the
manifest's canonical bytes, one Ed25519 signature or check of them). Times are seconds of wall
time (``time.perf_counter``), sizes bytes. Ratios are ``on / off``: 1.02 means signing made
the operation 2% slower. ``mode`` tells this document from the other bench results;
``benchmarks/README.md`` (Signing cost) explains each number. Immutable models; thread-safe.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deltastore.bench.schema import AdamWHeader, RunHeader

SIGNING_SCHEMA_VERSION = 1

#: What one measured operation is: a publish (``Publisher.publish``) or a sync
#: (``Subscriber.sync``).
OpKind = Literal["publish", "sync"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Timing(_Model):
    """Samples of one measurement, in the order taken (seconds), their median and minimum."""

    samples_s: list[float]
    median_s: float
    min_s: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Timing:
        """The timing of ``samples`` (at least one)."""
        if not samples:
            raise ValueError("a timing needs at least one sample")
        return cls(
            samples_s=list(samples),
            median_s=statistics.median(samples),
            min_s=min(samples),
        )


class Floors(_Model):
    """The work signing adds to one version, timed on its own (in the bench process, one
    thread): ``blake3``, BLAKE3-256 (hex) of each of the version's ``frames`` stored frames in
    turn (``payload_bytes`` in all, as read from the signed store); ``canonical``,
    :meth:`~deltastore.format.manifest.Manifest.canonical_bytes` of its signed manifest
    (``manifest_bytes`` long: what a signature covers; ``unsigned_manifest_bytes``: the same
    version's manifest as the unsigned writer stored it, without ``blake3`` or ``signature``);
    ``sign`` / ``verify``, one Ed25519 signature / check of those bytes. ``canonical``,
    ``sign`` and ``verify`` samples are each the mean of :attr:`inner` calls."""

    version: int
    payload_bytes: int
    frames: int
    manifest_bytes: int
    unsigned_manifest_bytes: int
    inner: int
    blake3: Timing
    canonical: Timing
    sign: Timing
    verify: Timing


class Comparison(_Model):
    """One operation unsigned (``off``) and signed (``on``), repeat by repeat.

    ``name``: ``anchor publish`` (a new publisher's first version), ``delta publish`` (the
    next version, a delta), ``anchor sync`` (a fresh reader's first sync, into preallocated
    tensors) or ``delta sync`` (a follower at the anchor syncing the delta; its tensors
    checked untimed before). Publish times are the whole ``Publisher.publish`` call, sync
    times the whole ``Subscriber.sync`` call. ``payload_bytes``: the version's stored frames
    (the signed publish's report). ``ratio_median`` = ``on.median_s / off.median_s``,
    ``ratio_min`` = ``on.min_s / off.min_s``, ``extra_median_s`` = ``on.median_s -
    off.median_s``; ``floor_s``: the medians of the version's :class:`Floors` that this
    operation adds (BLAKE3 + canonical bytes + sign for a publish, + verify for a sync).
    ``exact``: every sync of both sides left the tensors bit-exact (publishes: True)."""

    name: str
    op: OpKind
    version: int
    payload_bytes: int
    off: Timing
    on: Timing
    ratio_median: float
    ratio_min: float
    extra_median_s: float
    floor_s: float
    exact: bool


class StoreSigning(_Model):
    """Every comparison through one store (``store``: its label). ``signed``: every manifest
    the signed publishes committed carries an Ed25519 signature and a BLAKE3 in every frame;
    ``unsigned``: none of the unsigned publishes' manifests carries either."""

    store: str
    comparisons: list[Comparison]
    floors: list[Floors]
    signed: bool
    unsigned: bool
    exact: bool


class SigningResult(AdamWHeader, RunHeader):
    """The whole run (``deltastore bench --mode signing --json``).

    The workload: ``size`` (``elements``, ``tensors``, ``dense_bytes`` of bf16), the bench's
    workload (:mod:`deltastore.bench.workload`: AdamW steps at ``lr`` from the stationary
    state, ``warmup`` steps before the base) cached in ``folder``: version 0, the base,
    published as the anchor, and version 1 (``changed_elements`` differ from the base:
    ``density`` of them) as the delta. ``repeats``: interleaved repeats of every comparison,
    the side that goes first alternating (one more untimed round before them warms up
    kernels and caches). ``key_id``: the Ed25519 key's id (made for the run).
    ``exact``: every sync bit-exact.
    Header fields (first in the JSON): :class:`~deltastore.bench.schema.RunHeader`,
    :class:`~deltastore.bench.schema.AdamWHeader`."""

    mode: Literal["signing"] = "signing"
    schema_version: Literal[1] = 1
    changed_elements: int
    density: float
    repeats: int
    key_id: str
    stores: list[StoreSigning]
    exact: bool
    skipped: list[str]
    load_average: list[float] = Field(default_factory=list)
    wall_s: float


__all__ = [
    "SIGNING_SCHEMA_VERSION",
    "Comparison",
    "Floors",
    "OpKind",
    "SigningResult",
    "StoreSigning",
    "Timing",
]
