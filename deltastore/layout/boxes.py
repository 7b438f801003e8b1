"""Receiver layouts: where the elements of the trainer's global tensors live locally.

A rollout engine rarely holds the trainer's tensors as they are: it holds tensor-parallel
slices, fuses q/k/v and gate/up, stacks experts and renames everything. A :class:`Layout`
declares, for each *local* tensor, an expression over *global* tensors (manifest names):

- :func:`replicate` ``(name)``: the whole global tensor (a string is short for this);
- :func:`shard` ``(part, dim, rank, world)``: this rank's range of ``part`` along ``dim``
  (even split; ``sizes=`` for uneven splits, ``block=`` for padded fixed-size blocks such as
  vocab-parallel embeddings whose last rank is partly padding);
- :func:`fuse` ``(parts, dim)``: parts concatenated along ``dim`` (``qkv_proj``, ``gate_up_proj``);
- :func:`stack` ``(parts)``: parts stacked along a new leading dim (MoE ``w13_weight``);
- :class:`Placed` ``(shape, boxes, padding)``: explicit boxes of a local tensor of ``shape``
  (what a trace of the engine's own weight loading finds, :mod:`deltastore.engines.vllm_trace`).

Declarations hold no shapes. :meth:`Layout.bind` resolves them against a manifest's shapes into
frozen :class:`Placement` items (like torch.distributed.checkpoint's ReadItem: a box of a global
tensor, its source offsets, destination offsets and lengths per dimension) and checks them
against the local tensors. Index math on changed positions is vectorized int64 numpy: memory
and time are O(changed), and nothing of full size is materialized.

Everything here is immutable and thread-safe. Offsets and lengths are in elements; flat
positions are C-order element indices (int64).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from deltastore.errors import LayoutError

if TYPE_CHECKING:
    from deltastore.tensors.host import Tensors

# --- declarations -------------------------------------------------------------------------


@dataclass(frozen=True)
class Replicate:
    """The whole global tensor ``name``."""

    name: str


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``world`` ranges of ``part`` along ``dim`` (see :func:`shard`)."""

    part: Part
    dim: int
    rank: int
    world: int
    sizes: tuple[int, ...] | None = None
    block: int | None = None


@dataclass(frozen=True)
class Fuse:
    """``parts`` concatenated along ``dim``."""

    parts: tuple[Part, ...]
    dim: int


@dataclass(frozen=True)
class Stack:
    """``parts`` stacked along a new leading dimension."""

    parts: tuple[Part, ...]


@dataclass(frozen=True)
class Placed:
    """A local tensor of ``shape`` holding explicit ``boxes`` of global tensors (each box's
    ``dst_offset`` in the local dims; local-only leading dims have length 1 in the box);
    ``padding``: ``(offset, lengths)`` regions of the local tensor (local dims) that no
    global tensor writes (a padded vocabulary's rows). :meth:`Layout.bind` checks that every
    box lies inside its global tensor and the local tensor and that no two boxes or padding
    regions overlap."""

    shape: tuple[int, ...]
    boxes: tuple[Box, ...]
    padding: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()


Part = Replicate | Shard | Fuse | Stack | Placed


def _part(p: Part | str) -> Part:
    return Replicate(p) if isinstance(p, str) else p


def replicate(name: str) -> Replicate:
    """The whole global tensor ``name`` (replicated on every rank that declares it)."""
    return Replicate(name)


