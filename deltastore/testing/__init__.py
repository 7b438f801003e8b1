"""Shipped test tools: a fault-injecting store, a store conformance suite (pytest),
synthetic models."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltastore._lazy import lazy_exports

if TYPE_CHECKING:
    from deltastore.testing.faults import (
        FAULT_MODES,
        OPERATIONS,
        FaultMode,
        FaultyStore,
        InjectedFault,
        Op,
    )

_EXPORTS = {
    "FAULT_MODES": "deltastore.testing.faults",
    "FaultMode": "deltastore.testing.faults",
    "FaultyStore": "deltastore.testing.faults",
    "InjectedFault": "deltastore.testing.faults",
    "OPERATIONS": "deltastore.testing.faults",
    "Op": "deltastore.testing.faults",
}
__all__ = [
    "FAULT_MODES",
    "OPERATIONS",
    "FaultMode",
    "FaultyStore",
    "InjectedFault",
    "Op",
]

if not TYPE_CHECKING:  # type checkers see the imports above
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
