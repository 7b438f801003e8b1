"""The writer side of ``snapshot="none"``: which tensors are reconstructed, how each is sent.

:class:`SnapshotFree` belongs to one :class:`~deltastore.Publisher` or
:class:`~deltastore.ShardWriter` built with ``snapshot="none", optimizer=opt``. It attaches an
:class:`~deltastore.publish.reconstruct.AdamWInverter` to the optimizer (construct the writer
before the first ``opt.step()`` whose result is published), keeps the block digests of every
reconstructed tensor's last published words (no words) and decides per tensor and version:

- a float32 tensor that *is* a parameter of the optimizer (the same tensor, or the same
  storage, shape and dtype) is published as its bfloat16 cast and reconstructed: after one
  AdamW step a ``"delta"`` frame (:mod:`deltastore.publish.snapfree`); no step since the last
  publish (a skipped step, a parameter without a gradient) ``"verify"``: its new words checked
  against the digests; a transient gate (``steps``: not exactly one step, ``no-lr``,
  ``ambiguous-lr``, ``no-watermark``, ``hyper``) ``"absolute"``: sent whole as absolute words
  this version (every reconstructed tensor so gated: the version becomes an anchor);
- every other tensor (not a parameter, a bf16 parameter, a frozen parameter, the parameters of
  an optimizer or param group that is not plain decoupled AdamW) is held as a snapshot of its
  own words (the writer's usual path, for those tensors only), with the reason reported; a
  parameter found gated for good after some steps (bf16 moments: ``dtype``) is sent whole once
  and held as a snapshot from then on.

Call order (one thread, between optimizer steps): :meth:`SnapshotFree.items`,
:meth:`SnapshotFree.decide`, encode (:meth:`SnapshotFree.jobs` on the writer's encoder
threads, :meth:`SnapshotFree.pack`), commit, then :meth:`SnapshotFree.adopt`, which alone
changes the digests and marks the inverter: a failed publish leaves everything at the
previous version. :mod:`deltastore.publish.snapfree_prepare` runs these steps for a writer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from deltastore.format.checksum import combine_frames
from deltastore.format.manifest import Frame, TensorEntry
from deltastore.publish.digests import BLOCK, block_offsets
from deltastore.publish.reconstruct import (
    DEFAULT_CHUNK,
    AdamWInverter,
    Gate,
    Inversion,
    bf16_words,
    optimizer_gate,
)
from deltastore.publish.snapfree import (
    Mode,
    ReconFrame,
    ReconJob,
    ScratchPool,
    SnapshotFreeStats,
)

log = logging.getLogger("deltastore.publish.publisher")

#: Gates after which a tensor is sent whole this version only.
TRANSIENT = frozenset({"steps", "no-watermark", "no-lr", "ambiguous-lr", "hyper"})
#: Gates after which the old words are the current ones (verified against the digests).
UNMOVED = frozenset({"unchanged", "no-state"})
#: Warnings logged per publish for blocks sent raw, and for fallbacks, before a summary.
MAX_WARNINGS = 8
EMPTY = np.empty(0, dtype="<u2")


@dataclass
class Item:
    """One tensor to publish: ``local`` (the words' source: this writer's elements),
    ``param`` (the optimizer's parameter, a DTensor for an FSDP2 shard; None when it is not
    one), ``spec`` (format dtype and global shape), ``reason`` (why it is held as a snapshot;
    None: reconstructed)."""

    name: str
    local: torch.Tensor
    param: torch.Tensor | None
    spec: tuple[str, list[int]]
    reason: str | None

    @property
    def flat(self) -> torch.Tensor:
        return self.local.detach().reshape(-1)

    def words(self) -> np.ndarray:
        """The words to publish of a snapshot tensor (a bf16 cast of a float32 parameter)."""
        if self.param is not None:
            return bf16_words(self.flat.cpu().numpy())
        from deltastore.tensors.dtypes import host_words

        return host_words(self.local)


@dataclass
class Decision:
    """How each reconstructed tensor is sent this version (name -> mode and inversion), the
    tensors sent whole (name -> reason), those that become snapshots (name -> reason), and
    why the version becomes an anchor (None: it does not)."""

    modes: dict[str, tuple[Mode, Inversion | None]] = field(default_factory=dict)
    absolute: dict[str, str] = field(default_factory=dict)
    switch: dict[str, str] = field(default_factory=dict)
    anchor_reason: str | None = None


@dataclass
class Outcome:
    """Per reconstructed tensor: its new block digests (adopted after the commit); counters."""

    digests: dict[str, np.ndarray] = field(default_factory=dict)
    verified: int = 0
    raw: int = 0
    uncertain: int = 0
    warned: int = 0


class SnapshotFree:
    """Per-writer state of ``snapshot="none"`` (module docstring). ``chunk``: elements
    reconstructed per step (rounded to a multiple of :data:`BLOCK`). Not thread-safe."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, chunk: int = DEFAULT_CHUNK) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {optimizer!r}")
        self.optimizer = optimizer
        self.inverter = AdamWInverter(optimizer)
        self.chunk = max(BLOCK, chunk // BLOCK * BLOCK)
        #: Block digests of the last committed words of each reconstructed tensor.
        self.digests: dict[str, np.ndarray] = {}
        #: Tensors held as snapshots for good (name -> reason).
        self.sticky: dict[str, str] = {}
        #: Chunk buffers of the encoder threads, reused from publish to publish.
        self.scratch = ScratchPool()

    def close(self) -> None:
        """Remove the optimizer hook."""
        self.inverter.close()

    # --- which tensors -------------------------------------------------------------------

    def _params(
        self,
    ) -> tuple[dict[int, torch.Tensor], dict[tuple[int, tuple[int, ...]], torch.Tensor]]:
        ids: dict[int, torch.Tensor] = {}
        storage: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                ids[id(p)] = p
                if p.dtype == torch.float32 and not hasattr(p, "to_local"):
                    storage[(p.data_ptr(), tuple(p.shape))] = p
        return ids, storage

    def param_ids(self) -> set[int]:
        """The ``id()`` of every parameter of the optimizer (its param groups now)."""
        return {id(p) for g in self.optimizer.param_groups for p in g["params"]}

    def items(
        self,
        tensors: Mapping[str, torch.Tensor],
        specs: Callable[[str, torch.dtype | str, Sequence[int]], tuple[str, list[int]]],
        *,
        owners: Mapping[str, torch.Tensor | None] | None = None,
        shapes: Mapping[str, Sequence[int]] | None = None,
    ) -> dict[str, Item]:
        """Classify ``tensors`` (local tensors by name; ``owners``: the optimizer parameter of
        a name when known, e.g. a DTensor; ``shapes``: global shapes, default the local ones;
        ``specs``: the writer's table check, ``table_entry``)."""
        ids, storage = self._params()
        out: dict[str, Item] = {}
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: snapshot='none' publishes torch tensors, not {type(t)}")
            if hasattr(t, "to_local"):
                raise TypeError(
                    f"{name} is a DTensor: publish its rows from every rank with a ShardWriter "
                    "and RowSlice.of(param)"
                )
            shape = list(shapes[name]) if shapes is not None else list(t.shape)
            p = owners.get(name) if owners is not None else None
            if p is None:
                p = ids.get(id(t))
            if p is None and t.dtype == torch.float32 and t.device.type != "meta":
                p = storage.get((t.data_ptr(), tuple(t.shape)))
            if p is None or t.dtype != torch.float32:
                why = (
                    "not-a-parameter: not a float32 parameter of the optimizer"
                    if p is None
                    else f"dtype: a {t.dtype} parameter (bf16 master weights), not float32"
                )
                out[name] = Item(name, t, None, specs(name, t.dtype, shape), why)
                continue
            reason = self.sticky.get(name)
            if reason is None:
                gate = optimizer_gate(self.optimizer, p)
                if gate is None and not p.requires_grad:
                    gate = Gate("no-state", "frozen (requires_grad=False): no optimizer state")
                if gate is None and not t.is_contiguous():
                    gate = Gate("layout", "the tensor is not contiguous")
                reason = None if gate is None else f"{gate.code}: {gate.reason}"
            out[name] = Item(name, t, p, specs(name, "bfloat16", shape), reason)
        return out

    # --- how each is sent ----------------------------------------------------------------

    def decide(self, items: Mapping[str, Item], delta: bool) -> Decision:
        """Modes of the reconstructed tensors: all ``"new"`` for an anchor; for a delta, each
        by :meth:`AdamWInverter.plan` (module docstring). A tensor that should be a snapshot
        but holds only digests (it was reconstructed so far) is sent whole and switched."""
        d = Decision()
        recon = [it for it in items.values() if it.param is not None]
        for it in recon:
            if not delta:
                if it.reason is None:
                    d.modes[it.name] = ("new", None)
                continue
            if it.name not in self.digests:  # held as a snapshot: the usual path
                if it.reason is None:
                    it.reason = self.sticky.get(
                        it.name, "held as a snapshot since an earlier version"
                    )
                continue
            if it.reason is not None:
                d.modes[it.name] = ("absolute", None)
                d.absolute[it.name] = d.switch[it.name] = it.reason
                continue
            assert it.param is not None
            plan = self.inverter.plan(it.param)
            if isinstance(plan, Inversion):
                d.modes[it.name] = ("delta", plan)
            elif plan.code in UNMOVED:
                d.modes[it.name] = ("verify", None)
            else:
                why = f"{plan.code}: {plan.reason}"
                d.modes[it.name] = ("absolute", None)
                d.absolute[it.name] = why
                if plan.code not in TRANSIENT:
                    d.switch[it.name] = why
        tracked = [it for it in recon if it.name in self.digests]
        if delta and tracked and all(it.name in d.absolute for it in tracked) and not d.switch:
            first = next(iter(d.absolute.values()))
            d.anchor_reason = f"snapshot-free: every reconstructed tensor is gated ({first})"
        return d

    def jobs(
        self,
        items: Mapping[str, Item],
        decision: Decision,
        grids: Mapping[str, list[tuple[int, int]]],
        full: bool,
    ) -> Iterator[ReconJob]:
        """The frame jobs of the reconstructed tensors, in :attr:`Decision.modes` order."""
        for name, (mode, inversion) in decision.modes.items():
            held = self.digests.get(name)
            offsets = block_offsets(grids[name])
            for i, (a, b) in enumerate(grids[name]):
                part = held[offsets[i] : offsets[i + 1]] if held is not None else None
                yield ReconJob(
                    items[name].flat, a, b, mode, inversion, part, full, self.chunk, self.scratch
                )

    def pack(
        self,
        results: Iterator[ReconFrame],
        items: Mapping[str, Item],
        decision: Decision,
        grids: Mapping[str, list[tuple[int, int]]],
        starts: Mapping[str, int],
        parent_adler: Mapping[str, tuple[list[int], int]] | None,
        add: Callable[[bytes], tuple[str, int, str | None]],
        add_copy: Callable[[bytes], tuple[str, int, str | None]],
        entries: dict[str, TensorEntry],
        frame_adler: dict[str, list[int]],
        copy_entries: dict[str, TensorEntry] | None,
        codecs: dict[str, int],
    ) -> Outcome:
        """Turn the frame results (in :meth:`jobs` order) into tensor entries, packing each
        frame with ``add`` (``add_copy``: anchor-copy frames); frames sit at ``starts[name]``
        plus their local position; ``parent_adler``: per tensor the parent's frame and whole
        Adler-32 (None for an anchor)."""
        out = Outcome()
        for name in decision.modes:
            spec = items[name].spec
            parent = parent_adler[name] if parent_adler is not None else None
            start = starts.get(name, 0)
            frames: list[Frame] = []
            copies: list[Frame] = []
            sums: list[int] = []
            digests: list[np.ndarray] = []
            changed = 0
            for i, (a, b) in enumerate(grids[name]):
                r = next(results)
                pa = parent[0][i] if parent is not None else None
                if r.data is not None:
                    obj, offset, b3 = add(r.data)
                    frames.append(
                        Frame(
                            start=start + a,
                            stop=start + b,
                            codec=r.codec,
                            object=obj,
                            offset=offset,
                            length=len(r.data),
                            xxh3=r.xxh3,
                            changed=r.changed,
                            adler32=r.adler,
                            parent_adler32=pa,
                            blake3=b3,
                        )
                    )
                    codecs[r.codec] = codecs.get(r.codec, 0) + 1
                if r.full is not None:
                    obj, offset, b3 = add_copy(r.full.data)
                    copies.append(r.full.frame(start + a, start + b, obj, offset, r.adler, b3))
                out.verified += r.verified
                out.raw += r.raw
                out.uncertain += r.uncertain
                for at in r.raw_at:
                    if out.warned < MAX_WARNINGS:
                        log.warning(
                            "%s: the block of %d elements at %d did not match its digest: "
                            "sent whole as absolute words",
                            name,
                            BLOCK,
                            start + a + at,
                        )
                    out.warned += 1
                sums.append(r.adler)
                digests.append(r.digests)
                changed += r.changed
            total = combine_frames(
                (fa, (b - a) * 2) for fa, (a, b) in zip(sums, grids[name], strict=True)
            )
            frame_adler[name] = sums
            entries[name] = TensorEntry(
                dtype=spec[0],
                shape=spec[1],
                adler32=total,
                parent_adler32=parent[1] if parent is not None else None,
                changed=changed,
                frames=frames,
            )
            if copy_entries is not None:
                copy_entries[name] = TensorEntry(
                    dtype=spec[0],
                    shape=spec[1],
                    adler32=total,
                    parent_adler32=None,
                    changed=sum(b - a for a, b in grids[name]),
                    frames=copies,
                )
            out.digests[name] = np.concatenate(digests) if digests else np.empty(0, np.uint64)
        if out.warned > MAX_WARNINGS:
            log.warning("%d blocks in all did not match their digests", out.warned)
        return out

    def stats(
        self, items: Mapping[str, Item], decision: Decision, outcome: Outcome
    ) -> SnapshotFreeStats:
        """The report of one publish."""
        snapshots = {n: it.reason for n, it in items.items() if it.reason is not None}
        snapshots.update(decision.switch)
        for name, why in list(decision.absolute.items())[:MAX_WARNINGS]:
            log.warning("%s: sent whole as absolute words (%s)", name, why)
        return SnapshotFreeStats(
            reconstructed=sum(
                1 for n, (m, _) in decision.modes.items() if m in ("delta", "verify")
            ),
            snapshots=snapshots,
            absolute=dict(decision.absolute),
            blocks_verified=outcome.verified,
            blocks_raw=outcome.raw,
            uncertain=outcome.uncertain,
            anchor_reason=decision.anchor_reason,
        )

    def adopt(self, decision: Decision, outcome: Outcome, *, anchor: bool) -> None:
        """After the commit: the new digests (tensors switched to snapshots drop theirs; an
        anchor replaces them all), the sticky snapshot reasons, and the inverter's step
        watermark."""
        self.sticky.update(decision.switch)
        if anchor:
            self.digests = {}
        for name, d in outcome.digests.items():
            if name in decision.switch:
                self.digests.pop(name, None)
            else:
                self.digests[name] = d
        self.inverter.mark()

    def held_words(
        self, items: Mapping[str, Item], snap_host: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        """The words a writer holds after a full replace: a snapshot tensor's own, none for a
        reconstructed one (its digests stand in for them)."""
        out: dict[str, np.ndarray] = {}
        for name, it in items.items():
            if name in self.digests:
                out[name] = EMPTY
            elif name in snap_host:
                out[name] = snap_host[name]
            else:
                out[name] = it.words()
        return out


__all__ = ["Decision", "Item", "Outcome", "SnapshotFree"]
