"""Layouts traced from the engine's own weight loading: which element of which checkpoint
tensor lands where in which parameter, found by running the model's ``load_weights``.

vLLM's ``load_weights`` (its stacked-parameter mappings, the parameters' ``weight_loader``s)
does the tensor-parallel slicing, the q/k/v and gate/up fusing, the expert stacking and the
vocabulary padding. :func:`trace_layout` feeds it one probe tensor per checkpoint tensor (names
and global shapes from the store's manifest) whose values are the global flat element index,
while the model's parameters are swapped for meta tensors of their checkpoint-format shape
(the ``weight_loader`` and other attributes kept; nothing is written into the live weights)
and a :class:`~torch.utils._python_dispatch.TorchDispatchMode` intercepts every write into
them. Each intercepted ``copy_`` is compressed into one box (:class:`~deltastore.layout.boxes.
Box`): when its source is a view of the probe the view's offset and strides give the box
directly; otherwise (the loader computed the source: a cast, a ``cat``, arithmetic) the trace
runs again for that tensor with passes of index bits the source dtype holds exactly and their
complements, decodes every element and checks, vectorized and in chunks, that the copy is an
axis-aligned box with values unchanged. Anything else (a transpose, a value transform, an
in-place op other than a constant fill, a write into a live tensor) is a
:class:`~deltastore.errors.LayoutError` naming the parameter, the checkpoint tensor and why.

The result is cached as JSON per (architecture, config, TP rank and size, vLLM version,
manifest shapes) under ``$XDG_CACHE_HOME/deltastore/vllm-layouts/`` (see
:mod:`deltastore.engines.vllm_trace_cache`). Pure torch: imports vLLM only to read the
checkpoint-format metadata it records at model construction (absent: the live shapes).

Not thread-safe: a trace swaps the model's parameters for the length of the call (serving
must not run the model meanwhile; the worker traces at attach, before it serves again). The
parameters are restored in a ``finally``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deltastore.engines.vllm_layout import EngineLayout
from deltastore.errors import LayoutError
from deltastore.layout.boxes import Box, Layout, Placed, covered

Region = tuple[tuple[int, ...], tuple[int, ...]]
#: Elements checked per vectorized step when a copy's values are decoded (bounds memory).
CHUNK = 1 << 22
_FILLS = ("fill_", "zero_")


@dataclass(frozen=True)
class TraceResult:
    """A traced layout: ``layout`` maps every written parameter to boxes of the checkpoint
    tensors; ``derived``: parameters no checkpoint tensor writes (the model computes them,
    e.g. after loading); ``padding``: per parameter, local regions only filled with a
    constant (padded vocabulary rows); ``cached``: read from the cache, not traced;
    ``seconds``: wall time of the trace (or of the cache read)."""

    layout: EngineLayout
    derived: tuple[str, ...]
    padding: Mapping[str, tuple[Region, ...]]
    cached: bool = False
    seconds: float = 0.0


class _Refused(Exception):
    """A write the trace cannot describe (becomes a LayoutError naming the checkpoint tensor)."""


@dataclass
class _Copy:
    param: str
    offset: int  # flat element offset of the destination view in the parameter
    strides: tuple[int, ...]
    shape: tuple[int, ...]
    source: torch.Tensor


@dataclass
class _Swap:
    """The model's parameters swapped for meta tensors (name -> meta), and the live ones."""

    meta: dict[str, torch.Tensor] = field(default_factory=dict)
    saved: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)

    def restore(self) -> None:
        for live_dict, saved in self.saved:
            live_dict.clear()
            live_dict.update(saved)


