"""Format v1 store keys: the key grammar and the names of manifests, data objects and LATEST.

A store holds three kinds of object (``docs/spec/format-v1.md``, section 3):

- ``manifests/<version:020d>.json``: the manifest of one committed version (:func:`manifest_key`);
- ``versions/<version:020d>/...``: the data objects written for a version (:func:`data_prefix`);
- ``LATEST``: a hint naming the newest committed version (:data:`LATEST_KEY`);
- ``anchors/<version:020d>.json``: an *anchor copy*, the state of a committed version stored
  in full beside its delta (:func:`anchor_key`; from deltastore 0.2.0);
- ``leases/<reader>.json``: a reader's lease on the versions it holds (:func:`lease_key`).

Every key is a relative POSIX path of segments ``[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}`` joined by
``/`` (:data:`KEY_PATTERN`), at most :data:`MAX_KEY_LENGTH` characters. Pure string rules: no
I/O, no pydantic, no torch; every name here is a constant or a pure function, thread-safe.
"""

from __future__ import annotations

import re
from typing import Final

MANIFEST_PREFIX: Final = "manifests/"
DATA_PREFIX: Final = "versions/"
LATEST_KEY: Final = "LATEST"
ANCHOR_PREFIX: Final = "anchors/"
LEASE_PREFIX: Final = "leases/"
#: Largest version number (fits a signed 64-bit integer and 20 digits).
MAX_VERSION: Final = 2**63 - 1
#: Longest store key, in characters.
MAX_KEY_LENGTH: Final = 1024

#: One key segment: no empty segment, none starting with ``.`` (so no ``..``).
SEGMENT: Final = r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}"
#: Any store key (anchored regular expression).
KEY_PATTERN: Final = rf"^{SEGMENT}(/{SEGMENT})*$"
#: A data object named by a manifest frame: a key under :data:`DATA_PREFIX`.
OBJECT_PATTERN: Final = rf"^versions/{SEGMENT}(/{SEGMENT})*$"
#: A manifest key (anchored): ``manifests/`` then 20 decimal digits and ``.json``.
MANIFEST_KEY_PATTERN: Final = r"^manifests/[0-9]{20}\.json$"
#: An anchor copy key (anchored): ``anchors/`` then 20 decimal digits and ``.json``.
ANCHOR_KEY_PATTERN: Final = r"^anchors/[0-9]{20}\.json$"
#: A reader id: one key segment without the ``.json`` a lease key adds (1-250 characters).
READER_ID_PATTERN: Final = r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,249}$"
#: A lease key (anchored): ``leases/`` then a reader id and ``.json``.
LEASE_KEY_PATTERN: Final = r"^leases/[A-Za-z0-9_-][A-Za-z0-9._-]{0,249}\.json$"
#: The data objects of a version as the reference writer names them (readers locate data
#: through frames only, spec section 3.2): ``versions/<version:020d>/<prefix>-<seq:06d>.dsz``,
#: ``<prefix>`` the first 12 characters of the writer's token.
DATA_OBJECT_PATTERN: Final = r"^versions/[0-9]{20}/[0-9a-f]{12}-[0-9]{6,}\.dsz$"
#: The data objects of an anchor copy as the reference writer names them:
#: ``versions/<version:020d>/<prefix>-anchor-<seq:06d>.dsz``.
ANCHOR_OBJECT_PATTERN: Final = r"^versions/[0-9]{20}/[0-9a-f]{12}-anchor-[0-9]{6,}\.dsz$"
_MANIFEST_KEY = re.compile(r"manifests/([0-9]{20})\.json")
_ANCHOR_KEY = re.compile(r"anchors/([0-9]{20})\.json")
_READER_ID = re.compile(READER_ID_PATTERN)
_LEASE_KEY = re.compile(r"leases/([A-Za-z0-9_-][A-Za-z0-9._-]{0,249})\.json")


def manifest_key(version: int) -> str:
    """Store key of the manifest of ``version``."""
    return f"{MANIFEST_PREFIX}{version:020d}.json"


def data_prefix(version: int) -> str:
    """Store key prefix of the data objects written for ``version``."""
    return f"{DATA_PREFIX}{version:020d}/"


def anchor_key(version: int) -> str:
    """Store key of the anchor copy of ``version``."""
    return f"{ANCHOR_PREFIX}{version:020d}.json"


def lease_key(reader: str) -> str:
    """Store key of the lease of the reader ``reader``; ValueError for an id that is not one
    key segment (:data:`READER_ID_PATTERN`)."""
    if not isinstance(reader, str) or not _READER_ID.fullmatch(reader):
        raise ValueError(
            f"reader id {reader!r} must be 1-250 characters of [A-Za-z0-9._-], "
            "not starting with '.'"
        )
    return f"{LEASE_PREFIX}{reader}.json"


def version_of_key(key: str) -> int | None:
    """Version number of a manifest key, or None if ``key`` is not a manifest key."""
    return _number(_MANIFEST_KEY.fullmatch(key))


def version_of_anchor_key(key: str) -> int | None:
    """Version number of an anchor copy key, or None if ``key`` is not one."""
    return _number(_ANCHOR_KEY.fullmatch(key))


def reader_of_lease_key(key: str) -> str | None:
    """Reader id of a lease key, or None if ``key`` is not one."""
    match = _LEASE_KEY.fullmatch(key)
    return match.group(1) if match else None


def _number(match: re.Match[str] | None) -> int | None:
    version = int(match.group(1)) if match else None
    return version if version is not None and version <= MAX_VERSION else None
