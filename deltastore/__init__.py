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
    from deltastore.faults import FaultyStore as FaultyStore
    from deltastore.faults import InjectedFault as InjectedFault
    from deltastore.folders import FolderRepair as FolderRepair
    from deltastore.folders import FolderSync as FolderSync
    from deltastore.fsck import Problem as Problem
    from deltastore.fsck import VerifyReport as VerifyReport
    from deltastore.fsck import verify_checkout as verify_checkout
    from deltastore.fsck import verify_store as verify_store
    from deltastore.layout import Layout as Layout
    from deltastore.layout import fuse as fuse
    from deltastore.layout import replicate as replicate
    from deltastore.layout import shard as shard
    from deltastore.layout import stack as stack
    from deltastore.manifest import Manifest as Manifest
    from deltastore.manifest import parse_manifest as parse_manifest
    from deltastore.presets import ModelSpec as ModelSpec
    from deltastore.presets import hf_shapes as hf_shapes
    from deltastore.presets import vllm_layout as vllm_layout
    from deltastore.publisher import Publisher as Publisher
    from deltastore.publisher import PublishReport as PublishReport
    from deltastore.sharded import RowSlice as RowSlice
    from deltastore.sharded import ShardWriter as ShardWriter
    from deltastore.sharded import commit_parts as commit_parts
    from deltastore.signing import SignatureError as SignatureError
    from deltastore.signing import SigningKey as SigningKey
    from deltastore.store import LocalStore as LocalStore
    from deltastore.store import Store as Store
    from deltastore.store import open_store as open_store
    from deltastore.subscriber import Subscriber as Subscriber
    from deltastore.subscriber import SyncReport as SyncReport

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
    "FaultyStore": "deltastore.faults",
    "InjectedFault": "deltastore.faults",
    "FolderRepair": "deltastore.folders",
    "FolderSync": "deltastore.folders",
    "Problem": "deltastore.fsck",
    "VerifyReport": "deltastore.fsck",
    "verify_checkout": "deltastore.fsck",
    "verify_store": "deltastore.fsck",
    "Layout": "deltastore.layout",
    "fuse": "deltastore.layout",
    "replicate": "deltastore.layout",
    "shard": "deltastore.layout",
    "stack": "deltastore.layout",
    "Manifest": "deltastore.manifest",
    "parse_manifest": "deltastore.manifest",
    "ModelSpec": "deltastore.presets",
    "hf_shapes": "deltastore.presets",
    "vllm_layout": "deltastore.presets",
    "Publisher": "deltastore.publisher",
    "PublishReport": "deltastore.publisher",
    "RowSlice": "deltastore.sharded",
    "ShardWriter": "deltastore.sharded",
    "commit_parts": "deltastore.sharded",
    "SignatureError": "deltastore.signing",
    "SigningKey": "deltastore.signing",
    "LocalStore": "deltastore.store",
    "Store": "deltastore.store",
    "open_store": "deltastore.store",
    "Subscriber": "deltastore.subscriber",
    "SyncReport": "deltastore.subscriber",
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