def shard(
    part: Part | str,
    dim: int,
    rank: int,
    world: int,
    *,
    sizes: Sequence[int] | None = None,
    block: int | None = None,
) -> Shard:
    """Rank ``rank``'s slice of ``part`` along ``dim`` out of ``world`` ranks.

    Default: an even split (the extent must divide by ``world``). ``sizes``: explicit extents
    per rank (they must add up to the extent). ``block``: every rank holds ``block`` entries,
    rank r the range ``[r*block, (r+1)*block)`` clipped to the extent (the local tensor keeps
    ``block`` entries; the ones past the extent are padding no version touches).
    Column-parallel linear weights shard ``dim=0``, row-parallel ones ``dim=1``.
    """
    if world < 1 or not 0 <= rank < world:
        raise LayoutError(f"shard: rank {rank} is not in [0, {world})")
    if sizes is not None and block is not None:
        raise LayoutError("shard: give sizes= or block=, not both")
    if sizes is not None and (len(sizes) != world or min(sizes) < 0):
        raise LayoutError(f"shard: sizes {list(sizes)} must be {world} non-negative extents")
    if block is not None and block < 1:
        raise LayoutError(f"shard: block must be positive, got {block}")
    return Shard(_part(part), dim, rank, world, None if sizes is None else tuple(sizes), block)


def fuse(parts: Iterable[Part | str], dim: int = 0) -> Fuse:
    """``parts`` concatenated along ``dim`` (e.g. ``qkv_proj = [q; k; v]`` on dim 0)."""
    out = tuple(_part(p) for p in parts)
    if not out:
        raise LayoutError("fuse: no parts")
    return Fuse(out, dim)


def stack(parts: Iterable[Part | str]) -> Stack:
    """``parts`` (of equal shapes) stacked along a new leading dim (e.g. MoE experts)."""
    out = tuple(_part(p) for p in parts)
    if not out:
        raise LayoutError("stack: no parts")
    return Stack(out)


# --- bound placements ---------------------------------------------------------------------


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle of global tensor ``source``: ``offset`` and ``lengths`` in the global
    tensor's dims, placed at ``dst_offset`` of a local tensor. The local tensor may have more
    dims than the source; the extra ones lead and have length 1 in the box."""

    source: str
    offset: tuple[int, ...]
    lengths: tuple[int, ...]
    dst_offset: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)


@dataclass(frozen=True)
class Placement:
    """One box of a global tensor held in local tensor ``local`` (of shape ``local_shape``)."""

    local: str
    local_shape: tuple[int, ...]
    box: Box
    source_shape: tuple[int, ...]

    def span(self) -> tuple[int, int]:
        """Smallest flat range ``[lo, hi)`` of the source holding the box."""
        return flat_span(self.source_shape, self.box.offset, self.box.lengths)

    def runs(self) -> tuple[int, int] | None:
        """``(source start, local start)`` when the box is one contiguous run of flat elements
        both in the source and in the local tensor (then position p maps to p - source start +
        local start); else None."""
        extra = len(self.local_shape) - len(self.source_shape)
        src = _run(self.box.offset, self.box.lengths, self.source_shape)
        dst = _run(self.box.dst_offset, (1,) * extra + self.box.lengths, self.local_shape)
        return None if src is None or dst is None else (src, dst)

    def select(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For sorted global flat ``positions`` (int64): the indices into ``positions`` that fall
        in the box, and their flat positions in the local tensor (both int64, O(len))."""
        return _select(self, positions)


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _run(offset: Sequence[int], lengths: Sequence[int], shape: Sequence[int]) -> int | None:
    """Flat start of the box if its elements form one contiguous C-order run, else None."""
    k = next((i for i, n in enumerate(lengths) if n != 1), len(lengths))
    if any(lengths[i] != shape[i] for i in range(k + 1, len(shape))):
        return None
    return sum(o * s for o, s in zip(offset, _strides(shape), strict=True))


def flat_span(
    shape: Sequence[int], offset: Sequence[int], lengths: Sequence[int]
) -> tuple[int, int]:
    """Smallest flat C-order range ``[lo, hi)`` (element indices) of a tensor of ``shape``
    that holds the box at ``offset`` with ``lengths``; ``(0, 0)`` for an empty box."""
    if math.prod(lengths) == 0:
        return 0, 0
    strides = _strides(shape)
    lo = sum(o * s for o, s in zip(offset, strides, strict=True))
    hi = sum((o + n - 1) * s for o, n, s in zip(offset, lengths, strides, strict=True))
    return lo, hi + 1


