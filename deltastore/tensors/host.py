"""Tensors in host memory without torch: a numpy array of words, a dtype name and a shape.

A :class:`HostTensor` is what the checkpoint-folder paths hand to the publisher and the
subscriber (``deltastore publish`` / ``pull`` / ``verify --checkout`` and
:mod:`deltastore.checkpoint.folders`), so that those never import torch: the elements are
held as unsigned little-endian integers of the element size (*words*, as everywhere in
deltastore; bfloat16 and the float8 dtypes have no numpy dtype) in a 1-D numpy array, often a
view of a memory-mapped file, and the dtype is the format's name (``"bfloat16"``...). Writes
to the words land in the array's memory (a writable file map: in the file) in place.

:data:`Tensor` is what the tensor layer accepts: a ``torch.Tensor`` or a :class:`HostTensor`.
The functions of :mod:`deltastore.tensors.dtypes` and :mod:`deltastore.tensors.words` take
either and import torch only when handed a torch tensor. Immutable (the words are not: a
``HostTensor`` is as thread-safe as writing its array).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from deltastore.errors import TensorMismatchError
from deltastore.format.dtypes import info

if TYPE_CHECKING:
    import torch
    from typing_extensions import TypeVar

    #: The kind of tensors a :class:`~deltastore.sync.subscriber.Subscriber` holds: torch's
    #: (the default, also of one that allocates its own) or host tensors.
    TensorT = TypeVar("TensorT", bound="torch.Tensor | HostTensor", default="torch.Tensor")
else:
    TensorT = typing.TypeVar("TensorT")

#: A tensor the tensor layer accepts: torch's (CPU or device) or a :class:`HostTensor`.
Tensor: TypeAlias = "torch.Tensor | HostTensor"
#: Read-only tensors by name, of either kind.
Tensors: TypeAlias = "Mapping[str, torch.Tensor | HostTensor]"
#: A tensor's words as :func:`deltastore.tensors.dtypes.flat_words` gives them: a 1-D integer
#: torch tensor (CPU or device) for a torch tensor, the numpy words of a host tensor.
Words: TypeAlias = "torch.Tensor | np.ndarray"


@dataclass(frozen=True, eq=False)
class HostTensor:
    """A contiguous tensor in host memory, held as words (no torch).

    ``words``: 1-D numpy array of the elements' bits as unsigned little-endian integers of the
    element size (``uint8``/``uint16``/``uint32``/``uint64``), one per element, C order; it may
    be a view of a memory map (also at an unaligned address: numpy reads and writes those).
    ``dtype``: the format's dtype name; ``shape``: the tensor's shape. Raises
    :class:`~deltastore.errors.TensorMismatchError` when the three do not fit together.
    """

    words: np.ndarray
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        word = info(self.dtype).word
        w = self.words
        if w.ndim != 1 or w.dtype != word or w.size != math.prod(self.shape):
            raise TensorMismatchError(
                f"a {self.dtype}{list(self.shape)} host tensor needs 1-D {word} words, one per "
                f"element; got {w.dtype}{list(w.shape)}"
            )
        if not w.flags.c_contiguous:
            raise TensorMismatchError("a host tensor's words must be contiguous")

    @classmethod
    def zeros(cls, dtype: str, shape: tuple[int, ...]) -> HostTensor:
        """A new zero-filled tensor (all bits 0)."""
        return cls(np.zeros(math.prod(shape), dtype=info(dtype).word), dtype, tuple(shape))

    def element_size(self) -> int:
        """Bytes per element."""
        return int(self.words.dtype.itemsize)

    def numel(self) -> int:
        """Number of elements."""
        return int(self.words.size)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return int(self.words.nbytes)

    def is_contiguous(self) -> bool:
        """Always True (as ``torch.Tensor.is_contiguous``, for code that takes either)."""
        return True

    def torch(self) -> torch.Tensor:
        """The same memory as a ``torch.Tensor`` of :attr:`dtype` and :attr:`shape` (imports
        torch; no copy: writes through either show in the other)."""
        import torch

        from deltastore.tensors.dtypes import dtype_from_name

        raw = self.words.view(np.uint8)  # bytes: torch takes them at any address
        return torch.from_numpy(raw).view(dtype_from_name(self.dtype)).reshape(self.shape)


__all__ = ["HostTensor", "Tensor", "TensorT", "Tensors", "Words"]
