"""deltastore: move RL policy weights through shared storage, sending only what changed.

Public API: :class:`Publisher`, :class:`Subscriber`, their reports, :func:`open_store`, the
:class:`Store` interface and the errors in :mod:`deltastore.errors`.
"""

from deltastore._version import __version__
from deltastore.errors import (
    ChainError,
    DeltastoreError,
    FrameError,
    IntegrityError,
    InvalidKeyError,
    LayoutError,
    ManifestError,
    ManifestNotFoundError,
    ObjectNotFoundError,
    PreconditionFailedError,
    RankError,
    StoreError,
    TableChangedError,
    TensorMismatchError,
    UnsupportedFormatError,
    VersionExistsError,
    VersionNotCommittedError,
    VersionOrderError,
    WrongParentError,
)
from deltastore.faults import FaultyStore, InjectedFault
from deltastore.folders import FolderRepair, FolderSync
from deltastore.fsck import Problem, VerifyReport, verify_checkout, verify_store
from deltastore.layout import Layout, fuse, replicate, shard, stack
from deltastore.manifest import Manifest, parse_manifest
from deltastore.presets import ModelSpec, hf_shapes, vllm_layout
from deltastore.publisher import Publisher, PublishReport
from deltastore.sharded import RowSlice, ShardWriter, commit_parts
from deltastore.signing import SignatureError, SigningKey
from deltastore.store import LocalStore, Store, open_store
from deltastore.subscriber import Subscriber, SyncReport

__all__ = [
    "ChainError",
    "DeltastoreError",
    "FaultyStore",
    "FolderRepair",
    "FolderSync",
    "FrameError",
    "InjectedFault",
    "IntegrityError",
    "InvalidKeyError",
    "Layout",
    "LayoutError",
    "LocalStore",
    "Manifest",
    "ManifestError",
    "ManifestNotFoundError",
    "ModelSpec",
    "ObjectNotFoundError",
    "PreconditionFailedError",
    "Problem",
    "PublishReport",
    "Publisher",
    "RankError",
    "RowSlice",
    "ShardWriter",
    "SignatureError",
    "SigningKey",
    "Store",
    "StoreError",
    "Subscriber",
    "SyncReport",
    "TableChangedError",
    "TensorMismatchError",
    "UnsupportedFormatError",
    "VerifyReport",
    "VersionExistsError",
    "VersionNotCommittedError",
    "VersionOrderError",
    "WrongParentError",
    "__version__",
    "commit_parts",
    "fuse",
    "hf_shapes",
    "open_store",
    "parse_manifest",
    "replicate",
    "shard",
    "stack",
    "verify_checkout",
    "verify_store",
    "vllm_layout",
]
