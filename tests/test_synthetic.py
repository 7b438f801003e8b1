"""The synthetic model: one SIZES table, importable without torch, and one AdamW
generator shared by the tests, the demo and the benchmark workload."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from deltastore.bench import SIZES as BENCH_SIZES
from deltastore.bench.workload import Workload, WorkloadSpec, generate
from deltastore.testing import sizes, synthetic
from deltastore.testing.synthetic import TINY, AdamWTensor, AdamWTrajectory


def test_one_sizes_table() -> None:
    assert synthetic.SIZES is sizes.SIZES is BENCH_SIZES
    assert list(sizes.SIZES) == ["tiny", "small", "medium", "large"]
    assert synthetic.ModelConfig is sizes.ModelConfig
    numel = [c.numel() for c in sizes.SIZES.values()]
    assert numel == sorted(numel) and numel[0] > 4_000_000 and 1.0e9 < numel[-1] < 1.1e9


def test_sizes_import_no_torch() -> None:
    code = (
        "import json, sys; from deltastore.testing.sizes import SIZES; "
        "print(json.dumps([list(SIZES), 'torch' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [["tiny", "small", "medium", "large"], False]


def test_trajectory_equals_the_benchmark_workload(tmp_path: Path) -> None:
    """Generated together (trajectory) or one tensor at a time in reused buffers (workload):
    the same bf16 bits, version by version."""
    spec = WorkloadSpec(size="tiny", seed=3, warmup=1, versions=2)
    index = generate(spec, tmp_path / spec.key)
    workload = Workload.load(tmp_path / spec.key)
    traj = AdamWTrajectory(TINY, lr=spec.lr, seed=spec.seed, warmup=spec.warmup)
    states = [traj.bf16()] + [traj.step() for _ in range(spec.versions)]
    for i, state in enumerate(states):
        expected = workload.tensors(workload.read(i))
        assert list(expected) == list(state)
        for name, t in state.items():
            assert t.dtype == torch.bfloat16 and t.shape == expected[name].shape, name
            assert torch.equal(t.view(torch.int16), expected[name].view(torch.int16)), (i, name)
    # the stationary start: ~1% of the elements change from the first step on
    assert all(0.004 < c / index.numel < 0.02 for c in index.changed[1:]), index.changed


def test_adamw_tensor_is_deterministic_and_steps() -> None:
    a = AdamWTensor("w", (3, 1000), position=2, seed=9)
    arena = [np.zeros(5000, dtype=np.float32) for _ in range(4)]  # larger, as the bench's
    b = AdamWTensor("w", (3, 1000), position=2, seed=9, buffers=arena)
    assert torch.equal(a.bf16(), b.bf16()) and a.bf16().shape == (3, 1000)
    before = a.bf16()
    a.step()
    b.step()
    assert a.steps == 1 and torch.equal(a.bf16(), b.bf16())
    assert not torch.equal(a.bf16(), before)
    words = np.zeros(3000, dtype=np.int16)
    a.bf16_into(words)
    assert np.array_equal(words, a.bf16().view(torch.int16).numpy().reshape(-1))
    other = AdamWTensor("w", (3, 1000), position=3, seed=9)
    assert not torch.equal(other.bf16(), before)
    norm = AdamWTensor("model.norm.weight", (8,), position=0)
    assert bool(norm.param.eq(1).all())


def test_unknown_size_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown size"):
        WorkloadSpec(size="huge")
