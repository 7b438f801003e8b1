"""Every error deltastore raises on purpose.

All classes derive from :class:`DeltastoreError` and, where one fits, from the matching
built-in exception too (``except FileNotFoundError`` keeps working). Each message says what
went wrong and what to do about it.
"""

from __future__ import annotations

import errno as _errno
import os as _os


class DeltastoreError(Exception):
    """Root of every error raised on purpose by deltastore."""


# --- store -------------------------------------------------------------------------------


class StoreError(DeltastoreError, OSError):
    """A store operation failed (I/O error, permission, backend error)."""


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """A key that should exist is missing from the store."""


class ManifestNotFoundError(ObjectNotFoundError):
    """No committed manifest exists for the requested version."""


class VersionExistsError(StoreError, FileExistsError):
    """``put_if_absent`` lost: the object (a version's manifest) is already committed."""


class PreconditionFailedError(StoreError):
    """A compare-and-swap found a different object than expected."""


class AccessDeniedError(StoreError, PermissionError):
    """The store refused the operation for lack of permission (S3 ``AccessDenied``, HTTP 403,
    a file mode): the identity in use may not do this on this key. Not retried. Give the role
    the permission docs/stores.md (Least privilege) lists, or use the right credentials."""


class BucketNotFoundError(StoreError, FileNotFoundError):
    """The store's bucket (Azure: container) does not exist: every key of the store is
    missing because of it, not because the store is empty. Create it, or fix the URL."""


class PreconditionsIgnoredError(StoreError):
    """The service accepts create-if-absent (or compare-and-swap) requests but ignores their
    precondition, so two publishers could both commit a version. Use a service that enforces
    them, or accept the risk with ``unsafe_commits=True`` (one publisher only)."""


class TransientError(StoreError):
    """A failure worth retrying (5xx, throttling, connection reset, timeout): a store backend
    raises it, and the fsspec-based stores retry it with backoff, raising a plain
    :class:`StoreError` when the retries run out (importable from
    ``deltastore.store.fsspec_store`` too)."""


class InvalidKeyError(DeltastoreError, ValueError):
    """A key is not a clean relative path inside the store root (``..``, ``/``, NUL, URL...)."""


# --- local disk --------------------------------------------------------------------------


class DiskFullError(DeltastoreError, OSError):
    """A file deltastore writes on a local file system found no room: the disk is full
    (``ENOSPC``) or the user's quota is exhausted (``EDQUOT``). ``errno`` says which,
    ``filename`` names the folder, ``needed`` / ``free`` are bytes (None where unknown; ``free``
    as ``shutil.disk_usage`` reports it, which a quota may further limit). The file being
    written was removed and nothing already recorded was changed: free space (or choose
    another folder) and run the operation again."""

    def __init__(
        self,
        message: str,
        *,
        errno: int | None = None,
        filename: str | None = None,
        needed: int | None = None,
        free: int | None = None,
    ) -> None:
        super().__init__(message)
        self.errno = _errno.ENOSPC if errno is None else errno
        self.strerror = _os.strerror(self.errno)
        self.filename = filename
        self.needed, self.free = needed, free

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StoreFullError(StoreError, DiskFullError):
    """A local store's folder (:class:`~deltastore.store.LocalStore`) has no room for an
    object: a :class:`StoreError` and a :class:`DiskFullError`. The temp file was removed and
    nothing was committed."""


# --- format ------------------------------------------------------------------------------


class ManifestError(DeltastoreError, ValueError):
    """A manifest is malformed or violates the format-v1 rules."""


class UnsupportedFormatError(ManifestError):
    """A manifest declares a ``format_version`` this library does not read."""


class FrameError(DeltastoreError, ValueError):
    """A stored frame is corrupted, truncated, or disagrees with what its manifest declares."""


class IntegrityError(DeltastoreError, ValueError):
    """A checksum did not match: the data is not what the manifest promised."""


class SignatureError(IntegrityError):
    """A manifest is unsigned, wrongly signed, signed with an unknown key id, or replayed,
    while this reader requires signed manifests. Nothing was fetched or written.
    (Importable from ``deltastore.format.signing`` too.)"""


# --- chain / state ----------------------------------------------------------------------


class WrongParentError(DeltastoreError, ValueError):
    """A delta's parent is not the state the tensors are in."""


class ChainError(DeltastoreError, LookupError):
    """No chain of committed versions leads from the current state to the target version."""


class ForkError(ChainError):
    """On a store without enforced preconditions (``unsafe_commits``), the manifest read back
    after a commit is not the one this publisher wrote: another publisher committed the same
    version at the same time, and the chain has forked."""


class TensorMismatchError(DeltastoreError, ValueError):
    """Local tensors do not match the manifest (names, dtype, shape, layout, checksum)."""


class CheckpointError(TensorMismatchError):
    """A checkpoint file or folder is missing, malformed or not what was expected.
    (Importable from ``deltastore.checkpoint.safetensors`` and ``deltastore.checkpoint`` too.)"""


class LayoutError(TensorMismatchError):
    """A receiver layout does not fit the manifest's global tensors or the local tensors."""


class TableChangedError(TensorMismatchError):
    """A version changes the tensor table (names, dtypes or shapes) of tensors the caller owns
    (an engine's, handed over with ``tensors=``): deltastore cannot reallocate them, so it
    raised before writing anything. ``added``, ``removed``, ``reshaped`` and ``retyped`` name
    the tensors that changed. Reallocate the tensors for the new table and construct a new
    ``Subscriber``, or let one allocate its own tensors."""

    def __init__(
        self,
        message: str,
        *,
        added: tuple[str, ...] = (),
        removed: tuple[str, ...] = (),
        reshaped: tuple[str, ...] = (),
        retyped: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.added, self.removed, self.reshaped, self.retyped = added, removed, reshaped, retyped


class RankError(DeltastoreError):
    """Another rank of the process group failed this version; nothing was written here."""


class VersionOrderError(DeltastoreError, ValueError):
    """A version number does not increase strictly along the chain."""


class VersionNotCommittedError(DeltastoreError, TimeoutError):
    """A version written by several writers was not committed: a writer's part did not arrive
    in time, or the version was aborted. Nothing was committed; publish a higher version."""


class SupersededRunError(VersionNotCommittedError):
    """The parts of a version belong to a run of sharded writers that a newer run replaced
    (it registered after them, e.g. by ``ModuleWriter.resume()`` after a restart): they are
    never committed. Stop the old run's processes; the new run publishes from now on."""


# --- engines -----------------------------------------------------------------------------


class EngineSyncError(DeltastoreError):
    """A worker's sync failed with an error that is not one of deltastore's own types, or the
    driver/worker protocol was misused (a second prepare, a commit without prepare, a timeout).
    (Importable from ``deltastore.engines.vllm`` too.)"""


__all__ = [
    "AccessDeniedError",
    "BucketNotFoundError",
    "ChainError",
    "CheckpointError",
    "DeltastoreError",
    "DiskFullError",
    "EngineSyncError",
    "ForkError",
    "FrameError",
    "IntegrityError",
    "InvalidKeyError",
    "LayoutError",
    "ManifestError",
    "ManifestNotFoundError",
    "ObjectNotFoundError",
    "PreconditionFailedError",
    "PreconditionsIgnoredError",
    "RankError",
    "SignatureError",
    "StoreError",
    "StoreFullError",
    "SupersededRunError",
    "TableChangedError",
    "TensorMismatchError",
    "TransientError",
    "UnsupportedFormatError",
    "VersionExistsError",
    "VersionNotCommittedError",
    "VersionOrderError",
    "WrongParentError",
]