def inside(
    positions: np.ndarray, shape: Sequence[int], offset: Sequence[int], lengths: Sequence[int]
) -> np.ndarray:
    """Bool mask: which sorted flat ``positions`` of a tensor of ``shape`` fall in the box."""
    run = _run(offset, lengths, shape)
    if run is not None:
        out = np.zeros(positions.size, dtype=np.bool_)
        a, b = np.searchsorted(positions, (run, run + math.prod(lengths)))
        out[a:b] = True
        return out
    return _unravel(positions, shape, offset, lengths)[0]


def _unravel(
    pos: np.ndarray, shape: Sequence[int], offset: Sequence[int], lengths: Sequence[int]
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Mask of positions in the box, and their coordinates per dim (C order)."""
    mask = np.ones(pos.size, dtype=np.bool_)
    coords: list[np.ndarray] = []
    rest = pos
    for n, o, length in zip(reversed(shape), reversed(offset), reversed(lengths), strict=True):
        rest, c = np.divmod(rest, max(n, 1))
        mask &= (c >= o) & (c < o + length)
        coords.append(c)
    coords.reverse()
    return mask, coords


def is_contiguous_box(shape: Sequence[int], offset: Sequence[int], lengths: Sequence[int]) -> bool:
    """Whether the box is one contiguous run of flat elements of a tensor of ``shape``."""
    return _run(offset, lengths, shape) is not None


def _select(p: Placement, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    box = p.box
    extra = len(p.local_shape) - len(p.source_shape)
    dst_strides = _strides(p.local_shape)
    runs = p.runs()
    if runs is not None:  # both contiguous: a shift (the common case)
        src_run, dst_run = runs
        a, b = np.searchsorted(pos, (src_run, src_run + box.numel))
        return np.arange(a, b, dtype=np.int64), pos[a:b] + (dst_run - src_run)
    mask, coords = _unravel(pos, p.source_shape, box.offset, box.lengths)
    idx = np.flatnonzero(mask)
    lead = sum(o * s for o, s in zip(box.dst_offset[:extra], dst_strides[:extra], strict=True))
    local = np.full(idx.size, lead, dtype=np.int64)
    for c, o, q, s in zip(
        coords, box.offset, box.dst_offset[extra:], dst_strides[extra:], strict=True
    ):
        local += (c[idx] - (o - q)) * s
    return idx, local


def covered(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]) -> int:
    """Number of elements of a tensor of ``shape`` in the union of ``(offset, lengths)`` boxes.

    Exact, by coordinate compression: cost grows with the number of distinct box edges per
    dim, not with the tensor size."""
    if not boxes or not shape:
        return int(math.prod(shape)) if boxes else 0
    edges = [
        np.unique(np.array([x for o, n in boxes for x in (o[d], o[d] + n[d])], dtype=np.int64))
        for d in range(len(shape))
    ]
    grid = np.zeros(tuple(max(e.size - 1, 0) for e in edges), dtype=np.bool_)
    for o, n in boxes:
        sl = tuple(
            slice(int(np.searchsorted(e, o[d])), int(np.searchsorted(e, o[d] + n[d])))
            for d, e in enumerate(edges)
        )
        grid[sl] = True
    sizes = [np.diff(e) for e in edges]
    vol = np.ones(grid.shape, dtype=np.int64)
    for d, sz in enumerate(sizes):
        vol = vol * sz.reshape((1,) * d + (-1,) + (1,) * (len(sizes) - d - 1))
    return int(vol[grid].sum())


@dataclass(frozen=True)
class _Bound:
    shape: tuple[int, ...]
    boxes: tuple[Box, ...]


def _bind(part: Part, shapes: Mapping[str, Sequence[int]], where: str) -> _Bound:
    if isinstance(part, Replicate):
        if part.name not in shapes:
            raise LayoutError(f"{where}: global tensor {part.name!r} is not in the manifest")
        shape = tuple(int(n) for n in shapes[part.name])
        return _Bound(shape, (Box(part.name, (0,) * len(shape), shape, (0,) * len(shape)),))
    if isinstance(part, Shard):
        inner = _bind(part.part, shapes, where)
        d = _dim(part.dim, len(inner.shape), where)
        extent = inner.shape[d]
        if part.block is not None:
            size = part.block
            lo = min(part.rank * size, extent)  # a rank past the extent holds only padding
            hi = min(lo + size, extent)
            if part.block * part.world < extent:
                raise LayoutError(
                    f"{where}: block {part.block} x {part.world} ranks does not cover extent "
                    f"{extent} of dim {d}"
                )
        elif part.sizes is not None:
            if sum(part.sizes) != extent:
                raise LayoutError(
                    f"{where}: shard sizes {list(part.sizes)} add up to {sum(part.sizes)}, "
                    f"dim {d} has {extent}"
                )
            lo = sum(part.sizes[: part.rank])
            size = part.sizes[part.rank]
            hi = lo + size
        else:
            if extent % part.world:
                raise LayoutError(
                    f"{where}: dim {d} of extent {extent} does not split evenly over "
                    f"{part.world} ranks; pass sizes= (uneven) or block= (padded)"
                )
            size = extent // part.world
            lo, hi = part.rank * size, (part.rank + 1) * size
        shape = (*inner.shape[:d], size, *inner.shape[d + 1 :])
        boxes = []
        for b in inner.boxes:
            k = len(b.dst_offset) - len(b.offset)  # leading local-only dims
            a0, a1 = max(lo, b.dst_offset[d]), min(hi, b.dst_offset[d] + _dst_len(b, d))
            if a1 <= a0:
                continue
            dst = (*b.dst_offset[:d], a0 - lo, *b.dst_offset[d + 1 :])
            if d < k:  # a stacking dim: the whole box moves
                boxes.append(Box(b.source, b.offset, b.lengths, dst))
                continue
            sd = d - k
            off = (*b.offset[:sd], b.offset[sd] + a0 - b.dst_offset[d], *b.offset[sd + 1 :])
            ln = (*b.lengths[:sd], a1 - a0, *b.lengths[sd + 1 :])
            boxes.append(Box(b.source, off, ln, dst))
        return _Bound(shape, tuple(boxes))
    if isinstance(part, Fuse):
        bound = [_bind(p, shapes, where) for p in part.parts]
        ndim = len(bound[0].shape)
        d = _dim(part.dim, ndim, where)
        for other in bound[1:]:
            if len(other.shape) != ndim or any(
                x != y
                for i, (x, y) in enumerate(zip(other.shape, bound[0].shape, strict=True))
                if i != d
            ):
                raise LayoutError(
                    f"{where}: cannot fuse shapes {[list(x.shape) for x in bound]} along dim {d}"
                )
        boxes, at = [], 0
        for piece in bound:
            for box in piece.boxes:
                dst = (*box.dst_offset[:d], box.dst_offset[d] + at, *box.dst_offset[d + 1 :])
                boxes.append(Box(box.source, box.offset, box.lengths, dst))
            at += piece.shape[d]
        return _Bound((*bound[0].shape[:d], at, *bound[0].shape[d + 1 :]), tuple(boxes))
    if isinstance(part, Placed):
        return _bind_placed(part, shapes, where)
    bound = [_bind(p, shapes, where) for p in part.parts]
    if any(b.shape != bound[0].shape for b in bound):
        raise LayoutError(f"{where}: cannot stack shapes {[list(b.shape) for b in bound]}")
    boxes = [
        Box(box.source, box.offset, box.lengths, (i, *box.dst_offset))
        for i, b in enumerate(bound)
        for box in b.boxes
    ]
    return _Bound((len(bound), *bound[0].shape), tuple(boxes))


def _bind_placed(part: Placed, shapes: Mapping[str, Sequence[int]], where: str) -> _Bound:
    """Check explicit boxes against the global ``shapes`` and the local shape."""
    shape = tuple(int(n) for n in part.shape)
    regions: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for b in part.boxes:
        if b.source not in shapes:
            raise LayoutError(f"{where}: global tensor {b.source!r} is not in the manifest")
        src = tuple(int(n) for n in shapes[b.source])
        extra = len(shape) - len(src)
        if (
            len(b.offset) != len(src)
            or len(b.lengths) != len(src)
            or len(b.dst_offset) != len(shape)
            or extra < 0
        ):
            raise LayoutError(
                f"{where}: box of {b.source!r} {list(src)} has offset {list(b.offset)}, lengths "
                f"{list(b.lengths)} and local offset {list(b.dst_offset)} for local shape "
                f"{list(shape)}: dims do not match"
            )
        lengths = (1,) * extra + b.lengths
        if any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(b.offset, b.lengths, src, strict=True)
        ) or any(o < 0 or o + n > s for o, n, s in zip(b.dst_offset, lengths, shape, strict=True)):
            raise LayoutError(
                f"{where}: box of {b.source!r} at {list(b.offset)} + {list(b.lengths)} placed at "
                f"{list(b.dst_offset)} does not fit the global shape {list(src)} and the local "
                f"shape {list(shape)}"
            )
        regions.append((b.dst_offset, lengths))
    for off, ln in part.padding:
        if len(off) != len(shape) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(off, ln, shape, strict=True)
        ):
            raise LayoutError(
                f"{where}: padding at {list(off)} + {list(ln)} is outside the shape {list(shape)}"
            )
        regions.append((tuple(off), tuple(ln)))
    if covered(shape, regions) != sum(math.prod(n) for _, n in regions):
        raise LayoutError(f"{where}: boxes or padding regions overlap")
    return _Bound(shape, part.boxes)


def _dst_len(b: Box, d: int) -> int:
    k = len(b.dst_offset) - len(b.offset)
    return 1 if d < k else b.lengths[d - k]


def _dim(dim: int, ndim: int, where: str) -> int:
    if not -ndim <= dim < ndim:
        raise LayoutError(f"{where}: dim {dim} is out of range for {ndim} dims")
    return dim % ndim


class Layout:
    """Local tensor name -> expression over global tensors (a string: a replicated rename).

    Immutable; bind it to a manifest's shapes with :meth:`bind`.
    """

    def __init__(self, parts: Mapping[str, Part | str]) -> None:
        self.parts: dict[str, Part] = {name: _part(p) for name, p in parts.items()}

    @classmethod
    def identity(cls, names: Iterable[str]) -> Layout:
        """Every global tensor held whole, under its own name."""
        return cls({n: n for n in names})

    def __add__(self, other: Layout) -> Layout:
        clash = set(self.parts) & set(other.parts)
        if clash:
            raise LayoutError(f"layouts both declare local tensors {sorted(clash)[:5]}")
        return Layout({**self.parts, **other.parts})

    def sources(self) -> dict[str, tuple[str, ...]]:
        """Local name -> the global tensors its expression names, in order (no shapes needed)."""
        return {n: tuple(dict.fromkeys(_sources(p))) for n, p in self.parts.items()}

    def prefixed(self, prefix: str) -> Layout:
        """The same layout with every local name prefixed (e.g. to hold several ranks)."""
        return Layout({prefix + n: p for n, p in self.parts.items()})

    def bind(
        self,
        shapes: Mapping[str, Sequence[int]],
        tensors: Tensors | None = None,
        dtypes: Mapping[str, str] | None = None,
    ) -> BoundLayout:
        """Resolve against global ``shapes`` (manifest name -> shape); with ``tensors``, check
        every local tensor exists, is contiguous and has the bound shape (and, with ``dtypes``,
        the global tensor's dtype). Raises :class:`LayoutError` listing what does not fit."""
        placements: dict[str, list[Placement]] = {}
        local_shapes: dict[str, tuple[int, ...]] = {}
        local_sources: dict[str, tuple[str, ...]] = {}
        problems: list[str] = []
        for local, part in self.parts.items():
            try:
                bound = _bind(part, shapes, f"local tensor {local!r}")
            except LayoutError as exc:
                problems.append(str(exc))
                continue
            local_shapes[local] = bound.shape
            local_sources[local] = tuple(dict.fromkeys(_sources(part)))
            for box in bound.boxes:
                src = tuple(int(n) for n in shapes[box.source])
                placements.setdefault(box.source, []).append(
                    Placement(local, bound.shape, box, src)
                )
            kinds = {dtypes[n] for n in local_sources[local] if n in dtypes} if dtypes else set()
            if len(kinds) > 1:
                problems.append(f"local tensor {local!r}: fuses global dtypes {sorted(kinds)}")
        if problems:
            raise LayoutError(
                f"layout does not fit ({len(problems)} problems): " + "; ".join(problems[:6])
            )
        out = BoundLayout(placements, local_shapes, local_sources)
        if tensors is not None:
            out.check(tensors, dtypes)
        return out


def _sources(part: Part) -> list[str]:
    """Global names an expression refers to, in order (also those it holds no element of)."""
    if isinstance(part, Replicate):
        return [part.name]
    if isinstance(part, Shard):
        return _sources(part.part)
    if isinstance(part, Placed):
        return [b.source for b in part.boxes]
    return [n for p in part.parts for n in _sources(p)]


@dataclass(frozen=True)
class BoundLayout:
    """A layout resolved against global shapes: global name -> placements, in declaration
    order, and for each local tensor the global tensors its expression names (``local_sources``)."""

    placements: Mapping[str, list[Placement]]
    local_shapes: Mapping[str, tuple[int, ...]]
    local_sources: Mapping[str, tuple[str, ...]]

    def check(self, tensors: Tensors, dtypes: Mapping[str, str] | None = None) -> None:
        """Raise :class:`LayoutError` unless every local tensor exists, is contiguous, has the
        bound shape and (with ``dtypes``: global name -> dtype name) its sources' dtype."""
        from deltastore.tensors.dtypes import dtype_name  # (torch or host) tensors to check

        problems: list[str] = []
        for local, shape in self.local_shapes.items():
            t = tensors.get(local)
            if t is None:
                problems.append(f"local tensor {local!r}: missing (expected shape {list(shape)})")
            elif tuple(t.shape) != shape:
                problems.append(
                    f"local tensor {local!r}: shape {list(t.shape)}, the layout gives {list(shape)}"
                )
            elif not t.is_contiguous():
                problems.append(f"local tensor {local!r}: not contiguous")
            elif dtypes is not None:
                want = {dtypes[n] for n in self.local_sources[local] if n in dtypes}
                if want and want != {dtype_name(t.dtype)}:
                    problems.append(
                        f"local tensor {local!r}: dtype {dtype_name(t.dtype)}, the global "
                        f"tensors it holds are {sorted(want)}"
                    )
        if problems:
            raise LayoutError(
                f"local tensors do not fit the layout ({len(problems)} problems): "
                + "; ".join(problems[:6])
            )

    def boxes(self) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
        """Global name -> ``(offset, lengths)`` of every box held here, in global dims."""
        return {
            name: [(p.box.offset, p.box.lengths) for p in ps]
            for name, ps in self.placements.items()
        }


__all__ = [
    "BoundLayout",
    "Box",
    "Fuse",
    "Layout",
    "Part",
    "Placed",
    "Placement",
    "Replicate",
    "Shard",
    "Stack",
    "covered",
    "flat_span",
    "fuse",
    "inside",
    "is_contiguous_box",
    "replicate",
    "shard",
    "stack",
]
