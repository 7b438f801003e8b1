"""Format v1 store keys: the key grammar and the names of manifests, data objects and LATEST.

A store holds three kinds of object (``docs/spec/format-v1.md``, section 3):

- ``manifests/<version:020d>.json``: the manifest of one committed version (:func:`manifest_key`);
- ``versions/<version:020d>/...``: the data objects written for a version (:func:`data_prefix`);
- ``LATEST``: a hint naming the newest committed version (:data:`LATEST_KEY`).

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
_MANIFEST_KEY = re.compile(r"manifests/([0-9]{20})\.json")


def manifest_key(version: int) -> str:
    """Store key of the manifest of ``version``."""
    return f"{MANIFEST_PREFIX}{version:020d}.json"


def data_prefix(version: int) -> str:
    """Store key prefix of the data objects written for ``version``."""
    return f"{DATA_PREFIX}{version:020d}/"


def version_of_key(key: str) -> int | None:
    """Version number of a manifest key, or None if ``key`` is not a manifest key."""
    match = _MANIFEST_KEY.fullmatch(key)
    version = int(match.group(1)) if match else None
    return version if version is not None and version <= MAX_VERSION else None
