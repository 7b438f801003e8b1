"""A snapshot-free version from encoding to adoption, and attaching to a store.

:func:`prepare` decides (:meth:`SnapshotFree.decide`), encodes the reconstructed tensors on
the writer's encoder threads (:func:`deltastore.publish.snapfree.encode_frame`) and the
snapshot tensors on the writer's usual path, and uploads the frames; the caller commits (the
publisher, or the shard writers' coordinator) and then calls :meth:`Prepared.adopt`, the only
step that moves the writer (digests, step watermark, held snapshot words) to the version.
:func:`attach` continues a store's chain with digests computed chunk by chunk. Not
thread-safe: one writer thread, between optimizer steps.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from deltastore.errors import ChainError
from deltastore.format.checksum import combine_frames
from deltastore.format.keys import data_prefix
from deltastore.format.manifest import Manifest, Parent
from deltastore.progress import ProgressFn
from deltastore.publish.digests import digest_blocks
from deltastore.publish.publisher import ChainWriter, Pending
from deltastore.publish.snapfree import SnapshotFreeStats, encode_frame
from deltastore.publish.snapfree_writer import EMPTY, Decision, Item, Outcome, SnapshotFree
from deltastore.publish.snapshot import TensorSums, row_range
from deltastore.publish.upload import PackWriter, Uploads, copy_object_bytes


@dataclass
class Prepared:
    """A snapshot-free version encoded and uploaded, not committed yet: what the commit needs
    (``kind``, ``parent``, ``reason``: the anchor or anchor-copy reason, ``pending``) and what
    :meth:`adopt` applies once it is committed."""

    kind: Literal["anchor", "delta"]
    parent: Parent | None
    reason: str | None
    pending: Pending
    items: dict[str, Item]
    decision: Decision
    outcome: Outcome
    snap_host: dict[str, np.ndarray]
    stats: SnapshotFreeStats

    @property
    def sizes(self) -> tuple[int, int]:
        """Elements and dense bytes of what this writer published."""
        numel = sum(math.prod(it.local.shape) for it in self.items.values())
        dense = sum(
            math.prod(it.local.shape) * (2 if it.param is not None else it.local.element_size())
            for it in self.items.values()
        )
        return numel, dense

    def adopt(self, w: ChainWriter, sf: SnapshotFree, manifest: Manifest) -> None:
        """After the commit of ``manifest``: digests, watermark, held snapshot words."""
        p = self.pending
        sums = {n: TensorSums(p.frame_adler[n], e.adler32) for n, e in p.entries.items()}
        sf.adopt(self.decision, self.outcome, anchor=self.kind == "anchor")
        version, digest = manifest.version, manifest.state_digest
        if self.kind == "delta" and not self.decision.switch:
            w._held.update(version, digest, p.updates, sums)
        else:
            held = sf.held_words(self.items, self.snap_host)
            specs = {n: it.spec for n, it in self.items.items()}
            w._held.replace(version, digest, held, specs, sums, p.rows)


def prepare(
    w: ChainWriter,
    sf: SnapshotFree,
    items: dict[str, Item],
    *,
    version: int,
    same_table: bool,
    anchor: bool | None,
    progress: ProgressFn | None,
    rows: Mapping[str, tuple[int, int]] | None = None,
    copies: bool = True,
    auto_anchor: bool = True,
) -> Prepared:
    """Decide, encode and upload a snapshot-free version of ``items`` (not committed).
    ``same_table``: the items match the version held (a delta is possible); ``rows``: dim-0
    rows of global tensors (a shard writer); ``copies``: the anchor policy applies;
    ``auto_anchor``: a version whose reconstructed tensors are all gated becomes an anchor
    (False for shard writers, which must agree: those tensors go whole in a delta)."""
    if anchor is False and not same_table:
        raise ChainError(
            "cannot publish a delta: no parent state, or the tensor names/dtypes/shapes "
            "changed; publish an anchor (anchor=True or None)"
        )
    state = w._held.tensors
    delta = same_table and not anchor and state is not None
    decision = sf.decide(items, delta)
    if decision.anchor_reason is not None and not auto_anchor:
        decision.anchor_reason = None
    if decision.anchor_reason is not None:
        if anchor is False:
            raise ChainError(f"cannot publish a delta: {decision.anchor_reason}")
        delta = False
        why = decision.anchor_reason
        decision = sf.decide(items, False)
        decision.anchor_reason = why
    kind: Literal["anchor", "delta"] = "delta" if delta else "anchor"
    parent = w._parent() if delta else None
    if delta:
        reason = w._copy_reason() if copies else None
    else:
        reason = (
            "forced"
            if anchor
            else "first version"
            if state is None
            else decision.anchor_reason or "the tensor table changed"
        )
    full = delta and reason is not None
    snap = {n: it for n, it in items.items() if n not in decision.modes}
    snap_host = {n: it.words() for n, it in snap.items()}
    pending = Pending(rows=dict(rows or {}), copy_entries={} if full else None)
    grids = {n: w._frames_of(math.prod(items[n].local.shape), 2) for n in decision.modes}
    starts = {n: row_range(items[n].spec[1], rows[n])[0] for n in decision.modes} if rows else {}
    prefix = f"{data_prefix(version)}{w.token[:12]}-"
    uploads = Uploads(w._io, pending)
    packs = PackWriter(uploads, prefix, w._max_object_bytes, w._frame_digests)
    dense = sum(it.local.numel() * it.local.element_size() for it in items.values())
    copy_size = copy_object_bytes(w._max_object_bytes, dense)
    copy_packs = PackWriter(uploads, f"{prefix}anchor-", copy_size, w._frame_digests)
    encoders = w._encoders
    parent_sums = (
        {n: (state[n].frame_adler, state[n].adler) for n in decision.modes}
        if delta and state is not None
        else None
    )
    try:
        jobs = sf.jobs(items, decision, grids, full)
        with contextlib.closing(
            encoders.run(lambda job: encode_frame(job, encoders.encoder()), jobs)
        ) as results:
            t0 = time.perf_counter()
            outcome = sf.pack(
                results,
                items,
                decision,
                grids,
                starts,
                parent_sums,
                packs.add,
                copy_packs.add,
                pending.entries,
                pending.frame_adler,
                pending.copy_entries,
                pending.codecs,
            )
            pending.encode_s += time.perf_counter() - t0
        specs = {n: it.spec for n, it in snap.items()}
        w._pack(
            snap_host,
            specs,
            state if delta else None,
            kind,
            progress,
            {n: rows[n] for n in snap} if rows else None,
            pending,
            packs,
            copy_packs,
        )
    except BaseException:
        uploads.abort()
        raise
    uploads.finish()
    stats = sf.stats(items, decision, outcome)
    return Prepared(kind, parent, reason, pending, items, decision, outcome, snap_host, stats)


def attach(
    w: ChainWriter, sf: SnapshotFree, tensors: Mapping[str, torch.Tensor], manifest: Manifest
) -> int:
    """:meth:`Publisher.attach` with ``snapshot="none"``: check ``tensors`` against
    ``manifest`` (names, published dtypes and shapes, per-tensor Adler-32), then hold the
    block digests of the reconstructed ones (computed chunk by chunk, no words kept) and the
    words of the others; marks the inverter's step watermark."""
    from deltastore.errors import TensorMismatchError
    from deltastore.publish.publisher import table_entry
    from deltastore.tensors.tables import raise_if_mismatched

    items = sf.items(tensors, table_entry)
    table = {n: it.spec for n, it in items.items()}
    if table != {n: (e.dtype, e.shape) for n, e in manifest.tensors.items()}:
        raise TensorMismatchError(
            f"the tensors (published as {sorted(table)}) are not those of version "
            f"{manifest.version}: names, dtypes (float32 parameters are published as "
            "bfloat16) or shapes differ"
        )
    sums: dict[str, TensorSums] = {}
    digests: dict[str, np.ndarray] = {}
    held: dict[str, np.ndarray] = {}
    for name, it in items.items():
        if it.param is not None and it.reason is None:
            grid = w._frames_of(math.prod(it.local.shape), 2)
            frames, digests[name] = chunk_sums(it.flat, grid, sf.chunk)
            whole = combine_frames(
                (fa, (b - a) * 2) for fa, (a, b) in zip(frames, grid, strict=True)
            )
            sums[name] = TensorSums(frames, whole)
            held[name] = EMPTY
        else:
            held[name] = it.words()
            sums[name] = w._checksums(held[name])
    raise_if_mismatched(
        [n for n, t in sums.items() if t.whole != manifest.tensors[n].adler32], manifest
    )
    w._held.replace(manifest.version, manifest.state_digest, held, table, sums, {})
    sf.digests = digests
    sf.inverter.mark()
    return manifest.version


