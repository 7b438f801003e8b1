"""The dtype table of format v1: every dtype name with its size, safetensors code and words.

deltastore never compares or moves tensor data as floats: every element is handled as an
unsigned little-endian integer of the dtype's size (a *word*), so NaN payloads, -0.0, inf and
subnormals round-trip bit-exactly. Dtype names are torch's (``bfloat16``, ``float32``...;
``docs/spec/format-v1.md`` section 5.1).

:data:`TABLE` is the one place that knows dtypes: per name, the bytes per element, the
safetensors header code and the numpy word dtypes. numpy only: this module never imports torch
(code that reads manifests, such as ``deltastore log``, ``show`` and ``verify``, never loads
it). The torch side (torch dtypes by name, zero-copy word views of tensors) is
:mod:`deltastore.tensors.dtypes`, derived from this table. Everything here is immutable and
thread-safe.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from deltastore.errors import DeltastoreError, ManifestError

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI machine
    raise DeltastoreError(
        "deltastore needs a little-endian host: format v1 stores tensors little-endian "
        "and views tensor memory without byte swapping"
    )


def word_dtype(size: int) -> np.dtype[np.unsignedinteger[Any]]:
    """numpy unsigned little-endian integer dtype of ``size`` bytes (1, 2, 4 or 8)."""
    return np.dtype(f"<u{size}")


def signed_word_dtype(size: int) -> np.dtype[Any]:
    """numpy twin of the torch integer dtype that holds words of ``size`` bytes (1, 2, 4 or 8):
    ``uint8`` for 1 byte, else the signed ``<i2``, ``<i4``, ``<i8`` (torch indexes and copies
    only these). Same bits as :func:`word_dtype`; reinterpret with ``ndarray.view``."""
    return np.dtype(f"<i{size}") if size > 1 else np.dtype(np.uint8)


@dataclass(frozen=True)
class DtypeInfo:
    """One dtype of format v1.

    ``itemsize``: bytes per element. ``safetensors``: the code of the dtype in a safetensors
    header (``"BF16"``...), or None where safetensors has none. ``word``: numpy unsigned
    little-endian integer dtype of ``itemsize`` bytes (the element's bits). ``signed``: the
    numpy twin of the torch integer dtype of that size (see :func:`signed_word_dtype`).
    """

    name: str
    itemsize: int
    safetensors: str | None
    word: np.dtype[np.unsignedinteger[Any]]
    signed: np.dtype[Any]


def _info(name: str, itemsize: int, safetensors: str | None) -> DtypeInfo:
    return DtypeInfo(name, itemsize, safetensors, word_dtype(itemsize), signed_word_dtype(itemsize))


#: Every dtype format v1 names, by (torch's) name, in the order of the spec's table.
TABLE: Final[dict[str, DtypeInfo]] = {
    d.name: d
    for d in (
        _info("bool", 1, "BOOL"),
        _info("uint8", 1, "U8"),
        _info("int8", 1, "I8"),
        _info("int16", 2, "I16"),
        _info("uint16", 2, "U16"),
        _info("int32", 4, "I32"),
        _info("uint32", 4, "U32"),
        _info("int64", 8, "I64"),
        _info("uint64", 8, "U64"),
        _info("float16", 2, "F16"),
        _info("bfloat16", 2, "BF16"),
        _info("float32", 4, "F32"),
        _info("float64", 8, "F64"),
        _info("float8_e4m3fn", 1, "F8_E4M3"),
        _info("float8_e4m3fnuz", 1, None),
        _info("float8_e5m2", 1, "F8_E5M2"),
        _info("float8_e5m2fnuz", 1, None),
        _info("float8_e8m0fnu", 1, "F8_E8M0"),
    )
}
#: Every format v1 dtype name (the values a manifest's ``dtype`` may take).
NAMES: Final = tuple(TABLE)
#: Bytes per element by dtype name.
ITEMSIZES: Final[dict[str, int]] = {name: d.itemsize for name, d in TABLE.items()}
#: safetensors header code by dtype name, for the dtypes safetensors can store.
SAFETENSORS_CODES: Final[dict[str, str]] = {
    name: d.safetensors for name, d in TABLE.items() if d.safetensors is not None
}
#: Dtype name by safetensors header code (the inverse of :data:`SAFETENSORS_CODES`).
SAFETENSORS_NAMES: Final[dict[str, str]] = {code: name for name, code in SAFETENSORS_CODES.items()}


def info(name: str) -> DtypeInfo:
    """The table entry of the dtype called ``name``; :class:`ManifestError` if unknown."""
    try:
        return TABLE[name]
    except KeyError:
        raise ManifestError(f"unknown dtype {name!r}; format v1 knows {sorted(TABLE)}") from None


def itemsize(name: str) -> int:
    """Bytes per element of the dtype called ``name``; :class:`ManifestError` if unknown."""
    return info(name).itemsize
