"""What a store holds, read by publishers, receivers and maintenance alike: the chain of
committed manifests, anchor copies and ``LATEST`` (:class:`ChainReader`). Below both
``publish`` and ``sync``; reads manifests only, never tensor data, and imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltastore._lazy import lazy_exports

if TYPE_CHECKING:
    from deltastore.catalog.chain import Chain, ChainReader, Plan

_EXPORTS = {
    "Chain": "deltastore.catalog.chain",
    "ChainReader": "deltastore.catalog.chain",
    "Plan": "deltastore.catalog.chain",
}
__all__ = ["Chain", "ChainReader", "Plan"]

if not TYPE_CHECKING:  # type checkers see the imports above
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
