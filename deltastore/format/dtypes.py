"""Tensor dtypes by name, and zero-copy integer ("word") views of tensor memory.

deltastore never compares or moves tensor data as floats: every element is handled as an
unsigned little-endian integer of the dtype's size (a *word*), so NaN payloads, -0.0, inf and
subnormals round-trip bit-exactly. Dtype names are torch's (``bfloat16``, ``float32``...).

Names and sizes (:func:`itemsize`, :func:`word_dtype`) need only numpy, so code that reads
manifests (``deltastore log``, ``show``, ``verify``) never imports torch; the torch dtypes
(:func:`dtype_from_name`, :data:`DTYPES`, the tensor views) import it on first use.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from deltastore.errors import DeltastoreError, ManifestError, TensorMismatchError

if TYPE_CHECKING:
    import torch

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI machine
    raise DeltastoreError(
        "deltastore needs a little-endian host: format v1 stores tensors little-endian "
        "and views tensor memory without byte swapping"
    )

#: Bytes per element of every dtype format v1 names (torch's names).
ITEMSIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}
_NAMES = tuple(ITEMSIZES)

if TYPE_CHECKING:
    #: torch dtype by format name, for every dtype this torch build has (imports torch on
    #: first access).
    DTYPES: dict[str, torch.dtype]


@functools.cache
def _tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, str]]:
    """``(name -> torch dtype, torch dtype -> name)``, built on first use (imports torch)."""
    import torch

    by_name = {
        name: dt for name in _NAMES if isinstance(dt := getattr(torch, name, None), torch.dtype)
    }
    return by_name, {dt: name for name, dt in by_name.items()}


@functools.cache
def _torch_words() -> dict[int, torch.dtype]:
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


if not TYPE_CHECKING:

    def __getattr__(name: str) -> Any:  # PEP 562: DTYPES without importing torch up front
        if name == "DTYPES":
            return _tables()[0]
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_from_name(name: str) -> torch.dtype:
    """Return the torch dtype called ``name``; :class:`ManifestError` if unknown."""
    by_name = _tables()[0]
    try:
        return by_name[name]
    except KeyError:
        raise ManifestError(f"unknown dtype {name!r}; format v1 knows {sorted(by_name)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """Return the format name of ``dtype``; :class:`TensorMismatchError` if unsupported."""
    by_name, name_of = _tables()
    try:
        return name_of[dtype]
    except KeyError:
        raise TensorMismatchError(
            f"dtype {dtype} is not supported; use one of {sorted(by_name)}"
        ) from None


def itemsize(name: str) -> int:
    """Bytes per element of the dtype called ``name`` (no torch needed)."""
    try:
        return ITEMSIZES[name]
    except KeyError:
        raise ManifestError(
            f"unknown dtype {name!r}; format v1 knows {sorted(ITEMSIZES)}"
        ) from None


def word_dtype(size: int) -> np.dtype[np.unsignedinteger]:
    """numpy unsigned little-endian integer dtype of ``size`` bytes (1, 2, 4 or 8)."""
    return np.dtype(f"<u{size}")


def torch_word_dtype(size: int) -> torch.dtype:
    """torch integer dtype of ``size`` bytes used for index_select / index_copy_."""
    return _torch_words()[size]


def flat_words(t: torch.Tensor) -> torch.Tensor:
    """1-D integer view (same memory) of a contiguous tensor; see :func:`torch_word_dtype`."""
    if not t.is_contiguous():
        raise TensorMismatchError(
            "deltastore applies changes in place and needs contiguous tensors; "
            "call .contiguous() on the tensor before handing it over"
        )
    return t.detach().reshape(-1).view(torch_word_dtype(t.element_size()))


def np_words(t: torch.Tensor) -> np.ndarray:
    """1-D unsigned numpy view (same memory) of a contiguous CPU tensor."""
    if t.device.type != "cpu":
        raise TensorMismatchError(f"expected a CPU tensor, got one on {t.device}")
    return flat_words(t).numpy().view(word_dtype(t.element_size()))
