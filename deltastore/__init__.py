"""deltastore: move RL policy weights through shared storage, sending only what changed.

Public API, what the guide's and the README's examples import from ``deltastore``:
:class:`Publisher`, :class:`Subscriber` and their reports, :func:`open_store`, the
:class:`Store` interface and :class:`LocalStore`, layouts (:class:`Layout`, ``replicate``,
``shard``, ``fuse``, ``stack``), the sharded writers (:class:`ModuleWriter` and its
:class:`ResumeReport`, :class:`ShardWriter`, :class:`RowSlice`, :func:`commit_parts`),
:class:`Ed25519Key` and :class:`PublicKey` (manifest signatures; :class:`SigningKey`: HMAC,
for old stores), :class:`Manifest`, and every error of
:mod:`deltastore.errors` (the list is that module's ``__all__``). Everything else stays in its
sub-package: checkpoint folders in :mod:`deltastore.checkpoint`, ``verify_store`` and the
other upkeep in :mod:`deltastore.maintenance`, the vLLM presets in :mod:`deltastore.layout`,
test tools (``FaultyStore``) in :mod:`deltastore.testing`.

The names below are imported on first use (PEP 562): ``import deltastore`` imports neither
torch nor the CLI's typer and rich, so tools that only read manifests start fast; only
:mod:`deltastore.errors` (standard library only) is imported at once, for its ``__all__``. To
export a name, add it to ``_EXPORTS`` (name -> defining module) and to the ``TYPE_CHECKING``
imports, which are what type checkers and IDEs see; ``tests/test_startup.py`` checks both
agree. An error is exported by listing it in ``errors.__all__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from deltastore import errors as _errors
from deltastore._version import __version__ as __version__

if TYPE_CHECKING:
    from deltastore.errors import *  # noqa: F403 - every name of errors.__all__
    from deltastore.format.ed25519 import Ed25519Key as Ed25519Key
    from deltastore.format.ed25519 import PublicKey as PublicKey
    from deltastore.format.manifest import Manifest as Manifest
    from deltastore.format.signing import SigningKey as SigningKey
    from deltastore.layout.boxes import Layout as Layout
    from deltastore.layout.boxes import fuse as fuse
    from deltastore.layout.boxes import replicate as replicate
    from deltastore.layout.boxes import shard as shard
    from deltastore.layout.boxes import stack as stack
    from deltastore.publish.module_writer import ModuleWriter as ModuleWriter
    from deltastore.publish.module_writer import ResumeReport as ResumeReport
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

#: Every public name (but ``__version__``) and the module it is imported from on first use.
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(_errors.__all__, "deltastore.errors"),
    "Manifest": "deltastore.format.manifest",
    "Ed25519Key": "deltastore.format.ed25519",
    "PublicKey": "deltastore.format.ed25519",
    "SigningKey": "deltastore.format.signing",
    "Layout": "deltastore.layout.boxes",
    "fuse": "deltastore.layout.boxes",
    "replicate": "deltastore.layout.boxes",
    "shard": "deltastore.layout.boxes",
    "stack": "deltastore.layout.boxes",
    "ModuleWriter": "deltastore.publish.module_writer",
    "ResumeReport": "deltastore.publish.module_writer",
    "Publisher": "deltastore.publish.publisher",
    "PublishReport": "deltastore.publish.publisher",
    "RowSlice": "deltastore.publish.sharded",
    "ShardWriter": "deltastore.publish.sharded",
    "commit_parts": "deltastore.publish.sharded",
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
