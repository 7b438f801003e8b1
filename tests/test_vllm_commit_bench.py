"""benchmarks/vllm_commit.py's model table and trainer (no vLLM needed): the model is Qwen3-0.6B
sized, and a version moves the asked fraction of the bf16 elements by 1-2 ulps, never to a
NaN or an infinity, and reports exactly the elements it changed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "vllm_commit.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_commit_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def config(layers: int, vocab: int = 151936, hidden: int = 1024) -> SimpleNamespace:
    return SimpleNamespace(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=3072,
    )  # fmt: skip


def test_full_model_is_qwen3_0_6b_sized(bench: ModuleType) -> None:
    shapes = bench.table(config(28))
    assert "lm_head.weight" not in shapes  # tied: the checkpoint has no separate head
    assert len(shapes) == 1 + 28 * 11 + 1
    assert sum(int(np.prod(s)) for s in shapes.values()) == 596_049_920


@pytest.mark.parametrize("frac", [0.01, 0.5])
def test_step_moves_the_fraction_by_one_or_two_ulps(bench: ModuleType, frac: float) -> None:
    shapes = bench.table(config(1, vocab=512, hidden=256))
    tr = bench.Trainer(shapes, seed=3)
    before = tr.words.copy()
    changed, kept = tr.step(frac, version=1, keep=True)
    moved = np.flatnonzero(before != tr.words)
    assert changed == moved.size
    assert abs(changed / before.size - frac) < 0.05 * frac + 0.002
    # sign kept, magnitude moved by 1 or 2 ulps, nothing reaches the exponent of inf/NaN
    old, new = before[moved], tr.words[moved]
    assert np.array_equal(old & 0x8000, new & 0x8000)
    step = np.abs((new & 0x7FFF).astype(np.int32) - (old & 0x7FFF).astype(np.int32))
    assert set(np.unique(step).tolist()) <= {1, 2}
    assert int((tr.words & 0x7FFF).max()) < 0x7F80
    # the kept changes are exactly the moved elements, per tensor, with their new words
    got = np.concatenate([pos.astype(np.int64) + tr.offsets[n] for n, (pos, _) in kept.items()])
    assert np.array_equal(np.sort(got), moved)
    for name, (pos, words) in kept.items():
        assert np.array_equal(tr.view(name)[pos], words)
