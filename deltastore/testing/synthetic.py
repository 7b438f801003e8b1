"""A synthetic Qwen-like bf16 model whose versions come from real AdamW steps.

The workload of benchmarks/README.md (Workload): fp32 master weights (normal(0, 0.02); norms
at 1.0), one ``torch.optim.AdamW`` step per version on seeded random gradients, cast to bf16.
At lr 1e-6 about 1% of bf16 elements change per step. Deterministic for a given config and seed.
The shapes are those of :func:`deltastore.layout.presets.hf_shapes`: dense by default, or MoE, with
q/k/v biases, q/k norms or tied embeddings (:class:`ModelConfig` fields). Single-threaded use
only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltastore.layout.presets import Family, ModelSpec, hf_shapes


@dataclass(frozen=True)
class ModelConfig(ModelSpec):
    """Shape of the synthetic model: a :class:`~deltastore.layout.presets.ModelSpec` with defaults
    (Qwen2-style names, HF layout: [out, in]; dense, no q/k/v bias or q/k norm unless asked,
    e.g. ``ModelConfig(..., experts=4, moe_intermediate=256, family="qwen3_moe")``)."""

    vocab: int = 151936
    hidden: int = 2048
    layers: int = 28
    intermediate: int = 6144
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    family: Family = "qwen2"

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Global tensor name -> shape (:func:`deltastore.layout.presets.hf_shapes`)."""
        return hf_shapes(self)

    def numel(self) -> int:
        total = 0
        for shape in self.shapes().values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


#: ~4.7M elements over 30 tensors: the size unit tests use.
TINY = ModelConfig(
    vocab=5000, hidden=256, layers=3, intermediate=704, heads=4, kv_heads=1, head_dim=64
)
#: ~69M elements (~138 MB bf16).
SMALL = ModelConfig(
    vocab=32000, hidden=512, layers=12, intermediate=1536, heads=8, kv_heads=2, head_dim=64
)


#: ~245M elements (~490 MB bf16).
MEDIUM = ModelConfig(
    vocab=32000, hidden=1024, layers=16, intermediate=2816, heads=16, kv_heads=4, head_dim=64
)
#: ~1.02e9 elements (~2 GB bf16; tied embeddings): the benchmark's default size
#: (``deltastore bench --size large``).
LARGE = ModelConfig(
    vocab=151936,
    hidden=2048,
    layers=14,
    intermediate=6144,
    heads=16,
    kv_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
)
#: Demo and benchmark sizes by name.
SIZES = {"tiny": TINY, "small": SMALL, "medium": MEDIUM}


class AdamWTrajectory:
    """fp32 masters + AdamW; :meth:`step` advances one version and returns bf16 tensors."""

    def __init__(self, config: ModelConfig, *, lr: float = 1e-6, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.params: dict[str, torch.nn.Parameter] = {}
        for name, shape in config.shapes().items():
            if name.endswith("norm.weight"):
                data = torch.ones(shape)
            else:
                data = torch.randn(shape, generator=gen) * 0.02
            self.params[name] = torch.nn.Parameter(data)
        self._opt = torch.optim.AdamW(self.params.values(), lr=lr, weight_decay=0.01)
        self._gen = gen

    def bf16(self) -> dict[str, torch.Tensor]:
        """Current weights cast to bf16 (new tensors)."""
        return {n: p.detach().to(torch.bfloat16) for n, p in self.params.items()}

    def step(self) -> dict[str, torch.Tensor]:
        """One real AdamW step on random gradients; returns the new bf16 weights."""
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=self._gen)
        self._opt.step()
        return self.bf16()
