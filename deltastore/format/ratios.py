"""Derived size ratios shared by reports, version summaries and manifests."""

from __future__ import annotations

from typing import Protocol


class _Sizes(Protocol):
    @property
    def changed_elements(self) -> int: ...
    @property
    def total_elements(self) -> int: ...
    @property
    def payload_bytes(self) -> int: ...
    @property
    def dense_bytes(self) -> int: ...


class SizeRatios:
    """``changed_fraction`` and ``payload_ratio`` for any class with the four size counts."""

    @property
    def changed_fraction(self: _Sizes) -> float:
        """Changed elements over all elements (0.0 for an empty model)."""
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    @property
    def payload_ratio(self: _Sizes) -> float:
        """Payload bytes over dense bytes of the model in its own dtypes (0.0 when empty)."""
        return self.payload_bytes / self.dense_bytes if self.dense_bytes else 0.0
