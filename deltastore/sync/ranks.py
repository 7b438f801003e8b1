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
from typing import TYPE_CHECKING, cast

import numpy as np

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
from deltastore.format.checksum import INVERSE, MOD, adler32, combine_frames
from deltastore.format.codecs import FrameDecoder
from deltastore.format.dtypes import itemsize, word_dtype
from deltastore.format.manifest import Manifest, TensorEntry
from deltastore.layout.boxes import (
    BoundLayout,
    Layout,
    covered,
    flat_span,
    inside,
    is_contiguous_box,
)
from deltastore.sync.apply import (
    DENSE,
    Hooks,
    Sums,
    Totals,
    Update,
    contribution,
    stage_at,
    stage_dense,
    verify_tensors,
    write_phase,
    writes_of,
)
from deltastore.sync.fetch import Fetcher, FrameTask, Timer
from deltastore.sync.group import Group
from deltastore.sync.routing import (
    Boxes,
    Segment,
    exchange,
    route,
    route_new_words,
    route_range,
)
from deltastore.sync.stage import frame_changes
from deltastore.tensors import words
from deltastore.tensors.dtypes import dtype_from_name, flat_words
from deltastore.tensors.host import Tensors, TensorT

if TYPE_CHECKING:
    import torch

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


_NO_SUMS = np.zeros(1, dtype=np.int64)
_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY_U8 = np.zeros(0, dtype=np.uint8)
#: A decoded frame: its changes routed per rank, or (staged inline) its updates and Adler-32
#: contributions (a :class:`~deltastore.sync.apply.Totals` vector).
Decoded = tuple[list[list[Segment]], list[Update], np.ndarray]


def zero_adler(nbytes: int) -> int:
    """Adler-32 of ``nbytes`` zero bytes."""
    return ((nbytes % MOD) << 16) | 1


