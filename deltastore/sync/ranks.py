"""Applying versions through a receiver :class:`~deltastore.layout.Layout`, on one or many ranks.

Per version (docs/layouts.md; docs/design/architecture.md, the sync flow), every rank of the
group runs, in the same order:

1. *Plan*: the frames some rank's boxes touch, split among the ranks (largest first, to the
   least loaded rank; the same on every rank, from the manifest alone), in rounds of bounded
   dense bytes (one round for a delta).
2. *Decode* (worker threads): each rank fetches and decodes its frames and routes the decoded
   changes to the ranks whose boxes hold them, with each element's number of copies ``k`` in
   the group (replicated tensors, GQA kv heads repeated over ranks).
3. *Exchange* (two rounds of ``all_to_all_single``): counts per destination, then positions and
   values; every rank enters both rounds, also with nothing to send.
4. *Stage*: each rank maps the global positions it received to its local tensors, gathers the
   old words and computes the new ones and its Adler-32 contribution (O(changed)). Every copy
   contributes, weighted by the inverse of ``k`` modulo 65521: the copies add up to the
   element's change exactly when they agree, so a diverged replica fails verification too.
5. *Verify*: one all-reduce of every rank's failure code and per-tensor contributions; each
   tensor's sum must give the manifest's Adler-32. Any failure anywhere aborts everywhere.
6. *Write* (between the engine's pause and resume hooks): scatter the new words; one more
   all-reduce; if any rank failed to write, every rank restores its old words.

A fresh receiver (no known version) writes anchor frames directly and verifies afterwards.
Not thread-safe; one thread per rank calls it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deltastore.errors import (
    DeltastoreError,
    FrameError,
    IntegrityError,
    LayoutError,
    ManifestError,
    RankError,
    StoreError,
    TensorMismatchError,
)
from deltastore.format.checksum import (
    INVERSE,
    MOD,
    adler32,
    apply_delta,
    delta_sums,
    shift_to_outer,
)
from deltastore.format.codecs import RAW, XOR_SPARSE, FrameDecoder
from deltastore.format.dtypes import itemsize, word_dtype
from deltastore.format.manifest import Frame, Manifest, TensorEntry
from deltastore.layout.boxes import BoundLayout, Layout, _contiguous, _span, covered, inside
from deltastore.sync.fetch import Fetcher, Timer
from deltastore.sync.group import Group
from deltastore.sync.routing import Boxes, Segment, exchange, route, route_range
from deltastore.tensors.dtypes import dtype_from_name, flat_words
from deltastore.tensors.words import gather, gather_range, restore_all, scatter_range, write_all

#: Dense bytes of anchor frames decoded and exchanged per round (bounds exchange memory).
ROUND_BYTES = 256 << 20
_CODES: tuple[type[BaseException], ...] = (
    IntegrityError,
    FrameError,
    StoreError,
    ManifestError,
    TensorMismatchError,
    DeltastoreError,
    Exception,
)
Task = tuple[str, TensorEntry, Frame]


@dataclass
class _Write:
    local: str
    positions: np.ndarray
    old: np.ndarray
    new: np.ndarray


def zero_adler(nbytes: int) -> int:
    """Adler-32 of ``nbytes`` zero bytes."""
    return ((nbytes % MOD) << 16) | 1


class LayoutSync:
    """Applies manifests to the local tensors of one rank through ``layout``."""

    def __init__(self, layout: Layout | None, group: Group, scatter: Callable[..., None]) -> None:
        self.layout, self.group, self._scatter = layout, group, scatter
        self.bound: BoundLayout | None = None
        self._table: tuple[tuple[str, str, tuple[int, ...]], ...] = ()
        self._holders: dict[str, list[tuple[int, Boxes]]] = {}
        self._names: list[str] = []
        self._index: dict[str, int] = {}
        self._checked: tuple[object, ...] = ()

    # --- binding ------------------------------------------------------------------------

    def bind(
        self,
        m: Manifest,
        tensors: MutableMapping[str, torch.Tensor] | None,
        device: torch.device,
    ) -> MutableMapping[str, torch.Tensor]:
        """Resolve the layout against ``m`` (once per tensor table; a collective when the
        table is new), allocate zeroed local tensors if ``tensors`` is None, and check that
        every global tensor held by any rank is held whole by the group."""
        table = tuple((n, e.dtype, tuple(e.shape)) for n, e in m.tensors.items())
        if table != self._table:
            shapes = {n: tuple(e.shape) for n, e in m.tensors.items()}
            dtypes = {n: e.dtype for n, e in m.tensors.items()}
            layout = self.layout or Layout.identity(m.tensors)
            bound = layout.bind(shapes, None, dtypes)
            ranks = self.group.all_gather_bytes(json.dumps(bound.boxes()).encode())
            holders: dict[str, list[tuple[int, Boxes]]] = {}
            for r, blob in enumerate(ranks):
                for name, boxes in json.loads(blob).items():
                    holders.setdefault(name, []).append(
                        (r, [(tuple(o), tuple(n)) for o, n in boxes])
                    )
            crowded = [n for n, hs in holders.items() if sum(len(bs) for _, bs in hs) > 255]
            if crowded:
                raise LayoutError(
                    f"tensors {crowded[:4]} are held in more than 255 boxes across the group; "
                    "a layout may place each global tensor at most 255 times"
                )
            partial = [
                f"{n}: {got} of {int(np.prod(shapes[n]))} elements"
                for n, hs in holders.items()
                if (got := covered(shapes[n], [b for _, bs in hs for b in bs]))
                != int(np.prod(shapes[n]))
            ]
            if partial:
                raise LayoutError(
                    "the group holds only part of some tensors, which cannot then be verified "
                    f"({'; '.join(partial[:4])}); every element of a tensor a receiver holds "
                    "must be held by some rank of the group"
                )
            self.bound, self._holders, self._table = bound, holders, table
            self._names = list(m.tensors)
            self._index = {n: i for i, n in enumerate(self._names)}
        if self.bound is None:  # pragma: no cover - set above
            raise LayoutError("layout is not bound")
        dtypes = {n: e.dtype for n, e in m.tensors.items()}
        if tensors is None:
            tensors = {
                local: torch.zeros(
                    shape,
                    dtype=dtype_from_name(dtypes[self.bound.local_sources[local][0]]),
                    device=device,
                )
                for local, shape in self.bound.local_shapes.items()
            }
        seen = (table, tuple(map(id, tensors.values())))
        if seen != self._checked:  # the same tensor objects for the same table: checked
            self.bound.check(tensors, dtypes)
            self._checked = seen
        return tensors

    # --- one version --------------------------------------------------------------------

    def apply(
        self,
        frames: Fetcher,
        m: Manifest,
        tensors: MutableMapping[str, torch.Tensor],
        parent: dict[str, int] | None,
        timer: Timer,
        hooks: tuple[Callable[[], None] | None, Callable[[], None] | None],
    ) -> tuple[float, float]:
        """Apply ``m`` to ``tensors`` (at the state whose per-tensor Adler-32 is ``parent``;
        None: unknown state, written directly from an anchor). Returns (verify s, pause s)."""
        rounds = self._rounds(m)
        writes: list[_Write] = []
        sums = np.zeros(2 * len(self._names), dtype=np.int64)
        error: BaseException | None = None
        staged = 0.0  # gather + checksum of received changes: verification work
        pause, resume = hooks
        if parent is None and pause is not None:
            pause()
        try:
            for mine in rounds:
                out: list[list[Segment]] = [[] for _ in range(self.group.world)]
                if error is None:
                    try:
                        for routed in frames.run(mine, self._decoder(), timer):
                            for r, segs in enumerate(routed):
                                out[r] += segs
                    except Exception as exc:
                        error = exc
                received = exchange(self.group, out, [t[1] for t in self._table])
                t0 = time.perf_counter()
                if error is None:
                    try:
                        for seg in received:
                            self._stage(seg, m, tensors, writes, sums, fresh=parent is None)
                    except Exception as exc:
                        error = exc
                staged += time.perf_counter() - t0
                if error is not None and self.group.world == 1:
                    raise error
            t0 = time.perf_counter()
            self._agree(error, m, sums, parent)
            t1 = time.perf_counter()
            if parent is not None:
                self._write(writes, tensors, hooks)
        finally:
            if parent is None and resume is not None:
                resume()
        return staged + t1 - t0, time.perf_counter() - t1

    def check(self, m: Manifest, tensors: MutableMapping[str, torch.Tensor]) -> list[str]:
        """Names of held tensors whose content is not at ``m`` (full read, a collective)."""
        sums = np.zeros(2 * len(self._names), dtype=np.int64)
        for name, ps in (self.bound.placements if self.bound else {}).items():
            entry = m.tensors[name]
            size = itemsize(entry.dtype)
            every = [b for _, bs in self._holders[name] for b in bs]
            for p in ps:
                words = flat_words(tensors[p.local])
                lo, hi = p.span()
                for a in range(lo, hi, 1 << 22):
                    pos = np.arange(a, min(hi, a + (1 << 22)), dtype=np.int64)
                    idx, local = p.select(pos)
                    gpos = pos[idx]
                    copies = sum(inside(gpos, entry.shape, o, n).astype(np.int64) for o, n in every)
                    vals = gather(words, local, word_dtype(size))
                    da, db = delta_sums(
                        gpos, np.zeros_like(vals), vals, entry.nbytes, INVERSE[copies]
                    )
                    sums[2 * self._index[name]] += da
                    sums[2 * self._index[name] + 1] += db
        total = self.group.all_reduce_sum(sums) % MOD
        return [
            n
            for i, n in enumerate(self._names)
            if n in self._holders
            and apply_delta(
                zero_adler(m.tensors[n].nbytes), int(total[2 * i]), int(total[2 * i + 1])
            )
            != m.tensors[n].adler32
        ]

    # --- steps --------------------------------------------------------------------------

    def _rounds(self, m: Manifest) -> list[list[Task]]:
        """This rank's frames, per round (every rank computes every rank's share alike)."""
        tasks = [
            (name, entry, f)
            for name, entry in m.tensors.items()
            if name in self._holders
            for f in entry.frames
            if any(
                a < f.stop and f.start < b
                for _, boxes in self._holders[name]
                for a, b in (_span(entry.shape, o, n) for o, n in boxes)
            )
        ]
        rounds: list[list[Task]] = [[]]
        dense = 0
        for t in tasks:
            size = (t[2].stop - t[2].start) * itemsize(t[1].dtype)
            if m.kind == "anchor" and rounds[-1] and dense + size > ROUND_BYTES:
                rounds.append([])
                dense = 0
            rounds[-1].append(t)
            dense += size
        mine: list[list[Task]] = []
        for batch in rounds:
            load = [0] * self.group.world
            owner: dict[int, int] = {}
            for i in sorted(range(len(batch)), key=lambda i: -batch[i][2].length):
                r = min(range(self.group.world), key=load.__getitem__)
                owner[i] = r
                load[r] += batch[i][2].length
            mine.append([t for i, t in enumerate(batch) if owner[i] == self.group.rank])
        return mine

    def _decoder(self) -> Callable[[Task, bytes, FrameDecoder], list[list[Segment]]]:
        def decode(task: Task, data: bytes, dec: FrameDecoder) -> list[list[Segment]]:
            name, entry, f = task
            ti, holders = self._index[name], self._holders[name]
            size, n = itemsize(entry.dtype), f.stop - f.start
            routed: list[list[Segment]] = [[] for _ in range(self.group.world)]
            if f.codec == XOR_SPARSE:
                pos, masks = dec.sparse(data, n, size, f.changed)
                route(ti, entry.shape, holders, False, pos + f.start, masks, routed)
                return routed
            value, changed = 1, 0
            for first, words in dec.chunks(data, n, size):
                if f.codec == RAW:
                    value = adler32(words, value)
                    route_range(ti, entry.shape, holders, f.start + first, words, routed)
                else:
                    idx = dec.nonzero(words)
                    changed += idx.size
                    route(
                        ti, entry.shape, holders, False, idx + (f.start + first), words[idx], routed
                    )
            if f.codec == RAW and value != f.adler32:
                raise IntegrityError(
                    f"{name}[{f.start}:{f.stop}]: raw frame decodes to Adler-32 {value:08x}, "
                    f"the manifest says {f.adler32:08x}; the stored object is damaged"
                )
            if f.codec != RAW and changed != f.changed:
                raise FrameError(
                    f"{name}[{f.start}:{f.stop}]: frame changes {changed} elements, "
                    f"the manifest says {f.changed}"
                )
            return routed

        return decode

    def _stage(
        self,
        seg: Segment,
        m: Manifest,
        tensors: MutableMapping[str, torch.Tensor],
        writes: list[_Write],
        sums: np.ndarray,
        *,
        fresh: bool,
    ) -> None:
        """Map one segment into the local tensors: stage writes (or, fresh, write now) and add
        the owned elements' Adler-32 contributions to ``sums``."""
        if self.bound is None:  # pragma: no cover - bound before apply
            raise LayoutError("layout is not bound")
        name = self._names[seg.tensor]
        entry = m.tensors[name]
        wdt = word_dtype(itemsize(entry.dtype))
        if seg.start >= 0:
            seg = self._stage_range(seg, entry, tensors, writes, sums, fresh=fresh)
        for p in self.bound.placements.get(name, ()):
            idx, local = p.select(seg.positions)
            if not idx.size:
                continue
            copies = seg.copies[idx]
            weights = None if copies.max(initial=1) == 1 else INVERSE[copies]
            words = flat_words(tensors[p.local])
            vals = seg.values[idx]
            if fresh:
                if not seg.raw:
                    raise ManifestError(f"{name}: a fresh receiver needs an anchor, got a delta")
                self._scatter(words, local, vals)
                old = np.zeros_like(vals)
                new = vals
            else:
                old = gather(words, local, wdt)
                new = vals if seg.raw else old ^ vals
                ch = np.flatnonzero(new != old)
                writes.append(_Write(p.local, local[ch], old[ch], new[ch]))
            da, db = delta_sums(seg.positions[idx], old, new, entry.nbytes, weights)
            sums[2 * seg.tensor] += da
            sums[2 * seg.tensor + 1] += db

    def _stage_range(
        self,
        seg: Segment,
        entry: TensorEntry,
        tensors: MutableMapping[str, torch.Tensor],
        writes: list[_Write],
        sums: np.ndarray,
        *,
        fresh: bool,
    ) -> Segment:
        """Apply a dense range to the placements it covers as one slice (contiguous boxes with
        one copy count: a copy and a zlib Adler-32); return what is left, element-wise."""
        if self.bound is None:  # pragma: no cover - bound before apply
            raise LayoutError("layout is not bound")
        name = self._names[seg.tensor]
        size = itemsize(entry.dtype)
        lo, hi = seg.start, seg.start + seg.values.size
        rest = np.ones(seg.values.size, dtype=np.bool_)
        for p in self.bound.placements.get(name, ()):
            run = p.runs()
            if run is None:
                continue
            src, dst = run
            a, b = max(lo, src), min(hi, src + p.box.numel)
            k = self._uniform_copies(name, entry.shape, a, b) if a < b else None
            if k is None:
                continue
            rest[a - lo : b - lo] = False
            words = flat_words(tensors[p.local])
            new = seg.values[a - lo : b - lo]
            at = dst + a - src
            if fresh:
                scatter_range(words, at, new)
                value, m = adler32(new), (b - a) * size
                da, db = shift_to_outer(
                    ((value & 0xFFFF) - 1) % MOD,
                    ((value >> 16) - m) % MOD,
                    m,
                    a * size,
                    entry.nbytes,
                )
            else:
                old = gather_range(words, at, b - a, new.dtype)
                ch = np.flatnonzero(old != new)
                writes.append(_Write(p.local, ch + at, old[ch], new[ch]))
                da, db = delta_sums(ch + a, old[ch], new[ch], entry.nbytes)
            sums[2 * seg.tensor] += da * int(INVERSE[k]) % MOD
            sums[2 * seg.tensor + 1] += db * int(INVERSE[k]) % MOD
        left = np.flatnonzero(rest)
        pos = left + lo
        every = [b for _, bs in self._holders[name] for b in bs]
        copies = sum(
            (inside(pos, entry.shape, o, n).astype(np.uint8) for o, n in every),
            np.zeros(pos.size, dtype=np.uint8),
        )
        return Segment(seg.tensor, True, pos, copies, seg.values[left])

    def _uniform_copies(self, name: str, shape: Sequence[int], a: int, b: int) -> int | None:
        """Copies in the group of every element of the flat range [a, b), if all have the same
        number and every box holds all of it or none of it; else None."""
        k = 0
        for _, boxes in self._holders[name]:
            for o, n in boxes:
                lo, hi = _span(shape, o, n)
                if hi <= a or b <= lo:
                    continue
                if _contiguous(shape, o, n) and lo <= a and b <= hi:
                    k += 1
                else:
                    return None
        return k or None

    def _agree(
        self,
        error: BaseException | None,
        m: Manifest,
        sums: np.ndarray,
        parent: dict[str, int] | None,
    ) -> None:
        """All-reduce failure codes and checksum contributions; raise unless all is well."""
        world = self.group.world
        vec = np.zeros(world + sums.size, dtype=np.int64)
        if error is not None:
            vec[self.group.rank] = 1 + next(i for i, c in enumerate(_CODES) if isinstance(error, c))
        vec[world:] = sums % MOD
        total = self.group.all_reduce_sum(vec)
        if error is not None:
            raise error
        failed = [(r, int(c)) for r, c in enumerate(total[:world]) if c]
        if failed:
            raise RankError(
                "version "
                f"{m.version} aborted: "
                + ", ".join(f"rank {r} failed ({_CODES[c - 1].__name__})" for r, c in failed)
                + "; see that rank's log. Nothing was written on any rank"
            )
        bad = []
        for i, name in enumerate(self._names):
            if name not in self._holders:
                continue
            entry = m.tensors[name]
            base = zero_adler(entry.nbytes) if parent is None else parent[name]
            got = apply_delta(
                base, int(total[world + 2 * i]) % MOD, int(total[world + 2 * i + 1]) % MOD
            )
            if got != entry.adler32:
                bad.append(f"{name} ({got:08x}, manifest {entry.adler32:08x})")
        if bad:
            raise IntegrityError(
                f"version {m.version}: {len(bad)} tensors would not have the manifest's Adler-32 "
                f"after the update: {', '.join(bad[:4])}; "
                + ("they hold garbage now: sync again" if parent is None else "nothing was written")
            )

    def _write(
        self,
        writes: list[_Write],
        tensors: MutableMapping[str, torch.Tensor],
        hooks: tuple[Callable[[], None] | None, Callable[[], None] | None],
    ) -> None:
        """The write phase: scatter everywhere or, if any rank fails, nowhere."""
        pause, resume = hooks
        if pause is not None:
            pause()
        try:
            items = [
                (flat_words(tensors[w.local]), w.positions, w.old, w.new)
                for w in writes
                if w.positions.size
            ]
            error: BaseException | None = None
            try:
                write_all(items, self._scatter)  # all or nothing on this rank
            except Exception as exc:
                error = exc
            flags = np.zeros(self.group.world, dtype=np.int64)
            flags[self.group.rank] = error is not None
            failed = np.flatnonzero(self.group.all_reduce_sum(flags))
            if failed.size:
                if error is not None:
                    raise error
                restore_all(items, self._scatter)
                raise RankError(
                    f"rank(s) {failed.tolist()} failed to write; every rank restored its tensors"
                )
        finally:
            if resume is not None:
                resume()


__all__ = ["LayoutSync", "Segment", "zero_adler"]
