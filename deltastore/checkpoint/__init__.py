"""safetensors checkpoints and folders: publish a checkpoint, keep a folder in sync
in place (crash-safe, repaired after a killed pull)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deltastore._lazy import lazy_exports

if TYPE_CHECKING:
    from deltastore.checkpoint.folders import (
        PENDING,
        SIDECAR,
        FolderRepair,
        FolderState,
        FolderSync,
        checksums,
        default_state_dir,
        publish_checkpoint,
        pull_checkpoint,
        read_state,
        watch_checkpoint,
    )
    from deltastore.checkpoint.safetensors import (
        CheckpointError,
        MappedCheckpoint,
        TensorLocation,
        checkpoint_files,
        create_checkpoint,
        locate,
        read_header,
        table_of,
    )

_EXPORTS = {
    "CheckpointError": "deltastore.checkpoint.safetensors",
    "FolderRepair": "deltastore.checkpoint.folders",
    "FolderState": "deltastore.checkpoint.folders",
    "FolderSync": "deltastore.checkpoint.folders",
    "MappedCheckpoint": "deltastore.checkpoint.safetensors",
    "PENDING": "deltastore.checkpoint.folders",
    "SIDECAR": "deltastore.checkpoint.folders",
    "TensorLocation": "deltastore.checkpoint.safetensors",
    "checkpoint_files": "deltastore.checkpoint.safetensors",
    "checksums": "deltastore.checkpoint.folders",
    "create_checkpoint": "deltastore.checkpoint.safetensors",
    "default_state_dir": "deltastore.checkpoint.folders",
    "locate": "deltastore.checkpoint.safetensors",
    "publish_checkpoint": "deltastore.checkpoint.folders",
    "pull_checkpoint": "deltastore.checkpoint.folders",
    "read_header": "deltastore.checkpoint.safetensors",
    "read_state": "deltastore.checkpoint.folders",
    "table_of": "deltastore.checkpoint.safetensors",
    "watch_checkpoint": "deltastore.checkpoint.folders",
}
__all__ = [
    "PENDING",
    "SIDECAR",
    "CheckpointError",
    "FolderRepair",
    "FolderState",
    "FolderSync",
    "MappedCheckpoint",
    "TensorLocation",
    "checkpoint_files",
    "checksums",
    "create_checkpoint",
    "default_state_dir",
    "locate",
    "publish_checkpoint",
    "pull_checkpoint",
    "read_header",
    "read_state",
    "table_of",
    "watch_checkpoint",
]

if not TYPE_CHECKING:  # type checkers see the imports above
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
