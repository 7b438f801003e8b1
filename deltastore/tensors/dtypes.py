"""torch's side of the dtype table: torch dtypes by format name, and zero-copy integer
("word") views of tensor memory.

Derived from :data:`deltastore.format.dtypes.TABLE` (the one dtype table; names, sizes and
numpy words live there, without torch). A tensor's words are its elements' bits as integers
of the element size, viewed in place (same memory, no copy): little-endian, as the host is.
Immutable tables; the functions are thread-safe (a view shares the tensor's memory, so
writing through it is as thread-safe as writing the tensor).
"""

from __future__ import annotations

from typing import Final

import numpy as np
import torch

from deltastore.errors import ManifestError, TensorMismatchError
from deltastore.format.dtypes import NAMES, signed_word_dtype, word_dtype

#: torch dtype by format name, for every format dtype this torch build has.
DTYPES: Final[dict[str, torch.dtype]] = {
    name: dt for name in NAMES if isinstance(dt := getattr(torch, name, None), torch.dtype)
}
_NAME_OF: Final[dict[torch.dtype, str]] = {dt: name for name, dt in DTYPES.items()}
#: torch integer dtype holding words of each size (bytes): the dtypes torch indexes
#: (``index_select`` / ``index_copy_``) and numpy shares memory with.
_WORDS: Final[dict[int, torch.dtype]] = {
    size: DTYPES[signed_word_dtype(size).name] for size in (1, 2, 4, 8)
}


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


def torch_word_dtype(size: int) -> torch.dtype:
    """torch integer dtype of ``size`` bytes (1, 2, 4 or 8) used for index_select /
    index_copy_: ``uint8``, ``int16``, ``int32``, ``int64``."""
    return _WORDS[size]


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
