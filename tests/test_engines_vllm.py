"""deltastore.engines.vllm without vLLM: the layout derived from a worker's parameters, error
mapping, and that importing the adapter imports no vLLM (the engine tests: tests/vllm)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deltastore.engines.vllm import EngineSyncError, derive_layout, raise_for_error
from deltastore.errors import IntegrityError, LayoutError
from deltastore.layout.presets import ModelSpec, hf_shapes, vllm_layout

QWEN3_MOE = {
    "model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
    "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "num_local_experts": 4, "moe_intermediate_size": 32,
}  # fmt: skip


def worker_shapes(config: dict[str, object], rank: int, size: int) -> dict[str, tuple[int, ...]]:
    """What a vLLM 0.32 worker's named_parameters() look like: the preset's local tensors,
    MoE experts under the runner's ``routed_experts`` module."""
    spec = ModelSpec.from_hf_config(config)
    bound = vllm_layout(spec, tp_rank=rank, tp_size=size).bind(hf_shapes(spec))
    return {
        n.replace(".experts.w", ".experts.routed_experts.w"): s
        for n, s in bound.local_shapes.items()
    }


@pytest.mark.parametrize("rank", [0, 1])
def test_layout_keeps_the_workers_names_and_shapes(rank: int) -> None:
    shapes = worker_shapes(QWEN3_MOE, rank, 2)
    el = derive_layout(shapes, QWEN3_MOE, tp_rank=rank, tp_size=2)
    assert set(el.layout.parts) == set(shapes)
    assert dict(el.shapes) == shapes
    w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    assert el.shapes[w13] == (4, 2 * 32 // 2, 64)  # 4 experts, gate+up sharded over 2 ranks
    assert el.sources[w13][0] == "model.layers.1.mlp.experts.0.gate_proj.weight"
    # padded vocabulary: 1000 rows padded to 1024, 512 per rank
    assert el.shapes["model.embed_tokens.weight"] == (512, 64)


def test_a_parameter_the_preset_does_not_know_is_named() -> None:
    shapes = worker_shapes(QWEN3_MOE, 0, 1) | {"model.layers.0.mlp.shared_expert.weight": (8, 64)}
    with pytest.raises(LayoutError, match=r"1 unknown.*shared_expert.weight is not in the preset"):
        derive_layout(shapes, QWEN3_MOE)


def test_a_missing_parameter_and_a_wrong_shape_are_named() -> None:
    shapes = worker_shapes(QWEN3_MOE, 0, 1)
    del shapes["lm_head.weight"]
    shapes["model.norm.weight"] = (65,)
    with pytest.raises(LayoutError) as info:
        derive_layout(shapes, QWEN3_MOE)
    msg = str(info.value)
    assert "lm_head.weight is not a parameter of the worker" in msg
    assert "model.norm.weight: vLLM [65], preset [64]" in msg
    assert "layout='package.module:function'" in msg


def test_an_architecture_without_preset_says_what_to_pass() -> None:
    with pytest.raises(LayoutError, match=r"'gemma2' has no deltastore preset.*layout="):
        derive_layout({"x": (1,)}, {"model_type": "gemma2"})


def test_worker_errors_come_back_typed() -> None:
    ok = {"rank": 0, "ok": True, "error": None}
    raise_for_error([ok])
    bad = {"rank": 1, "ok": False, "error": {"type": "IntegrityError", "message": "frame x"}}
    with pytest.raises(IntegrityError, match="rank 1: frame x"):
        raise_for_error([ok, bad])
    odd = {"rank": 0, "error": {"type": "RuntimeError", "message": "boom"}}
    with pytest.raises(EngineSyncError, match="boom"):
        raise_for_error([odd])


def test_the_adapter_imports_no_vllm() -> None:
    code = "import sys, deltastore.engines.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