def chunk_sums(
    flat: torch.Tensor, grid: list[tuple[int, int]], chunk: int
) -> tuple[list[int], np.ndarray]:
    """Per-frame Adler-32 and the block digests of the bf16 cast of ``flat``, chunk by chunk
    into one reused buffer (for an attach: no copy of the tensor)."""
    from deltastore.publish.snapfree import new_words_adler

    buf = torch.empty(min(chunk, max((b - a for a, b in grid), default=0)), dtype=torch.bfloat16)
    sums: list[int] = []
    digests: list[np.ndarray] = []
    for a, b in grid:
        value = 1
        for c in range(a, b, chunk):
            words, value = new_words_adler(flat, c, min(c + chunk, b), buf, value)
            digests.append(digest_blocks(words))
        sums.append(value)
    return sums, np.concatenate(digests) if digests else np.empty(0, np.uint64)


def range_adler(flat: torch.Tensor, chunk: int, start: int, stop: int) -> int:
    """Adler-32 of the bf16 cast of ``flat[start:stop]``, chunk by chunk into one reused
    buffer."""
    from deltastore.publish.snapfree import new_words_adler

    buf = torch.empty(min(chunk, max(stop - start, 0)), dtype=torch.bfloat16)
    value = 1
    for c in range(start, stop, chunk):
        value = new_words_adler(flat, c, min(c + chunk, stop), buf, value)[1]
    return value


__all__ = ["Prepared", "attach", "chunk_sums", "prepare", "range_adler"]
