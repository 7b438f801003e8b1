"""The trainer side: detect -> encode -> upload -> commit (:class:`Publisher`,
sharded writers and their coordinator)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltastore._lazy import lazy_exports

if TYPE_CHECKING:
    from deltastore.publish.module_writer import ModuleWriter, ResumeReport
    from deltastore.publish.publisher import (
        Publisher,
        PublishReport,
    )
    from deltastore.publish.sharded import (
        Part,
        PartTensor,
        RowSlice,
        ShardWriter,
        abort_key,
        commit_parts,
        parse_part,
        part_key,
        parts_prefix,
    )
    from deltastore.publish.snapfree import SnapshotFreeStats

_EXPORTS = {
    "ModuleWriter": "deltastore.publish.module_writer",
    "ResumeReport": "deltastore.publish.module_writer",
    "Part": "deltastore.publish.sharded",
    "PartTensor": "deltastore.publish.sharded",
    "PublishReport": "deltastore.publish.publisher",
    "Publisher": "deltastore.publish.publisher",
    "RowSlice": "deltastore.publish.sharded",
    "ShardWriter": "deltastore.publish.sharded",
    "SnapshotFreeStats": "deltastore.publish.snapfree",
    "abort_key": "deltastore.publish.sharded",
    "commit_parts": "deltastore.publish.sharded",
    "parse_part": "deltastore.publish.sharded",
    "part_key": "deltastore.publish.sharded",
    "parts_prefix": "deltastore.publish.sharded",
}
__all__ = [
    "ModuleWriter",
    "Part",
    "PartTensor",
    "PublishReport",
    "Publisher",
    "ResumeReport",
    "RowSlice",
    "ShardWriter",
    "SnapshotFreeStats",
    "abort_key",
    "commit_parts",
    "parse_part",
    "part_key",
    "parts_prefix",
]

if not TYPE_CHECKING:  # type checkers see the imports above
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
