"""The synthetic model sizes: one table, by name, shared by the demo, the benchmark and the CLI.

:data:`SIZES` maps a size name to a :class:`ModelConfig` (the shape of a Qwen-like decoder).
Pure shapes: this module imports no torch (``deltastore demo --help`` and ``bench --help``
list the names without loading it); the weights come from
:class:`deltastore.testing.synthetic.AdamWTrajectory`. Immutable, thread-safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

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
        """Elements of all tensors together."""
        return sum(math.prod(shape) for shape in self.shapes().values())


#: ~4.7M elements over 30 tensors: the size unit tests use.
TINY: Final = ModelConfig(
    vocab=5000, hidden=256, layers=3, intermediate=704, heads=4, kv_heads=1, head_dim=64
)
#: ~69M elements (~138 MB bf16): the demo's default size.
SMALL: Final = ModelConfig(
    vocab=32000, hidden=512, layers=12, intermediate=1536, heads=8, kv_heads=2, head_dim=64
)
#: ~245M elements (~490 MB bf16).
MEDIUM: Final = ModelConfig(
    vocab=32000, hidden=1024, layers=16, intermediate=2816, heads=16, kv_heads=4, head_dim=64
)
#: ~1.02e9 elements (~2 GB bf16; tied embeddings): the benchmark's default size
#: (``deltastore bench --size large``).
LARGE: Final = ModelConfig(
    vocab=151936,
    hidden=2048,
    layers=14,
    intermediate=6144,
    heads=16,
    kv_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
)
#: The model sizes by name, smallest first: the one table the demo (``deltastore demo
#: --size``), the benchmark (``deltastore bench --size``, :class:`deltastore.bench.WorkloadSpec`)
#: and their CLI choices use.
SIZES: Final[dict[str, ModelConfig]] = {
    "tiny": TINY,
    "small": SMALL,
    "medium": MEDIUM,
    "large": LARGE,
}
