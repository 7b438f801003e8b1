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
    ManifestError,
    ManifestNotFoundError,
    ObjectNotFoundError,
    PreconditionFailedError,
    StoreError,
    TensorMismatchError,
    UnsupportedFormatError,
    VersionExistsError,
    VersionOrderError,
    WrongParentError,
)
from deltastore.manifest import Manifest, parse_manifest
from deltastore.publisher import Publisher, PublishReport
from deltastore.store import LocalStore, Store, open_store
from deltastore.subscriber import Subscriber, SyncReport

__all__ = [
    "ChainError",
    "DeltastoreError",
    "FrameError",
    "IntegrityError",
    "InvalidKeyError",
    "LocalStore",
    "Manifest",
    "ManifestError",
    "ManifestNotFoundError",
    "ObjectNotFoundError",
    "PreconditionFailedError",
    "PublishReport",
    "Publisher",
    "Store",
    "StoreError",
    "Subscriber",
    "SyncReport",
    "TensorMismatchError",
    "UnsupportedFormatError",
    "VersionExistsError",
    "VersionOrderError",
    "WrongParentError",
    "__version__",
    "open_store",
    "parse_manifest",
]
