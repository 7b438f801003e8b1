"""deltastore: move RL policy weights through shared storage, sending only what changed.

Public API: :class:`Publisher`, :class:`Subscriber`, their reports, :func:`open_store`, the
:class:`Store` interface and the errors in :mod:`deltastore.errors`.

The names below are imported on first use (PEP 562): ``import deltastore`` imports neither
torch nor the CLI's typer and rich, so tools that only read manifests start fast. To export a
name, add it to ``_EXPORTS`` (name -> defining module) and to the ``TYPE_CHECKING`` imports,
which are what type checkers and IDEs see; ``tests/test_startup.py`` checks both agree.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from deltastore._version import __version__ as __version__

if TYPE_CHECKING:
    from deltastore.checkpoint.folders import FolderRepair as FolderRepair
    from deltastore.checkpoint.folders import FolderSync as FolderSync
    from deltastore.errors import ChainError as ChainError
    from deltastore.errors import DeltastoreError as DeltastoreError
    from deltastore.errors import FrameError as FrameError
    from deltastore.errors import IntegrityError as IntegrityError
    from deltastore.errors import InvalidKeyError as InvalidKeyError
    from deltastore.errors import LayoutError as LayoutError
    from deltastore.errors import ManifestError as ManifestError
    from deltastore.errors import ManifestNotFoundError as ManifestNotFoundError
    from deltastore.errors import ObjectNotFoundError as ObjectNotFoundError
    from deltastore.errors import PreconditionFailedError as PreconditionFailedError
    from deltastore.errors import RankError as RankError
    from deltastore.errors import StoreError as StoreError
    from deltastore.errors import TableChangedError as TableChangedError
    from deltastore.errors import TensorMismatchError as TensorMismatchError
    from deltastore.errors import UnsupportedFormatError as UnsupportedFormatError
    from deltastore.errors import VersionExistsError as VersionExistsError
    from deltastore.errors import VersionNotCommittedError as VersionNotCommittedError
    from deltastore.errors import VersionOrderError as VersionOrderError
    from deltastore.errors import WrongParentError as WrongParentError
    from deltastore.format.manifest import Manifest as Manifest
    from deltastore.format.manifest import parse_manifest as parse_manifest
    from deltastore.format.signing import SignatureError as SignatureError
    from deltastore.format.signing import SigningKey as SigningKey
    from deltastore.layout.boxes import Layout as Layout
    from deltastore.layout.boxes import fuse as fuse
    from deltastore.layout.boxes import replicate as replicate
    from deltastore.layout.boxes import shard as shard
    from deltastore.layout.boxes import stack as stack
    from deltastore.layout.presets import ModelSpec as ModelSpec
    from deltastore.layout.presets import hf_shapes as hf_shapes
    from deltastore.layout.presets import vllm_layout as vllm_layout
    from deltastore.maintenance.verify import Problem as Problem
    from deltastore.maintenance.verify import VerifyReport as VerifyReport
    from deltastore.maintenance.verify import verify_checkout as verify_checkout
    from deltastore.maintenance.verify import verify_store as verify_store
    from deltastore.publish.publisher import Publisher as Publisher
    from deltastore.publish.publisher import PublishReport as PublishReport
    from deltastore.publish.sharded import RowSlice as RowSlice
    from deltastore.publish.sharded import ShardWriter as ShardWriter
    from deltastore.publish.sharded import commit_parts as commit_parts
    from deltastore.store import LocalStore as LocalStore
    from deltastore.store import Store as Store
    from deltastore.store import open_store as open_store
    from deltastore.sync.subscriber import Subscriber as Subscriber
    from deltastore.sync.subscriber import SyncReport as SyncReport
    from deltastore.testing.faults import FaultyStore as FaultyStore
    from deltastore.testing.faults import InjectedFault as InjectedFault

#: Errors exported from :mod:`deltastore.errors`.
_ERRORS = (
    "ChainError",
    "DeltastoreError",
    "FrameError",
    "IntegrityError",
    "InvalidKeyError",
    "LayoutError",
    "ManifestError",
    "ManifestNotFoundError",
    "ObjectNotFoundError",
    "PreconditionFailedError",
    "RankError",
    "StoreError",
    "TableChangedError",
    "TensorMismatchError",
    "UnsupportedFormatError",
    "VersionExistsError",
    "VersionNotCommittedError",
    "VersionOrderError",
    "WrongParentError",
)

#: Every public name (but ``__version__``) and the module it is imported from on first use.
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(_ERRORS, "deltastore.errors"),
    "FaultyStore": "deltastore.testing.faults",
    "InjectedFault": "deltastore.testing.faults",
    "FolderRepair": "deltastore.checkpoint.folders",
    "FolderSync": "deltastore.checkpoint.folders",
    "Problem": "deltastore.maintenance.verify",
    "VerifyReport": "deltastore.maintenance.verify",
    "verify_checkout": "deltastore.maintenance.verify",
    "verify_store": "deltastore.maintenance.verify",
    "Layout": "deltastore.layout.boxes",
    "fuse": "deltastore.layout.boxes",
    "replicate": "deltastore.layout.boxes",
    "shard": "deltastore.layout.boxes",
    "stack": "deltastore.layout.boxes",
    "Manifest": "deltastore.format.manifest",
    "parse_manifest": "deltastore.format.manifest",
    "ModelSpec": "deltastore.layout.presets",
    "hf_shapes": "deltastore.layout.presets",
    "vllm_layout": "deltastore.layout.presets",
    "Publisher": "deltastore.publish.publisher",
    "PublishReport": "deltastore.publish.publisher",
    "RowSlice": "deltastore.publish.sharded",
    "ShardWriter": "deltastore.publish.sharded",
    "commit_parts": "deltastore.publish.sharded",
    "SignatureError": "deltastore.format.signing",
    "SigningKey": "deltastore.format.signing",
    "LocalStore": "deltastore.store",
    "Store": "deltastore.store",
    "open_store": "deltastore.store",
    "Subscriber": "deltastore.sync.subscriber",
    "SyncReport": "deltastore.sync.subscriber",
}

__all__ = sorted([*_EXPORTS, "__version__"])


if not TYPE_CHECKING:  # type checkers see the imports above, and flag unknown names

    def __getattr__(name: str) -> Any:
        """Import a public name on first use (PEP 562) and keep it in the module's namespace."""
        module = _EXPORTS.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
