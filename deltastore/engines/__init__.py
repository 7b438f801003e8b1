"""Inference engines as receivers: :mod:`deltastore.engines.vllm` keeps a vLLM engine's weights
at the store's newest version, in the engine's own (tensor-parallel, fused) parameters.

The engine packages are optional extras (``pip install 'deltastore[vllm]'``); importing this
package imports none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltastore._lazy import lazy_exports

if TYPE_CHECKING:
    from deltastore.engines.vllm import (
        DeltastoreWorkerExtension,
        EngineLayout,
        EngineSyncError,
        derive_layout,
        follow,
    )

_EXPORTS = {
    "DeltastoreWorkerExtension": "deltastore.engines.vllm",
    "EngineLayout": "deltastore.engines.vllm",
    "EngineSyncError": "deltastore.engines.vllm",
    "derive_layout": "deltastore.engines.vllm",
    "follow": "deltastore.engines.vllm",
}
__all__ = [
    "DeltastoreWorkerExtension",
    "EngineLayout",
    "EngineSyncError",
    "derive_layout",
    "follow",
]

if not TYPE_CHECKING:  # type checkers see the imports above
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
