"""Store upkeep: verify (fsck, deep replay), orphan collection, version history."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltastore._lazy import lazy_exports

if TYPE_CHECKING:
    from deltastore.maintenance.history import (
        ManifestReader,
        VersionSummary,
        show_manifest,
        version_log,
    )
    from deltastore.maintenance.orphans import (
        DEFAULT_MIN_AGE_S,
        GcReport,
        Orphan,
        find_orphans,
        gc,
    )
    from deltastore.maintenance.verify import (
        ADLER32,
        CHAIN,
        FRAME,
        LATEST,
        MANIFEST,
        MISSING_OBJECT,
        MISSING_PARENT,
        PARENT_ADLER32,
        PARENT_DIGEST,
        PARENT_TABLE,
        SIDECAR_MISMATCH,
        TABLE,
        TRUNCATED,
        XXH3,
        Problem,
        VerifyReport,
        verify_checkout,
        verify_store,
    )

_EXPORTS = {
    "ADLER32": "deltastore.maintenance.verify",
    "CHAIN": "deltastore.maintenance.verify",
    "DEFAULT_MIN_AGE_S": "deltastore.maintenance.orphans",
    "FRAME": "deltastore.maintenance.verify",
    "GcReport": "deltastore.maintenance.orphans",
    "LATEST": "deltastore.maintenance.verify",
    "MANIFEST": "deltastore.maintenance.verify",
    "MISSING_OBJECT": "deltastore.maintenance.verify",
    "MISSING_PARENT": "deltastore.maintenance.verify",
    "ManifestReader": "deltastore.maintenance.history",
    "Orphan": "deltastore.maintenance.orphans",
    "PARENT_ADLER32": "deltastore.maintenance.verify",
    "PARENT_DIGEST": "deltastore.maintenance.verify",
    "PARENT_TABLE": "deltastore.maintenance.verify",
    "Problem": "deltastore.maintenance.verify",
    "SIDECAR_MISMATCH": "deltastore.maintenance.verify",
    "TABLE": "deltastore.maintenance.verify",
    "TRUNCATED": "deltastore.maintenance.verify",
    "VerifyReport": "deltastore.maintenance.verify",
    "VersionSummary": "deltastore.maintenance.history",
    "XXH3": "deltastore.maintenance.verify",
    "find_orphans": "deltastore.maintenance.orphans",
    "gc": "deltastore.maintenance.orphans",
    "show_manifest": "deltastore.maintenance.history",
    "verify_checkout": "deltastore.maintenance.verify",
    "verify_store": "deltastore.maintenance.verify",
    "version_log": "deltastore.maintenance.history",
}
__all__ = [
    "ADLER32",
    "CHAIN",
    "DEFAULT_MIN_AGE_S",
    "FRAME",
    "LATEST",
    "MANIFEST",
    "MISSING_OBJECT",
    "MISSING_PARENT",
    "PARENT_ADLER32",
    "PARENT_DIGEST",
    "PARENT_TABLE",
    "SIDECAR_MISMATCH",
    "TABLE",
    "TRUNCATED",
    "XXH3",
    "GcReport",
    "ManifestReader",
    "Orphan",
    "Problem",
    "VerifyReport",
    "VersionSummary",
    "find_orphans",
    "gc",
    "show_manifest",
    "verify_checkout",
    "verify_store",
    "version_log",
]

if not TYPE_CHECKING:  # type checkers see the imports above
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