def _storage_id(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def checkpoint_meta(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` (``named_parameters()`` names: a shared parameter once) as
    a contiguous meta tensor of its checkpoint-format shape and dtype, of the parameter's class
    and with its attributes (``weight_loader``, ``output_dim``...), as vLLM recorded them when
    it built the model (it may repack the weights after loading), else as they are now."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    except ImportError:  # not under vLLM (tests with plain torch modules)
        LAYERWISE_INFO, restore_layer_refs = None, None
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        info = LAYERWISE_INFO.get(mod) if LAYERWISE_INFO is not None else None
        recorded = info.restore_metadata[0] if info is not None else {}
        for pname, p in mod._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            src = recorded.get(pname)
            like = src if src is not None else p
            m = torch.empty(tuple(like.shape), dtype=like.dtype, device="meta")
            m.__class__ = like.__class__
            m.__dict__ = like.__dict__.copy()
            if src is not None and restore_layer_refs is not None:
                m = restore_layer_refs(m, mod)  # binds the loader methods to the live module
            out[f"{mod_name}.{pname}" if mod_name else pname] = m
    return out


def _swap(model: torch.nn.Module) -> _Swap:
    metas = checkpoint_meta(model)
    by_id = {id(p): metas[n] for n, p in model.named_parameters() if n in metas}
    sw = _Swap(meta=metas)
    try:
        for mod in model.modules():
            if not mod._parameters:
                continue
            sw.saved.append((mod._parameters, dict(mod._parameters)))
            for pname, p in list(mod._parameters.items()):
                if p is not None and id(p) in by_id:
                    mod._parameters[pname] = by_id[id(p)]  # type: ignore[assignment]
    except BaseException:
        sw.restore()
        raise
    return sw


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Intercepts writes into the swapped parameters (recorded, not run) and refuses writes
    into any live tensor of the model."""

    def __init__(self, swapped: Mapping[int, str], live: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.swapped, self.live = swapped, live
        self.copies: list[_Copy] = []
        self.fills: list[tuple[str, int, tuple[int, ...], tuple[int, ...], str]] = []

    def _target(self, t: Any) -> str | None:
        if isinstance(t, torch.Tensor) and t.is_meta:
            return self.swapped.get(_storage_id(t))
        return None

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if (
            func is torch.ops.aten._to_copy.default
            and str(kwargs.get("device")) == "meta"
            and isinstance(args[0], torch.Tensor)
            and not args[0].is_meta
        ):  # a loader moving the checkpoint tensor to the parameter's device: keep its values
            kwargs = {k: v for k, v in kwargs.items() if k != "device"}
        if func is torch.ops.aten.copy_.default:
            name = self._target(args[0])
            if name is not None:
                dst, src = args[0], args[1]
                if not isinstance(src, torch.Tensor) or src.is_meta:
                    raise _Refused(
                        f"parameter {name}: the loader copies values computed from the "
                        "parameter itself (a value transform after loading)"
                    )
                if tuple(src.shape) != tuple(dst.shape):
                    src = src.expand(dst.shape)  # copy_ broadcasts
                self.copies.append(
                    _Copy(name, dst.storage_offset(), dst.stride(), tuple(dst.shape), src)
                )
                return dst
        written = [
            kwargs.get(a.name, args[i] if i < len(args) else None)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        for t in written:
            name = self._target(t)
            op = func._schema.name.split("::")[-1]
            if name is not None and isinstance(t, torch.Tensor):
                if op in _FILLS:
                    self.fills.append(
                        (name, int(t.storage_offset()), t.stride(), tuple(t.shape), str(op))
                    )
                    return t
                raise _Refused(f"parameter {name}: written in place by {op}, not by a copy")
            if (
                isinstance(t, torch.Tensor)
                and not t.is_meta
                and t.numel()
                and t.untyped_storage().data_ptr() in self.live
            ):
                raise _Refused(
                    f"{op} writes into a live tensor of the model that is not a parameter "
                    "(a buffer); deltastore does not sync buffers"
                )
        return func(*args, **kwargs)


def _exact_bits(dtype: torch.dtype) -> int:
    """How many low bits of an integer the dtype holds exactly."""
    if dtype.is_floating_point:
        return min(round(-math.log2(torch.finfo(dtype).eps)) + 1, 52)
    if dtype == torch.bool:
        return 1
    return min(torch.iinfo(dtype).bits - (1 if dtype.is_signed else 0), 62)


def _passes(numel: int, bits: int) -> int:
    return max(1, math.ceil(max(numel - 1, 1).bit_length() / bits))  # passes of ``bits`` each


def _probe(shape: tuple[int, ...], shift: int, bits: int, complement: bool) -> torch.Tensor:
    """Bits ``[shift, shift + bits)`` of every element's global flat index (or their
    complement), as float64 (exact for bits <= 52)."""
    if not shift and bits >= 52 and not complement:  # the index itself: exact in float64
        return torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    idx = torch.arange(math.prod(shape), dtype=torch.int64)
    if shift or bits < 62:
        idx = (idx >> shift) & ((1 << bits) - 1)
    if complement:
        idx = ((1 << bits) - 1) - idx
    return idx.to(torch.float64).reshape(shape)


def _unravel(flat: int, shape: Sequence[int]) -> list[int]:
    return [int(c) for c in np.unravel_index(flat, [max(int(n), 1) for n in shape])]


def _c_strides(shape: Sequence[int]) -> list[int]:  # C-order strides, in elements
    return list(torch.empty([int(n) for n in shape], device="meta").stride())


def _box(
    source: str,
    gshape: tuple[int, ...],
    g0: int,
    gstrides: Sequence[int],
    lshape: tuple[int, ...],
    l0: int,
    lstrides: Sequence[int],
    sizes: Sequence[int],
) -> Box:
    """The box of a copy: view dims of ``sizes`` whose elements sit at flat ``l0 + sum(c *
    lstrides)`` of the local tensor and hold global flat ``g0 + sum(c * gstrides)``. Raises
    :class:`_Refused` unless that is one axis-aligned box (local dim ``extra + k`` <-> global
    dim ``k``)."""
    extra = len(lshape) - len(gshape)
    if extra < 0:
        raise _Refused(f"the parameter has fewer dims ({len(lshape)}) than {list(gshape)}")
    lc, gc = _unravel(l0, lshape), _unravel(g0, gshape)
    ls_of, gs_of = _c_strides(lshape), _c_strides(gshape)
    used: dict[int, int] = {}  # local dim -> length
    for n, ls, gs in zip(sizes, lstrides, gstrides, strict=True):
        while n > 1:
            p = next((d for d in range(len(lshape)) if ls_of[d] == ls and lshape[d] > 1), None)
            q = next((d for d in range(len(gshape)) if gs_of[d] == gs and gshape[d] > 1), None)
            if p is None or q is None or p - extra != q or p in used:
                raise _Refused(
                    "the copy is not an axis-aligned box of the checkpoint tensor (a transpose "
                    f"or reshape: local stride {ls}, global stride {gs})"
                )
            room = min(lshape[p] - lc[p], gshape[q] - gc[q])
            if n <= room:
                used[p], n = n, 1
                continue
            inner = min(lshape[p], gshape[q])
            if lc[p] or gc[q] or n % inner or inner != lshape[p] or inner != gshape[q]:
                raise _Refused("the copy wraps around a dimension (not one box)")
            used[p], n, ls, gs = inner, n // inner, ls * inner, gs * inner
    if any(p < extra for p in used):
        raise _Refused("the copy spans a leading dim the checkpoint tensor does not have")
    lengths = tuple(used.get(extra + k, 1) for k in range(len(gshape)))
    return Box(source, tuple(gc), lengths, tuple(lc))


def _decode(
    sources: Sequence[torch.Tensor], shift_bits: int, complement: bool
) -> Callable[[int, int], torch.Tensor]:
    """Flat chunk ``[a, b)`` of the global indices the pass sources carry (int64)."""
    flats = [s.reshape(-1) for s in sources]
    mask = (1 << shift_bits) - 1

    def chunk(a: int, b: int) -> torch.Tensor:
        out = torch.zeros(b - a, dtype=torch.int64)
        for k, f in enumerate(flats):
            v = f[a:b].to(torch.float64)
            iv = v.round()
            if not bool(torch.equal(iv, v)) or bool(((iv < 0) | (iv > mask)).any()):
                raise _Refused("the loader transforms the values (not a plain copy)")
            iv64 = iv.to(torch.int64)
            out |= (mask - iv64 if complement else iv64) << (k * shift_bits)
        return out

    return chunk


def _check_affine(
    sizes: tuple[int, ...],
    plain: Callable[[int, int], torch.Tensor],
    comp: Callable[[int, int], torch.Tensor],
    numel: int,
) -> tuple[int, list[int]]:
    """The affine map (``g0``, strides per view dim) the decoded values follow, checked on
    every element (chunks of :data:`CHUNK`); :class:`_Refused` if they do not."""
    total = math.prod(sizes)
    cstr = _c_strides(sizes)
    g0 = int(plain(0, 1)[0])
    strides = [
        int(plain(s, s + 1)[0]) - g0 if n > 1 else 0 for n, s in zip(sizes, cstr, strict=True)
    ]
    for a in range(0, total, CHUNK):
        b = min(total, a + CHUNK)
        got, other = plain(a, b), comp(a, b)
        if not torch.equal(got, other):
            raise _Refused("the loader transforms the values (the complement pass disagrees)")
        flat = torch.arange(a, b, dtype=torch.int64)
        want = torch.full((b - a,), g0, dtype=torch.int64)
        for n, cs, gs in zip(sizes, cstr, strides, strict=True):
            if n > 1:
                want += ((flat // cs) % n) * gs
        if not torch.equal(got, want) or int(got.min()) < 0 or int(got.max()) >= numel:
            raise _Refused(
                "the copy is not an axis-aligned box of the checkpoint tensor (elements "
                "permuted or transformed)"
            )
    return g0, strides


@dataclass
class _State:
    boxes: dict[str, list[Box]] = field(default_factory=dict)
    fills: dict[str, list[Region]] = field(default_factory=dict)


def trace_layout(
    model: torch.nn.Module,
    global_shapes: Mapping[str, Sequence[int]],
    *,
    load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None,
) -> TraceResult:
    """Trace where each element of the checkpoint tensors ``global_shapes`` (manifest name ->
    shape, in elements) lands in ``model``'s parameters, by running ``load_weights`` (default:
    ``model.load_weights``) once per tensor on probe tensors, the parameters swapped for
    meta tensors meanwhile (see the module docstring). The model is unchanged afterwards.

    Parameters are named as ``model.named_parameters()`` names them (a shared parameter once).
    Raises :class:`LayoutError` naming the parameter and checkpoint tensor that cannot be
    traced, a parameter written twice or partly, or a checkpoint tensor the loader rejects.
    """
    t0 = time.perf_counter()
    loader = load_weights if load_weights is not None else getattr(model, "load_weights", None)
    if loader is None:
        raise LayoutError(
            f"{type(model).__name__} has no load_weights: its layout cannot be traced; pass "
            "layout='package.module:function'"
        )
    live: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if not t.is_meta and t.numel():
            live.add(t.untyped_storage().data_ptr())
    sw = _swap(model)
    state = _State()
    try:
        swapped = {_storage_id(m): n for n, m in sw.meta.items()}
        for name, shape in global_shapes.items():
            _trace_one(loader, name, tuple(int(n) for n in shape), sw, swapped, live, state)
    finally:
        sw.restore()
    return _result(sw.meta, state, global_shapes, time.perf_counter() - t0)


def _run(
    loader: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
    name: str,
    probe: torch.Tensor,
    swapped: Mapping[int, str],
    live: set[int],
    metas: Mapping[str, torch.Tensor],
) -> _Recorder:
    rec = _Recorder(swapped, live)
    try:
        with torch.no_grad(), rec:
            loader([(name, probe)])
    except _Refused as exc:
        raise LayoutError(f"checkpoint tensor {name}: cannot be traced: {exc}") from None
    except Exception as exc:
        raise LayoutError(
            f"checkpoint tensor {name}: the model's load_weights failed on it while tracing "
            f"({type(exc).__name__}: {exc}); pass layout='package.module:function' or "
            "layout='preset'"
        ) from exc
    for sid, pname in swapped.items():  # a loader that assigns param.data is not a copy
        m = metas[pname]
        if not m.is_meta or _storage_id(m) != sid:
            raise LayoutError(
                f"parameter {pname}, checkpoint tensor {name}: cannot be traced: the loader "
                "replaced the parameter's data (param.data = ...) instead of copying into it"
            )
    return rec


def _trace_one(
    loader: Callable[[Iterable[tuple[str, torch.Tensor]]], Any],
    name: str,
    shape: tuple[int, ...],
    sw: _Swap,
    swapped: Mapping[int, str],
    live: set[int],
    state: _State,
) -> None:
    numel = math.prod(shape)
    # The first run reads the index from the geometry of each copy's source (a view of the
    # probe: its offset and strides), not from values: the probe is left uninitialized (no
    # page touched, no time spent). Sources the loader computed are read from the values of
    # the runs below.
    probe = torch.empty(shape, dtype=torch.float64)
    rec = _run(loader, name, probe, swapped, live, sw.meta)
    pid = _storage_id(probe)
    computed = [
        c for c in rec.copies if _storage_id(c.source) != pid or c.source.dtype != probe.dtype
    ]
    decoded: dict[int, tuple[int, list[int]]] = {}
    if computed:
        bits = min(_exact_bits(c.source.dtype) for c in computed)
        runs = []
        for complement in (False, True):
            for k in range(_passes(numel, bits)):
                runs.append(
                    _run(
                        loader,
                        name,
                        _probe(shape, k * bits, bits, complement),
                        swapped,
                        live,
                        sw.meta,
                    )
                )
        n = _passes(numel, bits)
        for i, c in enumerate(rec.copies):
            if _storage_id(c.source) == pid and c.source.dtype == probe.dtype:
                continue
            for r in runs:
                if len(r.copies) != len(rec.copies) or (
                    r.copies[i].param,
                    r.copies[i].offset,
                    r.copies[i].shape,
                ) != (c.param, c.offset, c.shape):
                    raise LayoutError(
                        f"checkpoint tensor {name}: cannot be traced: the loader writes "
                        "differently from one probe to the next"
                    )
            plain = _decode([r.copies[i].source for r in runs[:n]], bits, False)
            comp = _decode([r.copies[i].source for r in runs[n:]], bits, True)
            try:
                decoded[i] = _check_affine(c.shape, plain, comp, numel)
            except _Refused as exc:
                raise LayoutError(
                    f"parameter {c.param}, checkpoint tensor {name}: cannot be traced: {exc}"
                ) from None
    for i, c in enumerate(rec.copies):
        if not math.prod(c.shape):
            continue
        if i in decoded:
            g0, gstr = decoded[i]
        else:
            g0, gstr = int(c.source.storage_offset()), [int(x) for x in c.source.stride()]
        lshape = tuple(sw.meta[c.param].shape)
        try:
            box = _box(name, shape, g0, gstr, lshape, c.offset, c.strides, c.shape)
        except _Refused as exc:
            raise LayoutError(
                f"parameter {c.param}, checkpoint tensor {name}: cannot be traced: {exc}"
            ) from None
        state.boxes.setdefault(c.param, []).append(box)
    for param, offset, strides, fshape, op in rec.fills:
        if not math.prod(fshape):
            continue
        lshape = tuple(sw.meta[param].shape)
        try:
            b = _box("", lshape, offset, strides, lshape, offset, strides, fshape)
        except _Refused as exc:
            raise LayoutError(
                f"parameter {param}: {op} of a region that is not a box: {exc}"
            ) from None
        state.fills.setdefault(param, []).append((b.dst_offset, b.lengths))


def _result(
    metas: Mapping[str, torch.Tensor],
    state: _State,
    global_shapes: Mapping[str, Sequence[int]],
    seconds: float,
) -> TraceResult:
    parts: dict[str, Placed] = {}
    padding: dict[str, tuple[Region, ...]] = {}
    derived: list[str] = []
    problems: list[str] = []
    for pname, m in metas.items():
        lshape = tuple(m.shape)
        boxes = merge_boxes(state.boxes.get(pname, []), lshape)
        if not boxes:
            derived.append(pname)
            continue
        extra = len(lshape)
        regions = [(b.dst_offset, (1,) * (extra - len(b.lengths)) + b.lengths) for b in boxes]
        total = sum(math.prod(r[1]) for r in regions)
        have = covered(lshape, regions)
        if have != total:
            problems.append(f"parameter {pname}: {total - have} elements written twice")
            continue
        fills = state.fills.get(pname, [])
        with_fills = covered(lshape, [*regions, *fills])
        if fills and with_fills != have + covered(lshape, fills):
            problems.append(
                f"parameter {pname}: a constant fill overwrites elements a checkpoint tensor writes"
            )
            continue
        if with_fills != math.prod(lshape):
            problems.append(
                f"parameter {pname}: {math.prod(lshape) - with_fills} of {math.prod(lshape)} "
                "elements are written by no checkpoint tensor"
            )
            continue
        pad = tuple((tuple(o), tuple(n)) for o, n in fills)
        parts[pname] = Placed(lshape, tuple(boxes), pad)
        if pad:
            padding[pname] = pad
    if problems:
        raise LayoutError(
            f"the traced layout does not fit ({len(problems)} problems): " + "; ".join(problems[:6])
        )
    layout = Layout(parts)
    layout.bind(global_shapes)  # every box checked against the manifest's shapes
    shapes = {n: p.shape for n, p in parts.items()}
    return TraceResult(
        EngineLayout(layout, shapes, layout.sources(), tuple(derived)),
        tuple(derived),
        padding,
        False,
        seconds,
    )


def merge_boxes(boxes: Sequence[Box], lshape: tuple[int, ...]) -> list[Box]:
    """``boxes`` with neighbours of one source merged (adjacent along one dim both in the
    source and in the local tensor, equal elsewhere), sorted by local offset: a canonical
    form to compare layouts by."""
    out = sorted(boxes, key=lambda b: (b.dst_offset, b.source, b.offset))
    while True:  # neighbours are next to each other in this order: linear passes
        nxt: list[Box] = []
        for box in out:
            joined = _join(nxt[-1], box, len(lshape)) if nxt else None
            if joined is None:
                nxt.append(box)
            else:
                nxt[-1] = joined
        if len(nxt) == len(out):
            return nxt
        out = nxt


def _join(a: Box, b: Box, ndim: int) -> Box | None:
    """``a`` followed by ``b`` along one source dim as one box, if they are neighbours."""
    if a.source != b.source:
        return None
    extra = ndim - len(a.offset)
    for k in range(len(a.offset)):
        d = extra + k
        if (
            b.offset[k] == a.offset[k] + a.lengths[k]
            and b.dst_offset[d] == a.dst_offset[d] + a.lengths[k]
            and all(
                a.offset[i] == b.offset[i] and a.lengths[i] == b.lengths[i]
                for i in range(len(a.offset))
                if i != k
            )
            and all(a.dst_offset[i] == b.dst_offset[i] for i in range(ndim) if i != d)
        ):
            lengths = (*a.lengths[:k], a.lengths[k] + b.lengths[k], *a.lengths[k + 1 :])
            return Box(a.source, a.offset, lengths, a.dst_offset)
    return None
