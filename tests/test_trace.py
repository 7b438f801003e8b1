"""Layouts traced from a model's own weight loading (deltastore.engines.vllm_trace), on plain
torch modules whose loaders work the way vLLM's do: TP narrowing, fused q/k/v with shard ids,
stacked experts, a padded vocabulary; and loaders that must be refused."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from deltastore.engines.vllm_trace import TraceResult, merge_boxes, trace_layout
from deltastore.engines.vllm_trace_cache import load_cached, save_cached
from deltastore.errors import LayoutError
from deltastore.layout.boxes import Box, Layout, Placed, fuse, shard, stack

H, INTER, E, V, PAD = 8, 6, 3, 10, 16  # hidden, intermediate, experts, vocab, padded vocab


def _param(shape: tuple[int, ...], loader: Callable[..., None], **attrs: Any) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.randn(shape), requires_grad=False)
    p.weight_loader = loader  # type: ignore[attr-defined]
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


class Tiny(torch.nn.Module):
    """A model of vLLM-style parameters at TP rank ``rank`` of ``tp``: a padded vocab-parallel
    embedding, fused q/k/v (column-parallel), a row-parallel o_proj, stacked experts."""

    def __init__(self, rank: int = 0, tp: int = 1, loader_of: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.rank, self.tp = rank, tp
        q, kv = 8 // tp, 4 // tp
        lo = loader_of or {}
        self.embed = torch.nn.Module()
        self.embed.weight = _param((PAD // tp, H), lo.get("embed", self._vocab))
        self.qkv = torch.nn.Module()
        self.qkv.weight = _param((q + 2 * kv, H), lo.get("qkv", self._qkv), output_dim=0)
        self.o = torch.nn.Module()
        self.o.weight = _param((H, 8 // tp), lo.get("o", self._row))
        self.norm = torch.nn.Module()
        self.norm.weight = _param((H,), lo.get("norm", self._plain))
        self.experts = torch.nn.Module()
        self.experts.w13 = _param((E, 2 * INTER // tp, H), self._w13)
        self.rotary = torch.nn.Module()
        self.rotary.register_buffer("cache", torch.randn(4))
        self.derived = torch.nn.Parameter(torch.zeros(3), requires_grad=False)  # no source

    # --- loaders in vLLM's style ------------------------------------------------------
    def _plain(self, param: torch.Tensor, w: torch.Tensor) -> None:
        param.data.copy_(w)

    def _vocab(self, param: torch.Tensor, w: torch.Tensor) -> None:
        per = PAD // self.tp
        start = self.rank * per
        size = max(0, min(V, start + per) - start)
        w = w.narrow(0, start, size)
        param[: w.shape[0]].data.copy_(w)
        param[w.shape[0] :].data.fill_(0)

    def _qkv(self, param: torch.Tensor, w: torch.Tensor, shard_id: str) -> None:
        q, kv = 8 // self.tp, 4 // self.tp
        off, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        w = w.narrow(0, self.rank * size, size)
        param.data.narrow(0, off, size).copy_(w)

    def _row(self, param: torch.Tensor, w: torch.Tensor) -> None:
        size = param.shape[1]
        param.data.copy_(w.narrow(1, self.rank * size, size))

    def _w13(self, param: torch.Tensor, w: torch.Tensor, expert: int, shard_id: str) -> None:
        size = INTER // self.tp
        off = 0 if shard_id == "w1" else size
        param.data[expert].narrow(0, off, size).copy_(w.narrow(0, self.rank * size, size))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        stacked = [("qkv", "q_proj", "q"), ("qkv", "k_proj", "k"), ("qkv", "v_proj", "v")]
        params = dict(self.named_parameters())
        done = set()
        for name, w in weights:
            for target, part, sid in stacked:
                if part in name:
                    p = params[f"{target}.weight"]
                    p.weight_loader(p, w, sid)  # type: ignore[attr-defined]
                    break
            else:
                if name.startswith("experts."):
                    _, e, which = name.split(".")[:3]
                    p = params["experts.w13"]
                    p.weight_loader(p, w, int(e), which)  # type: ignore[attr-defined]
                else:
                    p = params[name]
                    p.weight_loader(p, w)  # type: ignore[attr-defined]
            done.add(name)
        return done


GLOBAL = {
    "embed.weight": (V, H),
    "q_proj.weight": (8, H),
    "k_proj.weight": (4, H),
    "v_proj.weight": (4, H),
    "o.weight": (H, 8),
    "norm.weight": (H,),
    **{f"experts.{e}.{w}.weight": (INTER, H) for e in range(E) for w in ("w1", "w3")},
}


def preset(rank: int, tp: int) -> Layout:
    """The same layout written by hand with the boxes module's expressions."""
    return Layout(
        {
            "embed.weight": shard("embed.weight", 0, rank, tp, block=PAD // tp),
            "qkv.weight": fuse([shard(f"{x}_proj.weight", 0, rank, tp) for x in "qkv"]),
            "o.weight": shard("o.weight", 1, rank, tp),
            "norm.weight": "norm.weight",
            "experts.w13": stack(
                fuse([shard(f"experts.{e}.{w}.weight", 0, rank, tp) for w in ("w1", "w3")])
                for e in range(E)
            ),
        }
    )


def placements(layout: Layout) -> dict[str, list[Box]]:
    bound = layout.bind(GLOBAL)
    out: dict[str, list[Box]] = {}
    for ps in bound.placements.values():
        for p in ps:
            out.setdefault(p.local, []).append(p.box)
    return {n: merge_boxes(b, bound.local_shapes[n]) for n, b in out.items()}


@pytest.mark.parametrize(("rank", "tp"), [(0, 1), (0, 2), (1, 2)])
def test_traced_layout_equals_the_hand_written_one(rank: int, tp: int) -> None:
    model = Tiny(rank, tp)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    got = trace_layout(model, GLOBAL)
    assert placements(got.layout.layout) == placements(preset(rank, tp))
    assert got.derived == ("derived",)
    assert got.layout.shapes["experts.w13"] == (E, 2 * INTER // tp, H)
    # the padded rows (TP 1: rows 10..15; TP 2 rank 1: rows 2..7) are marked as padding
    pad = {1: ((V, 0), (PAD - V, H)), 2: ((V - PAD // 2, 0), (PAD - V, H))}[tp]
    assert got.padding == ({} if (rank, tp) == (0, 2) else {"embed.weight": (pad,)})
    # nothing of the live model changed: same tensors, same values, same objects
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(not p.is_meta for p in model.parameters())


def test_a_loader_that_casts_is_decoded_by_passes_of_index_bits() -> None:
    def cast(param: torch.Tensor, w: torch.Tensor) -> None:  # bf16 holds 0..256 exactly
        param.data.copy_(w.to(torch.bfloat16).contiguous())

    def cat(param: torch.Tensor, w: torch.Tensor) -> None:  # computed, but values unchanged
        param.data.copy_(torch.cat([w[:, :4], w[:, 4:]], dim=1))

    def to_device(param: torch.Tensor, w: torch.Tensor, shard_id: str) -> None:
        Tiny._qkv(model, param, w.to(param.device), shard_id)  # the meta device while tracing

    model = Tiny(loader_of={"norm": cast, "o": cat, "qkv": to_device})
    got = trace_layout(model, GLOBAL)
    assert placements(got.layout.layout) == placements(preset(0, 1))


@pytest.mark.parametrize(
    ("loader", "why"),
    [
        (lambda p, w: p.data.copy_(w.t()), "not an axis-aligned box"),
        (lambda p, w: p.data.copy_(w.t().contiguous()), "not an axis-aligned box"),
        (lambda p, w: p.data.copy_(w + 1), "transforms the values"),
        (lambda p, w: p.data.copy_(w * 2), "transforms the values"),
        (lambda p, w: p.data.copy_(w.flip(0)), "not an axis-aligned box"),
    ],
)
def test_a_copy_that_is_not_a_box_of_plain_values_is_refused(loader: Any, why: str) -> None:
    model = Tiny(loader_of={"o": loader})
    with pytest.raises(
        LayoutError, match=rf"parameter o\.weight, checkpoint tensor o\.weight.*{why}"
    ):
        trace_layout(model, GLOBAL)
    assert all(not p.is_meta for p in model.parameters())  # restored after the failure


def test_in_place_transforms_and_writes_into_buffers_are_refused() -> None:
    def one_plus(param: torch.Tensor, w: torch.Tensor) -> None:  # a norm stored as 1 + w
        param.data.copy_(w)
        param.data.add_(1)

    def post(param: torch.Tensor, w: torch.Tensor) -> None:  # composed loader: copy_(fn(p))
        param.data.copy_(w)
        param.data.copy_(param.data * 2)

    def assign(param: torch.Tensor, w: torch.Tensor) -> None:  # not a copy: refused
        param.data = w.clone()

    def assign_meta(param: torch.Tensor, w: torch.Tensor) -> None:
        param.data = torch.empty_like(param.data)

    with pytest.raises(LayoutError, match=r"norm\.weight.*set_data"):
        trace_layout(Tiny(loader_of={"norm": assign}), GLOBAL)
    with pytest.raises(LayoutError, match=r"norm\.weight.*replaced the parameter's data"):
        trace_layout(Tiny(loader_of={"norm": assign_meta}), GLOBAL)
    with pytest.raises(LayoutError, match=r"norm\.weight.*add_"):
        trace_layout(Tiny(loader_of={"norm": one_plus}), GLOBAL)
    with pytest.raises(LayoutError, match=r"norm\.weight.*computed from the parameter"):
        trace_layout(Tiny(loader_of={"norm": post}), GLOBAL)
    model = Tiny()
    cache = model.rotary.cache.clone()

    def into_buffer(param: torch.Tensor, w: torch.Tensor) -> None:
        param.data.copy_(w)
        model.rotary.cache.copy_(w[:4])

    model.norm.weight.weight_loader = into_buffer  # type: ignore[attr-defined]
    with pytest.raises(LayoutError, match=r"norm\.weight.*live tensor"):
        trace_layout(model, GLOBAL)
    assert torch.equal(model.rotary.cache, cache)


def test_parameters_written_twice_or_partly_are_named() -> None:
    def half(param: torch.Tensor, w: torch.Tensor) -> None:
        param.data[:4].copy_(w[:4])

    with pytest.raises(LayoutError, match=r"norm\.weight: 4 of 8 elements are written by no"):
        trace_layout(Tiny(loader_of={"norm": half}), GLOBAL)
    twice = {**GLOBAL, "extra.weight": (H,)}

    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            m.load_weights([("norm.weight" if name == "extra.weight" else name, w)])

    m = Tiny()
    with pytest.raises(LayoutError, match=r"norm\.weight: 8 elements written twice"):
        trace_layout(m, twice, load_weights=load)


def test_a_failing_loader_names_the_checkpoint_tensor() -> None:
    with pytest.raises(LayoutError, match=r"checkpoint tensor nope\.weight: the model's load_"):
        trace_layout(Tiny(), {**GLOBAL, "nope.weight": (2,)})


def test_placed_boxes_are_checked_when_bound() -> None:
    ok = Placed((4, 8), (Box("o.weight", (0, 0), (4, 8), (0, 0)),))
    assert Layout({"x": ok}).bind(GLOBAL).local_shapes["x"] == (4, 8)
    outside = Placed((4, 8), (Box("o.weight", (6, 0), (4, 8), (0, 0)),))
    with pytest.raises(LayoutError, match="does not fit"):
        Layout({"x": outside}).bind(GLOBAL)
    overlap = Placed((8, 8), (*ok.boxes, Box("o.weight", (4, 0), (4, 8), (2, 0))))
    with pytest.raises(LayoutError, match="overlap"):
        Layout({"x": overlap}).bind(GLOBAL)


def test_the_cache_round_trips_and_refuses_a_model_that_changed(tmp_path: Path) -> None:
    got = trace_layout(Tiny(0, 2), GLOBAL)
    key = {"architecture": "Tiny", "tp_rank": 0, "tp_size": 2}
    path = save_cached(got, key, tmp_path)
    assert path.parent == tmp_path and json.loads(path.read_text())["key"] == key
    shapes = {**got.layout.shapes, "derived": (3,)}  # every parameter, traced and derived
    back = load_cached(key, shapes, GLOBAL, tmp_path)
    assert isinstance(back, TraceResult) and back.cached
    assert placements(back.layout.layout) == placements(got.layout.layout)
    assert back.derived == got.derived and back.padding == got.padding
    changed = {**shapes, "o.weight": (8, 8)}
    assert load_cached(key, changed, GLOBAL, tmp_path) is None  # another model: traced again
    assert load_cached(key, got.layout.shapes, GLOBAL, tmp_path) is None  # "derived" missing
    assert load_cached({**key, "tp_rank": 1}, shapes, GLOBAL, tmp_path) is None
    path.write_text("{not json")
    assert load_cached(key, shapes, GLOBAL, tmp_path) is None


class _HF:
    model_type = "tiny"
    architectures = ("TinyForCausalLM",)

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": self.model_type, "architectures": list(self.architectures)}


def _vllm_config() -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=_HF(), dtype=torch.float32, quantization=None)
    )


def test_attach_traces_against_the_stores_manifest_and_caches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deltastore import Publisher
    from deltastore.engines.vllm_layout import worker_layout

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    store = tmp_path / "store"
    Publisher(str(store)).publish({n: torch.randn(s) for n, s in GLOBAL.items()}, version=0)
    model = Tiny(1, 2)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    args = dict(url=str(store), version=0, storage_options=None, tp_rank=1, tp_size=2)
    el, derived = worker_layout(None, model, _vllm_config(), shapes, **args)  # type: ignore[arg-type]
    assert placements(el.layout) == placements(preset(1, 2))
    assert derived == el.derived == ("derived",)
    files = list((tmp_path / "cache" / "deltastore" / "vllm-layouts").glob("*.json"))
    assert len(files) == 1
    again, _ = worker_layout("trace", model, _vllm_config(), shapes, **args)  # type: ignore[arg-type]
    assert placements(again.layout) == placements(el.layout)
    # another rank of the same model has a file of its own
    other = {**args, "tp_rank": 0}
    worker_layout(None, Tiny(0, 2), _vllm_config(), shapes, **other)  # type: ignore[arg-type]
    assert len(list(files[0].parent.glob("*.json"))) == 2
    with pytest.raises(LayoutError, match=r"expected 'package\.module:function'"):
        worker_layout("nonsense", model, _vllm_config(), shapes, **args)  # type: ignore[arg-type]
