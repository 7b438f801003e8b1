"""Read-only views of a store for ``deltastore log`` and ``deltastore show``.

Only manifests are read, never tensor data, so nothing here imports torch: ``deltastore log``
and ``show`` start in well under a second.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from deltastore.catalog.chain import ChainReader
from deltastore.format.manifest import Manifest
from deltastore.format.ratios import SizeRatios
from deltastore.format.signing import FROM_ENV, KeyOption, resolve_trust
from deltastore.store import Store, open_store


class ManifestReader(ChainReader):
    """A :class:`~deltastore.catalog.chain.ChainReader` on the store at ``url``, checking
    manifests as a :class:`~deltastore.Subscriber` does (format v1 validation, the signature
    when a signing key is given or set in ``DELTASTORE_SIGNING_KEY``, the version the key
    names). Kept for code that used it; ``ChainReader(open_store(url), keys=...)`` is the
    same reader."""

    def __init__(
        self,
        url: str | os.PathLike[str] | Store,
        *,
        storage_options: dict[str, Any] | None = None,
        signing_key: KeyOption = FROM_ENV,
    ) -> None:
        super().__init__(
            open_store(url, storage_options), keys=resolve_trust(FROM_ENV, signing_key)
        )


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
    #: The store also holds an anchor copy of this version (``anchors/<version>.json``).
    anchor_copy: bool = False

    @property
    def bytes_per_changed_element(self) -> float | None:
        """Payload bytes per changed element; None when no element changed."""
        return self.payload_bytes / self.changed_elements if self.changed_elements else None

    def to_json(self) -> dict[str, Any]:
        """Plain dict for ``--json`` output, with the derived ratios."""
        return asdict(self) | {
            "changed_fraction": self.changed_fraction,
            "payload_ratio": self.payload_ratio,
            "bytes_per_changed_element": self.bytes_per_changed_element,
        }


def version_log(
    url: str | os.PathLike[str] | Store,
    *,
    storage_options: dict[str, Any] | None = None,
    limit: int | None = None,
) -> list[VersionSummary]:
    """Committed versions, newest first (at most ``limit``), read from their manifests; which
    of them carry an anchor copy comes from one listing of ``anchors/``."""
    reader = ChainReader(open_store(url, storage_options), keys=resolve_trust(FROM_ENV))
    versions = reader.versions()[::-1]
    copies = set(reader.anchor_versions())
    out = []
    for v in versions[:limit] if limit is not None else versions:
        m = reader.manifest(v)
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
                anchor_copy=m.version in copies,
            )
        )
    return out


def show_manifest(
    url: str | os.PathLike[str] | Store,
    version: int,
    *,
    storage_options: dict[str, Any] | None = None,
) -> Manifest:
    """The checked manifest of ``version`` (``deltastore show``)."""
    reader = ChainReader(open_store(url, storage_options), keys=resolve_trust(FROM_ENV))
    return reader.manifest(version)


__all__ = ["ManifestReader", "VersionSummary", "show_manifest", "version_log"]
