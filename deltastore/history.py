"""Read-only views of a store for ``deltastore log`` and ``deltastore show``."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from deltastore._ratios import SizeRatios
from deltastore.store import Store
from deltastore.subscriber import Subscriber


@dataclass(frozen=True)
class VersionSummary(SizeRatios):
    """One committed version as ``deltastore log`` lists it. Sizes in bytes."""

    version: int
    kind: str
    parent: int | None
    changed_elements: int
    total_elements: int
    payload_bytes: int
    dense_bytes: int
    frames: int
    created: str

    def to_json(self) -> dict[str, Any]:
        """Plain dict for ``--json`` output, with the derived ratios."""
        return asdict(self) | {
            "changed_fraction": self.changed_fraction,
            "payload_ratio": self.payload_ratio,
        }


def version_log(
    url: str | os.PathLike[str] | Store,
    *,
    storage_options: dict[str, Any] | None = None,
    limit: int | None = None,
) -> list[VersionSummary]:
    """Committed versions, newest first (at most ``limit``), read from their manifests."""
    sub = Subscriber(url, storage_options=storage_options)
    versions = sub.versions()[::-1]
    out = []
    for v in versions[:limit] if limit is not None else versions:
        m = sub.manifest(v)
        out.append(
            VersionSummary(
                version=m.version,
                kind=m.kind,
                parent=m.parent.version if m.parent else None,
                changed_elements=m.changed_elements,
                total_elements=m.total_elements,
                payload_bytes=m.payload_bytes,
                dense_bytes=m.dense_bytes,
                frames=sum(len(t.frames) for t in m.tensors.values()),
                created=m.created,
            )
        )
    return out


__all__ = ["VersionSummary", "version_log"]
