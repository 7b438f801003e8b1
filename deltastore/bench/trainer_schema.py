"""The JSON of ``deltastore bench --mode trainer`` (:class:`TrainerResult`), as pydantic models.

A trainer-in-the-loop run: real ``torch.optim.AdamW`` steps on the fp32 master weights of the
bench's model, each step followed by a publish, once per publisher (``none``: snapshot-free,
``memory``: the memory snapshot), each publisher in a process of its own running the same
seeded steps. Times are seconds (``time.perf_counter``), sizes bytes. ``benchmarks/README.md``
(Trainer in the loop) explains each number. ``mode`` tells this document from a
:class:`~deltastore.bench.schema.BenchResult`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from deltastore.bench.schema import BarCheck, RunHeader

TRAINER_SCHEMA_VERSION = 1

PublisherName = Literal["none", "memory"]
#: The publishers a trainer run compares, snapshot-free first.
PUBLISHERS: tuple[PublisherName, ...] = ("none", "memory")


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TrainerSample(_Model):
    """One measured version: the step that made it and its publish.

    ``step_s``: the ``optimizer.step()`` call; ``publish_s``: the whole publish as the
    trainer sees it (the memory publisher's includes ``cast_s``, the cast of the fp32 masters
    into its bf16 staging tensors; the snapshot-free publisher casts inside); ``ratio`` =
    ``publish_s / step_s``. ``rss_extra_bytes``: peak resident memory during the publish minus
    the trainer's own resident memory before the publisher existed (so it counts what the
    publisher holds between versions, snapshot and staging included, and its temporaries);
    ``step_rss_extra_bytes``: the same during the step (the optimizer's own temporaries).
    ``floor_s``: one read of the fp32 weights and both moments (a sum over each, torch, the
    run's threads), timed right after the publish. ``kernel_s``: the AdamW inverse alone over
    every parameter (``Inversion.chunks``, the compiled kernel), snapshot-free runs only.
    ``digest``: XXH3-64 of the version's bf16 words (every tensor in table order): the same in
    every publisher's run. ``uncertain``, ``blocks_verified``, ``blocks_raw``: the
    snapshot-free publisher's report (None for the memory publisher)."""

    version: int
    step_s: float
    publish_s: float
    ratio: float
    cast_s: float | None
    payload_bytes: int
    changed_elements: int
    rss_extra_bytes: int
    step_rss_extra_bytes: int
    floor_s: float
    kernel_s: float | None
    digest: str
    #: The snapshot-free run: seconds of each pass such a publish makes over the model, each
    #: timed on its own on one thread (``deltastore.bench.trainer.publish_passes``).
    passes_s: dict[str, float] = {}
    uncertain: int | None = None
    blocks_verified: int | None = None
    blocks_raw: int | None = None
    snapshots: int | None = None
    anchor_reason: str | None = None


class TrainerMedians(_Model):
    """Medians over the measured versions (each field on its own); ``rss_extra_max_bytes``
    is the largest of any version. ``step_min_s`` and ``publish_min_s``: the fastest step and
    the fastest publish of the run, and ``min_ratio`` = ``publish_min_s / step_min_s``: other
    load on the machine only adds time to either, so the fastest of each is the least
    disturbed (the bar uses this ratio)."""

    step_s: float
    publish_s: float
    ratio: float
    step_min_s: float
    publish_min_s: float
    min_ratio: float
    payload_bytes: float
    floor_s: float
    kernel_s: float | None
    rss_extra_max_bytes: int
    step_rss_extra_max_bytes: int


class PublisherRun(_Model):
    """One publisher's process. ``available``: False when this publisher could not be built
    here (``error`` says why; no samples). ``baseline_rss_bytes``: the trainer's resident
    memory after its warm-up steps and after importing the publisher's code (and loading the
    compiled kernel), before the publisher existed (the RSS baseline); ``code_rss_bytes``: what
    that import and load added, reported on its own (a fixed cost, not per model element).
    ``setup_s``: the first publish (the anchor), untimed in the medians. ``exact``: a
    subscriber that followed the store was bit-exact at every version (None: not checked)."""

    publisher: PublisherName
    method: str
    available: bool
    error: str | None
    #: The C allocator's setting in the run's process (``glibc default``, or the environment
    #: variables set, e.g. ``MALLOC_MMAP_THRESHOLD_=1048576`` for the ``none-live`` run).
    allocator: str = "glibc default"
    baseline_rss_bytes: int
    code_rss_bytes: int
    setup_s: float
    samples: list[TrainerSample]
    median: TrainerMedians | None
    exact: bool | None


class TrainerResult(RunHeader):
    """The whole trainer-in-the-loop run (``deltastore bench --mode trainer --json``).

    ``size``: the bench model size trained, ``size_reason`` why it and not a larger one (the
    trainer's fp32 state must fit beside the run); ``optimizer``: the AdamW implementation
    (``foreach``, ``fused``, ``single-tensor``) and ``threads`` torch's intra-op threads.
    ``runs``: by key, ``none`` and ``memory`` (glibc's default allocator, as a trainer runs),
    and ``none-live``: the snapshot-free run again with every buffer of 1 MiB or more mapped
    on its own and returned when freed (the publisher's live peak, without the free memory
    glibc's per-thread arenas keep). ``payload_ratio``: median over versions of the
    snapshot-free payload / the memory publisher's on the same version; ``same_versions``:
    every publisher's run made the same versions (equal digests). ``rss_method``: how the
    extra memory was measured. Header fields (first in the JSON):
    :class:`~deltastore.bench.schema.RunHeader`."""

    mode: Literal["trainer"] = "trainer"
    schema_version: Literal[1] = 1
    size: str
    size_reason: str
    elements: int
    tensors: int
    bf16_bytes: int
    trainer_state_bytes: int
    optimizer: str
    threads: int
    lr: float
    weight_decay: float
    seed: int
    warmup: int
    versions: int
    runs: dict[str, PublisherRun]
    payload_ratio: float | None
    same_versions: bool
    rss_method: str
    #: The machine's 1-minute load average at the start and at the end of the run (the
    #: timings of a run on a busy machine vary from version to version).
    load_average: list[float] = Field(default_factory=list)
    bars: list[BarCheck]
    exact: bool
    wall_s: float
