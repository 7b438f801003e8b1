"""Tensor dtypes by name, and zero-copy integer ("word") views of tensor memory.

deltastore never compares or moves tensor data as floats: every element is handled as an
unsigned little-endian integer of the dtype's size (a *word*), so NaN payloads, -0.0, inf and
subnormals round-trip bit-exactly. Dtype names are torch's (``bfloat16``, ``float32``...).
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from deltastore.errors import DeltastoreError, ManifestError, TensorMismatchError

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI machine
    raise DeltastoreError(
        "deltastore needs a little-endian host: format v1 stores tensors little-endian "
        "and views tensor memory without byte swapping"
    )

_NAMES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
)

#: torch dtype by format name, for every dtype this torch build has.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in _NAMES
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_NAME_OF: dict[torch.dtype, str] = {dt: name for name, dt in DTYPES.items()}

#: torch integer dtype used for gather/scatter of words of each size (bytes).
_TORCH_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_from_name(name: str) -> torch.dtype:
    """Return the torch dtype called ``name``; :class:`ManifestError` if unknown."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ManifestError(f"unknown dtype {name!r}; format v1 knows {sorted(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """Return the format name of ``dtype``; :class:`TensorMismatchError` if unsupported."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise TensorMismatchError(
            f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}"
        ) from None


def itemsize(name: str) -> int:
    """Bytes per element of the dtype called ``name``."""
    return dtype_from_name(name).itemsize


def word_dtype(size: int) -> np.dtype[np.unsignedinteger]:
    """numpy unsigned little-endian integer dtype of ``size`` bytes (1, 2, 4 or 8)."""
    return np.dtype(f"<u{size}")


def torch_word_dtype(size: int) -> torch.dtype:
    """torch integer dtype of ``size`` bytes used for index_select / index_copy_."""
    return _TORCH_WORD[size]


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
