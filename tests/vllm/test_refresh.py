"""Which modules consume a synced parameter and how each is refreshed
(:mod:`deltastore.engines.vllm_refresh`), on small torch models built from vLLM's own attention
base class: no engine, a second or two (in ``make test-vllm``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

from deltastore.engines.vllm_refresh import MODEL, find_consumers, refresh, refresh_order
from deltastore.errors import LayoutError


class Packing:
    """A quant method that keeps a packed copy of the weight (as vLLM's CPU kernels do)."""

    def __init__(self) -> None:
        self.calls = 0

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls += 1
        layer.packed = layer.weight.detach().clone()


class Linear(nn.Module):
    def __init__(self, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = weight if weight is not None else nn.Parameter(torch.randn(4, 3))
        self.quant_method = Packing()


class MLA(nn.Module, AttentionLayerBase):
    """An MLA-like layer: ``W_UV`` (no checkpoint tensor) is computed from ``kv_b_proj``."""

    def __init__(self, kv_b_proj: nn.Module) -> None:
        super().__init__()
        self.kv_b_proj = kv_b_proj
        self.W_UV = nn.Parameter(torch.zeros(3, 4), requires_grad=False)

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        self.W_UV.data.copy_(self.kv_b_proj.weight.detach().T.to(act_dtype))

    def get_attn_backend(self) -> Any:  # pragma: no cover - not used
        raise NotImplementedError

    def get_kv_cache_spec(self, vllm_config: Any) -> Any:  # pragma: no cover - not used
        return None


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = Linear()
        self.head = Linear(self.embed.weight)  # tied: the same Parameter
        self.norm = nn.LayerNorm(3)  # no post-load processing: written in place, no consumer
        self.kv_b_proj = Linear()
        self.attn = MLA(self.kv_b_proj)
        base = torch.randn(8, 3)
        self.fused = Linear(nn.Parameter(base))
        self.half = Linear(nn.Parameter(base[:4]))  # a view of fused's storage


def synced(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if not n.endswith("W_UV")}


def test_every_consumer_of_a_parameter_is_found() -> None:
    model = Model()
    found = find_consumers(model, synced(model), derived=["attn.W_UV"], rebuild=True)
    kinds = {n: (c.kind, sorted(c.inputs)) for n, c in found.items()}
    assert kinds == {
        "embed": ("quant", ["embed.weight"]),
        "head": ("quant", ["embed.weight"]),  # a tied head: the embedding's weight
        "kv_b_proj": ("quant", ["kv_b_proj.weight"]),
        "attn": ("attention", ["kv_b_proj.weight"]),  # its sub-module's weight
        "fused": ("quant", ["fused.weight", "half.weight"]),  # views of one storage
        "half": ("quant", ["fused.weight", "half.weight"]),
    }
    # vLLM's order: quant methods first, attention-like layers after them
    assert refresh_order(found, found)[-1] == "attn"


def test_without_rebuild_only_derived_weights_are_refreshed() -> None:
    model = Model()
    found = find_consumers(model, synced(model), derived=["attn.W_UV"], rebuild=False)
    assert {n: c.kind for n, c in found.items()} == {"attn": "attention"}


def test_a_model_hook_consumes_everything_and_runs_last() -> None:
    model = Model()
    calls: list[str] = []
    model.process_weights_after_loading = lambda: calls.append("model")  # type: ignore[method-assign]
    found = find_consumers(model, synced(model), derived=["attn.W_UV"], rebuild=True)
    assert found[MODEL].kind == "model" and found[MODEL].inputs == set(synced(model))
    assert refresh_order(found, found)[-1] == MODEL
    refresh(MODEL, found[MODEL], {}, torch.float32)
    assert calls == ["model"]


def test_refresh_rebuilds_from_the_shadow_and_recomputes_derived_weights() -> None:
    model = Model()
    found = find_consumers(model, synced(model), derived=["attn.W_UV"], rebuild=True)
    shadow = torch.randn(4, 3)
    for name in refresh_order(["attn", "kv_b_proj"], found):
        shadows = {"weight": shadow} if name == "kv_b_proj" else {}
        refresh(name, found[name], shadows, torch.float32)
    assert torch.equal(model.kv_b_proj.weight, shadow)
    assert model.kv_b_proj.weight.data_ptr() != shadow.data_ptr()  # a copy for the kernel
    assert torch.equal(model.kv_b_proj.packed, shadow)
    assert torch.equal(model.attn.W_UV, shadow.T)
    # the tied head repacks the embedding's current weight
    model.embed.weight.data.add_(1.0)
    refresh("head", found["head"], {}, torch.float32)
    assert torch.equal(model.head.packed, model.embed.weight)


def test_a_derived_parameter_nothing_computes_is_refused() -> None:
    model = Model()
    model.norm.register_parameter("extra", nn.Parameter(torch.zeros(2)))
    with pytest.raises(LayoutError, match=r"norm\.extra has no checkpoint tensor.*norm"):
        find_consumers(model, synced(model), derived=["attn.W_UV", "norm.extra"], rebuild=True)


def receiver(model: nn.Module) -> Any:
    """A worker's Receiver over ``model``'s consumers, without an engine (its refresh state
    only; HF tensor ``hf.<name>`` is the source of the worker's parameter ``<name>``)."""
    from deltastore.engines.vllm_refresh import modules_of_sources
    from deltastore.engines.vllm_worker import Receiver

    r = Receiver.__new__(Receiver)
    r._consumers = find_consumers(model, synced(model), derived=["attn.W_UV"], rebuild=True)
    r._modules_of = modules_of_sources(r._consumers, {n: (f"hf.{n}",) for n in synced(model)})
    r._shadows, r._dtype, r._pending = {}, torch.float32, set()
    r._refreshed, r._rebuilt, r._rebuild_s = [], 0, 0.0
    return r


def version(changed: list[str], kind: str = "delta") -> Any:
    from types import SimpleNamespace

    tensors = {f"hf.{n}": SimpleNamespace(changed=1) for n in changed}
    tensors["hf.norm.weight"] = SimpleNamespace(changed=0)
    return SimpleNamespace(kind=kind, tensors=tensors)


def test_a_version_refreshes_the_consumers_of_what_it_changed() -> None:
    model = Model()
    r = receiver(model)
    r._on_version(version(["embed.weight", "kv_b_proj.weight"]))
    assert r._refreshed == ["embed", "head", "kv_b_proj", "attn"] and r._pending == set()
    r._refreshed = []
    r._on_version(version([]))  # only a norm changed: written in place, nothing to refresh
    assert r._refreshed == []
    r._on_version(version([], kind="anchor"))  # an anchor rewrites everything
    assert sorted(r._refreshed) == sorted(r._consumers)


def test_a_failed_refresh_is_a_typed_error_and_stays_pending() -> None:
    from deltastore.errors import EngineSyncError

    model = Model()
    r = receiver(model)
    method = model.kv_b_proj.quant_method

    def broken(layer: nn.Module) -> None:
        raise RuntimeError("no memory to repack")

    method.process_weights_after_loading = broken
    with pytest.raises(EngineSyncError, match=r"refreshing kv_b_proj \(quant\).*no memory"):
        r._on_version(version(["kv_b_proj.weight"]))
    # neither it nor the attention layer that reads it (refreshed after it) was refreshed
    assert r._pending == {"kv_b_proj", "attn"}
    del method.process_weights_after_loading  # the class's own again
    r._rebuild_pending()  # the next sync refreshes them first
    assert r._pending == set() and r._refreshed == ["kv_b_proj", "attn"]
    assert torch.equal(model.attn.W_UV, model.kv_b_proj.weight.T)


class Replacing(Packing):
    """A quant method that packs the weight and leaves an empty parameter (vLLM's CPU GEMM)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)


@pytest.mark.parametrize("method", [Packing, Replacing])
def test_a_kept_weight_is_refilled_in_place_and_a_packed_one_is_not(method: type) -> None:
    """Where the kernel kept the tensor the last refresh gave it, the next refresh copies the
    new shadow into that tensor (no allocation); where it packed a copy, a fresh copy."""
    model = Model()
    model.kv_b_proj.quant_method = method()
    found = find_consumers(model, synced(model), derived=["attn.W_UV"], rebuild=True)
    c = found["kv_b_proj"]
    ptrs = []
    for _ in range(3):
        shadow = torch.randn(4, 3)
        refresh("kv_b_proj", c, {"weight": shadow}, torch.float32)
        assert torch.equal(model.kv_b_proj.packed, shadow)  # the kernel sees the new version
        if method is Packing:
            assert torch.equal(model.kv_b_proj.weight, shadow)
            assert model.kv_b_proj.weight.data_ptr() != shadow.data_ptr()
            ptrs.append(model.kv_b_proj.weight.data_ptr())
        else:
            assert model.kv_b_proj.weight.numel() == 0 and not c.kept
    if method is Packing:
        assert len(set(ptrs)) == 1, "the kept weight was not reused"
