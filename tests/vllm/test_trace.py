"""Layouts traced from vLLM's own weight loading (deltastore.engines.vllm_trace) on vLLM's real
model classes (instantiated on the meta device by ``trace_probe.py``, one process per rank):
equal to the presets for the five preset families at TP 1 and TP 2, and complete for
architectures that have no preset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tools

PRESET_ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"]
#: architectures without a preset (tiny configs from tools.tiny_config)
OTHER_ARCHS = ["phi3", "gemma2"]


def trace(archs: list[str], tp: int, workdir: Path) -> dict[str, Any]:
    """``trace_probe.py`` in a process of its own; its result per rank and architecture."""
    proc = subprocess.run(
        [sys.executable, str(tools.HERE / "trace_probe.py"), *archs, "--tp", str(tp),
         "--workdir", str(workdir)],
        env=tools.engine_env(tp, multiprocess=True), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(tools.RESULT)]
    assert proc.returncode == 0 and lines, f"{proc.stderr[-6000:]}\n{proc.stdout[-2000:]}"
    out: dict[str, Any] = json.loads(lines[-1][len(tools.RESULT) :])
    assert sorted(out) == [str(r) for r in range(tp)]
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder of tiny saved models for the tests of this module (built once)."""
    return tmp_path_factory.mktemp("traced")


#: TP 2 (the sharded case) runs in make test-vllm; TP 1 in the full target (CI budget)
@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.full), 2])
def test_traced_layouts_equal_the_presets(tp: int, models: Path) -> None:
    """Every rank's traced layout places the same boxes of the same checkpoint tensors in the
    same parameters as the preset, for each preset family (the vocabulary padded to 1024
    rows, the LM head tied in one llama)."""
    archs = [*PRESET_ARCHS, "qwen3_moe" + tools.ODD_VOCAB, "llama" + tools.TIED]
    out = trace(archs, tp, models)
    for rank, per_arch in out.items():
        for arch in archs:
            got = per_arch[arch]
            assert "error" not in got, f"{arch} rank {rank}: {got.get('error')}"
            assert got["equal_preset"], f"{arch} rank {rank}: {got['preset_diff']}"
            assert got["covers_every_parameter"] and not got["derived"], arch
            assert len(got["traced"]) == len(got["params"]) > 0
        if tp == 2:  # really sharded: a rank holds half of q/k/v and the padding moves
            qkv = per_arch["qwen3"]["params"]["model.layers.0.self_attn.qkv_proj.weight"]
            assert qkv == [(4 * 32 + 2 * 2 * 32) // 2, 128]
    odd = {r: out[r]["qwen3_moe" + tools.ODD_VOCAB]["padding"] for r in out}
    if tp == 1:  # 1000 tokens padded to 1024 rows: rows 1000..1023 are padding
        assert odd["0"]["model.embed_tokens.weight"] == [[[1000, 0], [24, 128]]]
    else:  # rank 0 holds rows 0..511 (all real), rank 1 rows 512..999 and 24 padding rows
        assert "model.embed_tokens.weight" not in odd["0"]
        assert odd["1"]["model.embed_tokens.weight"] == [[[488, 0], [24, 128]]]


@pytest.mark.full
def test_architectures_without_a_preset_are_traced_completely(models: Path) -> None:
    """Phi-3 (whose checkpoint already fuses q/k/v and gate/up) and Gemma2 have no preset: the
    trace maps every parameter, and the layout binds to the checkpoint's tensors."""
    out = trace(OTHER_ARCHS, 1, models)
    for arch in OTHER_ARCHS:
        got = out["0"][arch]
        assert "error" not in got, f"{arch}: {got.get('error')}"
        assert got["covers_every_parameter"], arch
        assert set(got["traced"]) | set(got["derived"]) == set(got["params"])
    phi3 = out["0"]["phi3"]["traced"]["model.layers.0.self_attn.qkv_proj.weight"]
    assert phi3 == [["model.layers.0.self_attn.qkv_proj.weight", [0, 0], [256, 128], [0, 0]]]
