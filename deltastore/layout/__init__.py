"""Receiver layouts: which boxes of which global tensors each local tensor holds
(TP shards, fused, stacked, replicated, renamed), and presets for common engines.
Pure index math: numpy, no store I/O."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltastore._lazy import lazy_exports

if TYPE_CHECKING:
    from deltastore.layout.boxes import (
        BoundLayout,
        Box,
        Fuse,
        Layout,
        Part,
        Placement,
        Replicate,
        Shard,
        Stack,
        covered,
        flat_span,
        fuse,
        inside,
        is_contiguous_box,
        replicate,
        shard,
        stack,
    )
    from deltastore.layout.presets import (
        FAMILIES,
        Family,
        ModelSpec,
        hf_shapes,
        padded_vocab,
        vllm_layout,
    )

_EXPORTS = {
    "BoundLayout": "deltastore.layout.boxes",
    "Box": "deltastore.layout.boxes",
    "FAMILIES": "deltastore.layout.presets",
    "Family": "deltastore.layout.presets",
    "Fuse": "deltastore.layout.boxes",
    "Layout": "deltastore.layout.boxes",
    "ModelSpec": "deltastore.layout.presets",
    "Part": "deltastore.layout.boxes",
    "Placement": "deltastore.layout.boxes",
    "Replicate": "deltastore.layout.boxes",
    "Shard": "deltastore.layout.boxes",
    "Stack": "deltastore.layout.boxes",
    "covered": "deltastore.layout.boxes",
    "flat_span": "deltastore.layout.boxes",
    "fuse": "deltastore.layout.boxes",
    "hf_shapes": "deltastore.layout.presets",
    "inside": "deltastore.layout.boxes",
    "is_contiguous_box": "deltastore.layout.boxes",
    "padded_vocab": "deltastore.layout.presets",
    "replicate": "deltastore.layout.boxes",
    "shard": "deltastore.layout.boxes",
    "stack": "deltastore.layout.boxes",
    "vllm_layout": "deltastore.layout.presets",
}
__all__ = [
    "FAMILIES",
    "BoundLayout",
    "Box",
    "Family",
    "Fuse",
    "Layout",
    "ModelSpec",
    "Part",
    "Placement",
    "Replicate",
    "Shard",
    "Stack",
    "covered",
    "flat_span",
    "fuse",
    "hf_shapes",
    "inside",
    "is_contiguous_box",
    "padded_vocab",
    "replicate",
    "shard",
    "stack",
    "vllm_layout",
]

if not TYPE_CHECKING:  # type checkers see the imports above
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
