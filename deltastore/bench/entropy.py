"""The XOR entropy floor of a version's changes (benchmarks/README.md, Floors): the order-0
entropy of the gaps between changes plus that of the XOR masks, in bytes per changed element.

A code that sends each change as (gap, mask) with a fixed (order-0) model per version needs
at least that many bytes; deltastore's payload per changed element is checked against it.
Gaps are the unchanged elements before each change within its tensor (the first from the
tensor's start), one symbol each; masks are ``old ^ new`` as 16-bit symbols. Both
distributions are pooled over every tensor of the version. Vectorized (``np.unique`` and
``np.bincount``); pure functions, thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def entropy_bits(counts: np.ndarray) -> float:
    """Order-0 entropy in bits of a sequence with symbol ``counts``: sum of c * log2(n / c)
    over the non-zero counts (0 for an empty sequence or a single symbol)."""
    c = np.asarray(counts, dtype=np.float64)
    c = c[c > 0]
    if c.size == 0:
        return 0.0
    n = c.sum()
    return float(np.sum(c * (np.log2(n) - np.log2(c))))


def gaps(positions: np.ndarray) -> np.ndarray:
    """Unchanged elements before each of the sorted, distinct ``positions`` (int64): the
    first position itself, then the differences minus one."""
    pos = np.asarray(positions, dtype=np.int64)
    return np.diff(pos, prepend=np.int64(-1)) - 1


@dataclass(frozen=True)
class XorEntropy:
    """Order-0 entropies of a version's gaps and masks (bytes) and its changed elements."""

    gap_bytes: float
    mask_bytes: float
    changed: int

    @property
    def floor(self) -> float:
        """(gap + mask bytes) / changed elements (0 when nothing changed)."""
        return (self.gap_bytes + self.mask_bytes) / self.changed if self.changed else 0.0


def xor_entropy(changes: Sequence[tuple[np.ndarray, np.ndarray]]) -> XorEntropy:
    """The entropies of ``changes``: per tensor its sorted positions and its ``uint16`` XOR
    masks (``old ^ new``), pooled over the tensors."""
    if not changes:
        return XorEntropy(0.0, 0.0, 0)
    all_gaps = np.concatenate([gaps(pos) for pos, _ in changes])
    masks = np.concatenate([np.asarray(m).view(np.uint16) for _, m in changes])
    if all_gaps.size != masks.size:
        raise ValueError(f"{all_gaps.size} positions and {masks.size} masks")
    _, gap_counts = np.unique(all_gaps, return_counts=True)
    mask_counts = np.bincount(masks, minlength=1 << 16)
    return XorEntropy(
        gap_bytes=entropy_bits(gap_counts) / 8,
        mask_bytes=entropy_bits(mask_counts) / 8,
        changed=int(masks.size),
    )
