"""A layout for ``deltastore_attach(layout="failures_layout:rank1_fails")`` that does not fit
TP rank 1 only (the engine tests of failures: ``test_failures.py``); rank 0 gets the preset's.
Imported on the workers (``failures_engine.py`` puts this folder on their ``PYTHONPATH``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from deltastore.engines.vllm_layout import derive_layout
from deltastore.errors import LayoutError
from deltastore.layout.boxes import Layout

BAD = "failures_layout:rank1_fails"


def rank1_fails(
    shapes: Mapping[str, Sequence[int]], hf_config: Mapping[str, Any], tp_rank: int, tp_size: int
) -> Layout:
    if tp_rank == 1:
        raise LayoutError(f"the test layout does not fit TP rank {tp_rank} of {tp_size}")
    return derive_layout(shapes, hf_config, tp_rank=tp_rank, tp_size=tp_size).layout