class LayoutSync:
    """Applies manifests to the local tensors of one rank through ``layout``."""

    def __init__(self, layout: Layout | None, group: Group) -> None:
        self.layout, self.group = layout, group
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
        tensors: MutableMapping[str, TensorT] | None,
        device: str | torch.device,
    ) -> MutableMapping[str, TensorT]:
        """Resolve the layout against ``m`` (once per tensor table; a collective when the
        table is new), allocate zeroed local torch tensors on ``device`` if ``tensors`` is None
        (the only use of torch here: given tensors may be host tensors), and check that
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
            import torch

            tensors = cast(  # allocated here: torch's (the subscriber's default kind)
                "MutableMapping[str, TensorT]",
                {
                    local: torch.zeros(
                        shape,
                        dtype=dtype_from_name(dtypes[self.bound.local_sources[local][0]]),
                        device=device,
                    )
                    for local, shape in self.bound.local_shapes.items()
                },
            )
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
        tensors: Tensors,
        parent: dict[str, int] | None,
        timer: Timer,
        hooks: Hooks,
    ) -> tuple[float, float]:
        """Apply ``m`` to ``tensors`` (at the state whose per-tensor Adler-32 is ``parent``;
        None: unknown state, written directly from an anchor). Returns (verify s, pause s).

        Staged against a known state, the write phase (:func:`~deltastore.sync.apply.write_phase`)
        runs between ``hooks.pause`` and ``hooks.resume``; written directly, the whole apply
        does."""
        rounds = self._rounds(m)
        updates: list[Update] = []
        # a full version: every frame is checked when decoded, and the frames must add up to the
        # manifest's tensors (:meth:`_agree`); no sums of changes
        totals = Totals(len(self._names), counting=m.kind != "anchor")
        error: BaseException | None = None
        staged = 0.0  # gather + checksum of received changes: verification work
        fresh = parent is None
        # one rank staging against a known state: each frame is staged on its decode thread
        inline = (m, tensors) if self.group.world == 1 and not fresh else None
        if fresh and hooks.pause is not None:
            hooks.pause()
        try:
            for mine in rounds:
                out: list[list[Segment]] = [[] for _ in range(self.group.world)]
                if error is None:
                    try:
                        for routed, done, sums in frames.run(mine, self._decoder(inline), timer):
                            for r, segs in enumerate(routed):
                                out[r] += segs
                            updates += done
                            totals.vector += sums
                    except Exception as exc:
                        error = exc
                received = exchange(self.group, out, [t[1] for t in self._table])
                t0 = time.perf_counter()
                if error is None:
                    try:
                        for seg in received:
                            self._stage(seg, m, tensors, updates, totals, fresh=fresh)
                    except Exception as exc:
                        error = exc
                staged += time.perf_counter() - t0
                if error is not None and self.group.world == 1:
                    raise error
            t0 = time.perf_counter()
            self._agree(error, m, totals, parent)
            t1 = time.perf_counter()
            if not fresh:  # every rank writes, or none does
                write_phase(writes_of(tensors, updates), hooks, self._failed_ranks)
        finally:
            if fresh and hooks.resume is not None:
                hooks.resume()
        return staged + t1 - t0, time.perf_counter() - t1

    def check(self, m: Manifest, tensors: Tensors) -> list[str]:
        """Names of held tensors whose content is not at ``m`` (full read, a collective)."""
        totals = Totals(len(self._names))
        for name, ps in (self.bound.placements if self.bound else {}).items():
            entry = m.tensors[name]
            size = itemsize(entry.dtype)
            every = [b for _, bs in self._holders[name] for b in bs]
            for p in ps:
                dest = flat_words(tensors[p.local])
                run = p.runs()
                n = p.box.numel
                k = self._uniform_copies(name, entry.shape, run[0], run[0] + n) if run else None
                if run is not None and k is not None:  # one run: zlib's Adler-32, in chunks
                    value = 1
                    for a in range(0, n, 1 << 22):
                        chunk = words.gather_range(
                            dest, run[1] + a, min(n - a, 1 << 22), word_dtype(size)
                        )
                        value = adler32(chunk, value)
                    sums = Sums.from_zeros(value, n * size).shift(
                        n * size, run[0] * size, entry.nbytes
                    )
                    totals.add(self._index[name], sums.weighted(int(INVERSE[k])))
                    continue
                lo, hi = p.span()
                for a in range(lo, hi, 1 << 22):
                    pos = np.arange(a, min(hi, a + (1 << 22)), dtype=np.int64)
                    idx, local = p.select(pos)
                    gpos = pos[idx]
                    copies = sum(inside(gpos, entry.shape, o, n).astype(np.int64) for o, n in every)
                    vals = words.gather(dest, local, word_dtype(size))
                    totals.add(
                        self._index[name],
                        contribution(
                            gpos, np.zeros_like(vals), vals, entry.nbytes, INVERSE[copies]
                        ),
                    )
        total = self.group.all_reduce_sum(totals.vector)
        return [
            n
            for i, n in enumerate(self._names)
            if n in self._holders
            and totals.adler(i, zero_adler(m.tensors[n].nbytes), total) != m.tensors[n].adler32
        ]

    # --- steps --------------------------------------------------------------------------

    def _rounds(self, m: Manifest) -> list[list[FrameTask]]:
        """This rank's frames, per round (every rank computes every rank's share alike)."""
        tasks = [
            FrameTask(name, entry, f)
            for name, entry in m.tensors.items()
            if name in self._holders
            for f in entry.frames
            if any(
                a < f.stop and f.start < b
                for _, boxes in self._holders[name]
                for a, b in (flat_span(entry.shape, o, n) for o, n in boxes)
            )
        ]
        rounds: list[list[FrameTask]] = [[]]
        dense = 0
        for t in tasks:
            size = (t.frame.stop - t.frame.start) * itemsize(t.entry.dtype)
            if m.kind == "anchor" and rounds[-1] and dense + size > ROUND_BYTES:
                rounds.append([])
                dense = 0
            rounds[-1].append(t)
            dense += size
        mine: list[list[FrameTask]] = []
        for batch in rounds:
            load = [0] * self.group.world
            owner: dict[int, int] = {}
            for i in sorted(range(len(batch)), key=lambda i: -batch[i].frame.length):
                r = min(range(self.group.world), key=load.__getitem__)
                owner[i] = r
                load[r] += batch[i].frame.length
            mine.append([t for i, t in enumerate(batch) if owner[i] == self.group.rank])
        return mine

    def _decoder(
        self, inline: tuple[Manifest, Tensors] | None
    ) -> Callable[[FrameTask, bytes, FrameDecoder], Decoded]:
        """Per-frame work on the fetcher's threads: decode (the one codec dispatch), check the
        frame's changed count (XOR changes) or Adler-32 (new words, checked here since no rank
        sees the whole frame later), and route the changes to the ranks holding them; with
        ``inline`` (one rank, a known state: the manifest and the tensors) stage them there
        too (reads only), in parallel with the other frames."""

        def decode(task: FrameTask, data: bytes, dec: FrameDecoder) -> Decoded:
            routed = route_frame(task, data, dec)
            if inline is None:
                return routed, [], _NO_SUMS
            done: list[Update] = []
            totals = Totals(len(self._names), counting=inline[0].kind != "anchor")
            for seg in routed[0]:
                self._stage(seg, inline[0], inline[1], done, totals, fresh=False)
            return [[]], done, totals.vector

        def route_frame(task: FrameTask, data: bytes, dec: FrameDecoder) -> list[list[Segment]]:
            name, entry, f = task.name, task.entry, task.frame
            ti, holders = self._index[name], self._holders[name]
            size, n = itemsize(entry.dtype), f.stop - f.start
            routed: list[list[Segment]] = [[] for _ in range(self.group.world)]
            value, changed, new_words = 1, 0, False
            for ch in frame_changes(dec, f.codec, data, n, size, f.changed):
                if ch.positions is not None:  # many changes travel as a range of masks
                    changed += ch.positions.size  # entries (xor-patch: absolute ones too)
                    if not ch.xor:  # new words (xor-patch): runs as ranges, others sparse
                        at, new = ch.positions, ch.words
                        route_new_words(ti, entry.shape, holders, f.start, at, new, routed)
                    elif ch.positions.size * DENSE >= n:
                        masks = np.zeros(n, dtype=ch.words.dtype)
                        masks[ch.positions] = ch.words
                        route_range(
                            ti, entry.shape, holders, f.start, masks, routed, raw=False, copy=False
                        )
                    else:
                        at = ch.positions + f.start
                        route(ti, entry.shape, holders, False, at, ch.words, routed)
                elif ch.xor:
                    count = int(np.count_nonzero(ch.words))
                    changed += count
                    if count * DENSE >= ch.words.size:
                        at0 = f.start + ch.first
                        route_range(ti, entry.shape, holders, at0, ch.words, routed, raw=False)
                    else:
                        idx = dec.nonzero(ch.words)
                        at = idx + (f.start + ch.first)
                        route(ti, entry.shape, holders, False, at, ch.words[idx], routed)
                else:
                    new_words = True
                    value = adler32(ch.words, value)
                    route_range(ti, entry.shape, holders, f.start + ch.first, ch.words, routed)
            if new_words and value != f.adler32:
                raise IntegrityError(
                    f"{name}[{f.start}:{f.stop}]: raw frame decodes to Adler-32 {value:08x}, "
                    f"the manifest says {f.adler32:08x}; the stored object is damaged"
                )
            if not new_words and changed != f.changed:
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
        tensors: Tensors,
        updates: list[Update],
        totals: Totals,
        *,
        fresh: bool,
    ) -> None:
        """Map one segment into the local tensors: stage updates (or, fresh, write now) and add
        the held elements' Adler-32 contributions, weighted per copy, to ``totals``."""
        if self.bound is None:  # pragma: no cover - bound before apply
            raise LayoutError("layout is not bound")
        name = self._names[seg.tensor]
        entry = m.tensors[name]
        if seg.start >= 0:
            seg = self._stage_range(seg, entry, tensors, updates, totals, fresh=fresh)
        for p in self.bound.placements.get(name, ()):
            run = p.runs()
            sel: slice | np.ndarray
            if run is not None:  # a slice of the sorted positions, shifted
                a, b = np.searchsorted(seg.positions, (run[0], run[0] + p.box.numel))
                sel, local = slice(int(a), int(b)), seg.positions[a:b] + (run[1] - run[0])
            else:
                sel, local = p.select(seg.positions)
            if not local.size:
                continue
            copies = seg.copies[sel]
            weights = None if copies.max(initial=1) == 1 else INVERSE[copies]
            dest = flat_words(tensors[p.local])
            vals = seg.values[sel]
            if fresh:
                if not seg.raw:
                    raise ManifestError(f"{name}: a fresh receiver needs an anchor, got a delta")
                words.scatter(dest, local, vals)
                old, new = np.zeros_like(vals), vals
            else:
                old, new = stage_at(dest, local, vals, xor=not seg.raw)
                # new words: write those that change (XOR masks all change); the sums below
                # take them all (an unchanged word adds nothing)
                ch = np.flatnonzero(new != old) if seg.raw else slice(None)
                updates.append(Update(p.local, 0, local[ch], old[ch], new[ch]))
            if totals.counting:
                totals.add(
                    seg.tensor, contribution(seg.positions[sel], old, new, entry.nbytes, weights)
                )

    def _stage_range(
        self,
        seg: Segment,
        entry: TensorEntry,
        tensors: Tensors,
        updates: list[Update],
        totals: Totals,
        *,
        fresh: bool,
    ) -> Segment:
        """Apply a dense range (new words, or XOR masks) to the placements it covers as one
        slice (contiguous boxes with one copy count): written now (``fresh``), or staged with
        :func:`~deltastore.sync.apply.stage_dense`; return what is left, element-wise."""
        if self.bound is None:  # pragma: no cover - bound before apply
            raise LayoutError("layout is not bound")
        name = self._names[seg.tensor]
        if fresh and not seg.raw:
            raise ManifestError(f"{name}: a fresh receiver needs an anchor, got a delta")
        size = itemsize(entry.dtype)
        lo, hi = seg.start, seg.start + seg.values.size
        done: list[tuple[int, int]] = []  # ranges of the segment staged as runs
        for p in self.bound.placements.get(name, ()):
            run = p.runs()
            if run is None:
                continue
            src, dst = run
            a, b = max(lo, src), min(hi, src + p.box.numel)
            k = self._uniform_copies(name, entry.shape, a, b) if a < b else None
            if k is None:
                continue
            done.append((a - lo, b - lo))
            dest = flat_words(tensors[p.local])
            at = dst + a - src
            values = seg.values[a - lo : b - lo]
            if fresh:
                words.scatter_range(dest, at, values)
                sums = Sums()
                if totals.counting:
                    sums = Sums.from_zeros(adler32(values), (b - a) * size)
                    sums = sums.shift((b - a) * size, a * size, entry.nbytes)
            else:
                update, sums = stage_dense(
                    p.local,
                    dest,
                    at,
                    values,
                    a,
                    entry.nbytes,
                    xor=not seg.raw,
                    sums=totals.counting,
                )
                updates.append(update)
            totals.add(seg.tensor, sums.weighted(int(INVERSE[k])))
        reach = 0  # the segment's elements [0, reach) are staged (copies may overlap)
        for a, b in sorted(done):
            if a > reach:
                break
            reach = max(reach, b)
        if reach == seg.values.size:
            return Segment(seg.tensor, seg.raw, _EMPTY, _EMPTY_U8, seg.values[:0])
        rest = np.ones(seg.values.size, dtype=np.bool_) if seg.raw else seg.values != 0
        for a, b in done:
            rest[a:b] = False
        left = np.flatnonzero(rest)
        pos = left + lo
        every = [b for _, bs in self._holders[name] for b in bs]
        copies = sum(
            (inside(pos, entry.shape, o, n).astype(np.uint8) for o, n in every),
            np.zeros(pos.size, dtype=np.uint8),
        )
        return Segment(seg.tensor, seg.raw, pos, copies, seg.values[left])

    def _uniform_copies(self, name: str, shape: Sequence[int], a: int, b: int) -> int | None:
        """Copies in the group of every element of the flat range [a, b), if all have the same
        number and every box holds all of it or none of it; else None."""
        k = 0
        for _, boxes in self._holders[name]:
            for o, n in boxes:
                lo, hi = flat_span(shape, o, n)
                if hi <= a or b <= lo:
                    continue
                if is_contiguous_box(shape, o, n) and lo <= a and b <= hi:
                    k += 1
                else:
                    return None
        return k or None

    def _agree(
        self,
        error: BaseException | None,
        m: Manifest,
        totals: Totals,
        parent: dict[str, int] | None,
    ) -> None:
        """All-reduce failure codes and checksum contributions; raise unless all is well."""
        world = self.group.world
        vec = np.zeros(world + totals.vector.size, dtype=np.int64)
        if error is not None:
            vec[self.group.rank] = 1 + next(i for i, c in enumerate(_CODES) if isinstance(error, c))
        vec[world:] = totals.vector % MOD
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
        outcome = "they hold garbage now: sync again" if parent is None else "nothing was written"
        if not totals.counting:  # each frame was checked: they must add up to the tensors
            got = {
                name: combine_frames(
                    [(f.adler32, (f.stop - f.start) * itemsize(e.dtype)) for f in e.frames]
                )
                for name, e in m.tensors.items()
                if name in self._holders
            }
            verify_tensors(
                m,
                got,
                f"its frames do not add up to the tensor: the manifest is damaged; {outcome}",
            )
            return
        got = {
            name: totals.adler(
                i,
                zero_adler(m.tensors[name].nbytes) if parent is None else parent[name],
                total[world:],
            )
            for i, name in enumerate(self._names)
            if name in self._holders
        }
        verify_tensors(m, got, outcome)

    def _failed_ranks(self, failed_here: bool) -> list[int]:
        """The ranks whose writes failed (a collective: one all-reduce)."""
        flags = np.zeros(self.group.world, dtype=np.int64)
        flags[self.group.rank] = failed_here
        return [int(r) for r in np.flatnonzero(self.group.all_reduce_sum(flags))]


__all__ = ["LayoutSync", "Segment", "zero_adler"]
