"""The receiver side: poll -> fetch -> decode -> map -> verify -> write
(:class:`Subscriber`, the fetch pipeline, the multi-rank exchange)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltastore._lazy import lazy_exports

if TYPE_CHECKING:
    from deltastore.sync.subscriber import (
        Subscriber,
        SyncReport,
    )

_EXPORTS = {
    "Subscriber": "deltastore.sync.subscriber",
    "SyncReport": "deltastore.sync.subscriber",
}
__all__ = [
    "Subscriber",
    "SyncReport",
]

if not TYPE_CHECKING:  # type checkers see the imports above
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
