"""torch's side of the dtype table, and zero-copy integer ("word") views of tensor memory.

Derived from :data:`deltastore.format.dtypes.TABLE` (the one dtype table; names, sizes and
numpy words live there, without torch). A tensor's words are its elements' bits as integers
of the element size, viewed in place (same memory, no copy): little-endian, as the host is.

Every function takes a ``torch.Tensor`` or a :class:`~deltastore.tensors.host.HostTensor`
(whose dtype is already a format name and whose words are a numpy array) and imports torch
only when it needs torch's dtypes or is handed a torch tensor: the checkpoint-folder paths,
which hold host tensors, never load it. :data:`DTYPES` (torch dtype by format name) is built
on first use. Immutable tables; the functions are thread-safe (a view shares the tensor's
memory, so writing through it is as thread-safe as writing the tensor).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from deltastore.errors import ManifestError, TensorMismatchError
from deltastore.format.dtypes import NAMES, TABLE, signed_word_dtype, word_dtype
from deltastore.tensors.host import HostTensor, Tensor, Words

if TYPE_CHECKING:
    import torch


@functools.cache
def _torch_tables() -> tuple[
    dict[str, torch.dtype], dict[torch.dtype, str], dict[int, torch.dtype]
]:
    """torch dtype by format name (those this torch build has), format name by torch dtype,
    torch word dtype by size: the one place here that imports torch (on first use)."""
    import torch

    dtypes = {
        name: dt for name in NAMES if isinstance(dt := getattr(torch, name, None), torch.dtype)
    }
    words = {size: dtypes[signed_word_dtype(size).name] for size in (1, 2, 4, 8)}
    return dtypes, {dt: name for name, dt in dtypes.items()}, words


def __getattr__(name: str) -> Any:
    """:data:`DTYPES` (torch dtype by format name, for every format dtype this torch build
    has), built on first use so that importing this module imports no torch."""
    if name == "DTYPES":
        return _torch_tables()[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_from_name(name: str) -> torch.dtype:
    """Return the torch dtype called ``name``; :class:`ManifestError` if unknown (imports
    torch)."""
    dtypes = _torch_tables()[0]
    try:
        return dtypes[name]
    except KeyError:
        raise ManifestError(f"unknown dtype {name!r}; format v1 knows {sorted(dtypes)}") from None


def dtype_name(dtype: torch.dtype | str) -> str:
    """Return the format name of a torch dtype, or check one (a host tensor's ``dtype`` is
    already a name); :class:`TensorMismatchError` if unsupported."""
    if isinstance(dtype, str):
        if dtype in TABLE:
            return dtype
        raise TensorMismatchError(f"dtype {dtype!r} is not supported; use one of {sorted(TABLE)}")
    names = _torch_tables()[1]
    try:
        return names[dtype]
    except KeyError:
        raise TensorMismatchError(
            f"dtype {dtype} is not supported; use one of {sorted(_torch_tables()[0])}"
        ) from None


def torch_word_dtype(size: int) -> torch.dtype:
    """torch integer dtype of ``size`` bytes (1, 2, 4 or 8) used for index_select /
    index_copy_: ``uint8``, ``int16``, ``int32``, ``int64``."""
    return _torch_tables()[2][size]


def flat_words(t: Tensor) -> Words:
    """1-D integer view (same memory) of a contiguous tensor: a torch tensor of
    :func:`torch_word_dtype` for a torch tensor (on its device), the unsigned numpy words of a
    host tensor."""
    if isinstance(t, HostTensor):
        return t.words
    if not t.is_contiguous():
        raise TensorMismatchError(
            "deltastore applies changes in place and needs contiguous tensors; "
            "call .contiguous() on the tensor before handing it over"
        )
    return t.detach().reshape(-1).view(torch_word_dtype(t.element_size()))


def np_words(t: Tensor) -> np.ndarray:
    """1-D unsigned numpy view (same memory) of a contiguous CPU tensor or a host tensor."""
    if isinstance(t, HostTensor):
        return t.words
    if t.device.type != "cpu":
        raise TensorMismatchError(f"expected a CPU tensor, got one on {t.device}")
    words = cast("torch.Tensor", flat_words(t))  # a torch tensor's words are torch's
    out: np.ndarray = words.numpy().view(word_dtype(t.element_size()))
    return out


def host_words(t: Tensor) -> np.ndarray:
    """The unsigned words of ``t`` in host memory: a host tensor's own; a torch tensor's
    detached, copied to the CPU if it is on a device and made contiguous if it is not (a view
    of its memory when it already is both)."""
    if isinstance(t, HostTensor):
        return t.words
    return np_words(t.detach().cpu().contiguous())


class CastWords:
    """The words of ``tensor`` cast to ``dtype`` (1-D, element order, little-endian), made a
    slice at a time: what a writer publishes of weights kept in another dtype (float32 master
    weights published as bfloat16) without a cast copy of them all, frame by frame. A slice is
    a new array (a tensor on a device is copied to host memory a slice at a time too); the
    tensor must not change while a publish reads it. Thread-safe (each slice is its own)."""

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        self._flat = tensor.detach().reshape(-1)
        self._to = dtype
        self.size = int(self._flat.numel())
        self.dtype = word_dtype(dtype.itemsize)
        self.nbytes = self.size * dtype.itemsize

    def __getitem__(self, key: slice) -> np.ndarray:
        """The cast words of elements ``key`` (a slice of element positions)."""
        part = self._flat[key].to(device="cpu", dtype=self._to).contiguous()
        return np_words(part)

    def copy(self) -> np.ndarray:
        """All the cast words, as one array of their own."""
        return self[:]


class WordViews:
    """Each tensor's flat words (:func:`flat_words`; a CPU tensor's as the numpy view of its
    memory), made once per tensor object and reused while ``tensors[name]`` is that object:
    every torch call hands the GIL over, which costs up to a switch interval (5 ms) while
    another Python thread, an engine's scheduler, is running. A tensor whose memory moved
    (``param.data = ...``) gets a new view. Thread-safe (one dict entry per name, replaced
    whole)."""

    def __init__(self) -> None:
        self._views: dict[str, tuple[tuple[Any, int], Words]] = {}

    def __call__(self, tensors: Any, name: str) -> Words:
        t = tensors[name]
        # the object, and where its memory is now (``param.data = ...`` keeps the object)
        key = (t, t.words.ctypes.data if isinstance(t, HostTensor) else t.data_ptr())
        hit = self._views.get(name)
        if hit is not None and hit[0][0] is t and hit[0][1] == key[1]:
            return hit[1]
        words = flat_words(t)
        if not isinstance(words, np.ndarray) and words.device.type == "cpu":
            words = words.numpy()
        self._views[name] = (key, words)
        return words


__all__ = [
    "CastWords",
    "WordViews",
    "dtype_from_name",
    "dtype_name",
    "flat_words",
    "host_words",
    "np_words",
    "torch_word_dtype",
]
