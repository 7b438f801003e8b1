"""Safetensors checkpoint folders as memory-mapped tensors: read for publish, write in place.

A checkpoint is one ``.safetensors`` file or an HF-style folder (``model.safetensors`` or
``model.safetensors.index.json`` + shards). Tensors are ``numpy.memmap`` views of the files, as
:class:`~deltastore.tensors.host.HostTensor` s (numpy words; this module imports no torch), or
wrapped by torch without copying on request: nothing is read into RAM until touched, and
writes to a writable view land in the file (the page cache) in place.

Tensor data need not be aligned to its dtype (safetensors does not require it; other writers
than deltastore may leave a header whose length is not a multiple of 8). A read-only map gives
an unaligned tensor as an aligned in-memory copy of its bytes (the only tensors read into RAM
up front); a writable map gives it as a view of the file's bytes at their unaligned address,
so writes still land in the file in place (torch and numpy read and write unaligned CPU memory
correctly). Files deltastore creates are always aligned.

File layout (safetensors): ``<u64 LE header length N><N bytes JSON header><data>``; the header
maps each name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` relative to the data.

Not thread-safe for writes to the same folder; call order for in-place updates: open writable
tensors, modify them, :func:`flush`, then record the new state.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from deltastore.errors import CheckpointError
from deltastore.format.dtypes import SAFETENSORS_CODES, SAFETENSORS_NAMES, itemsize, word_dtype
from deltastore.store.space import disk_full, is_disk_full, reserve
from deltastore.tensors.dtypes import dtype_name
from deltastore.tensors.host import HostTensor, Tensors

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's bytes live: absolute byte range ``[start, stop)`` of ``path``."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int


def checkpoint_files(src: str | os.PathLike[str]) -> list[Path]:
    """The ``.safetensors`` files of a checkpoint file or folder, in index order."""
    path = Path(src)
    if path.is_file():
        return [path]
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a safetensors index ({exc})") from None
        for n in names:  # names from the file, not the user: none may leave the folder
            if not isinstance(n, str) or not n or Path(n).is_absolute() or ".." in Path(n).parts:
                raise CheckpointError(
                    f"{index} names shard {n!r}, which is not a file inside {path}: an index "
                    "names its shards relative to its folder"
                )
        files = [path / n for n in names]
    elif (path / SINGLE_NAME).is_file():
        files = [path / SINGLE_NAME]
    elif path.is_dir():
        files = sorted(path.glob("*.safetensors"))
    else:
        raise CheckpointError(f"{path} is neither a .safetensors file nor a checkpoint folder")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
    if not files:
        raise CheckpointError(f"{path} holds no .safetensors file")
    return files


def read_header(path: Path) -> dict[str, TensorLocation]:
    """Parse one safetensors file's header into tensor locations (validated)."""
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: header of {n} bytes is too large")
            header = json.loads(fh.read(n))
            size = os.fstat(fh.fileno()).st_size
    except (OSError, struct.error, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    base = 8 + n
    out: dict[str, TensorLocation] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_NAMES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"{path}: tensor {name!r} has an unsupported entry {info!r}"
            ) from None
        nbytes = math.prod(shape) * itemsize(dtype)
        if end - begin != nbytes or begin < 0 or base + end > size:
            raise CheckpointError(f"{path}: tensor {name!r} has inconsistent data_offsets")
        out[name] = TensorLocation(path, dtype, shape, base + begin, base + end)
    return out


def locate(src: str | os.PathLike[str]) -> dict[str, TensorLocation]:
    """Every tensor of a checkpoint file or folder; duplicates across shards are an error."""
    out: dict[str, TensorLocation] = {}
    for f in checkpoint_files(src):
        for name, loc in read_header(f).items():
            if name in out:
                raise CheckpointError(f"tensor {name!r} is in both {out[name].path} and {f}")
            out[name] = loc
    return out


class MappedCheckpoint:
    """Memory-mapped tensors over checkpoint files (zero-copy).

    :attr:`host`: the tensors as :class:`~deltastore.tensors.host.HostTensor` s (numpy words
    over the maps; no torch), what the folder paths use. :attr:`tensors`: the same memory as
    torch tensors (imports torch on first use).

    ``writable=True`` maps the files shared read-write: writes to the tensors go to the
    files; call :meth:`flush` to push them to disk. Read-only maps are copy-on-write, so the
    files never change even if a tensor is written. A tensor whose data is not aligned to its
    dtype is an aligned copy of its bytes in a read-only map, and a view of the file's bytes
    at their unaligned address in a writable one (see the module docstring).
    """

    def __init__(self, locations: Mapping[str, TensorLocation], *, writable: bool = False) -> None:
        self._maps: dict[Path, np.memmap] = {}
        self.host: dict[str, HostTensor] = {}
        self._torch: dict[str, torch.Tensor] | None = None
        for name, loc in locations.items():
            word = word_dtype(itemsize(loc.dtype))
            if loc.stop == loc.start:
                self.host[name] = HostTensor(np.empty(0, dtype=word), loc.dtype, loc.shape)
                continue
            if loc.path not in self._maps:
                self._maps[loc.path] = np.memmap(
                    loc.path, dtype=np.uint8, mode="r+" if writable else "c"
                )
            raw = self._maps[loc.path][loc.start : loc.stop]
            if loc.start % word.itemsize and not writable:
                raw = np.array(raw)  # a fresh buffer: aligned (numpy aligns to 16 bytes or more)
            # a plain ndarray over the map (the memmap subclass slows every index operation)
            self.host[name] = HostTensor(np.asarray(raw).view(word), loc.dtype, loc.shape)

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as torch tensors over the same memory as :attr:`host` (no copy; torch
        is imported on first use)."""
        if self._torch is None:
            self._torch = {name: t.torch() for name, t in self.host.items()}
        return self._torch

    def flush(self) -> None:
        """Write dirty pages of every mapped file to disk (msync)."""
        for m in self._maps.values():
            m.flush()


def create_checkpoint(
    dest: str | os.PathLike[str],
    table: Mapping[str, tuple[str, tuple[int, ...]]],
    *,
    max_shard_bytes: int = 5 << 30,
) -> dict[str, TensorLocation]:
    """Create zero-filled safetensors files in ``dest`` for ``table``, their disk blocks
    reserved (:func:`deltastore.store.space.reserve`), so that writing the tensors through a
    writable :class:`MappedCheckpoint` cannot fail for lack of space.

    One ``model.safetensors`` when everything fits in ``max_shard_bytes``, otherwise shards
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``. Tensors are
    ordered by element size (largest first), then name, so every tensor is aligned.

    Raises :class:`~deltastore.errors.DiskFullError` (naming ``dest``, the bytes every file
    needs and the bytes free) when the file system has no room (``ENOSPC``, ``EDQUOT``); on
    any error the files this call created are removed again (``dest`` itself is left).
    """
    unsupported = sorted({dtype for dtype, _ in table.values() if dtype not in SAFETENSORS_CODES})
    if unsupported:
        raise CheckpointError(
            f"safetensors cannot store dtypes {unsupported}; pull this store with the Python API "
            "(Subscriber) instead of into a checkpoint folder"
        )
    folder = Path(dest)
    folder.mkdir(parents=True, exist_ok=True)
    order = sorted(table, key=lambda n: (-itemsize(table[n][0]), n))
    shards: list[list[str]] = [[]]
    used = 0
    for name in order:
        dtype, shape = table[name]
        nbytes = math.prod(shape) * itemsize(dtype)
        if shards[-1] and used + nbytes > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    names = (
        [SINGLE_NAME]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    files = [
        (folder / fname, _header({n: table[n] for n in members}))
        for fname, members in zip(names, shards, strict=True)
    ]
    needed = sum(len(head) + data for _, (head, data) in files)
    created: list[Path] = []
    out: dict[str, TensorLocation] = {}
    try:
        for path, (head, data) in files:
            created.append(path)
            _write_reserved(path, head, data)
            out |= read_header(path)
        if len(shards) > 1:
            index = {
                "metadata": {"total_size": sum(loc.stop - loc.start for loc in out.values())},
                "weight_map": {n: out[n].path.name for n in sorted(out)},
            }
            created.append(folder / INDEX_NAME)
            (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    except BaseException as exc:
        for path in created:
            path.unlink(missing_ok=True)
        if isinstance(exc, OSError) and is_disk_full(exc):
            raise disk_full(
                folder,
                exc,
                needed=needed,
                what=f"a checkpoint of {len(table)} tensors",
                todo="free space or pull into a folder on another disk, then pull again",
            ) from None
        raise
    return out


def _header(table: Mapping[str, tuple[str, tuple[int, ...]]]) -> tuple[bytes, int]:
    """The safetensors header of ``table`` (length prefix included, padded to 8 bytes) and
    the number of data bytes after it."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in table.items():
        nbytes = math.prod(shape) * itemsize(dtype)
        header[name] = {
            "dtype": SAFETENSORS_CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset


def _write_reserved(path: Path, head: bytes, data: int) -> None:
    """Write ``head`` then ``data`` zero bytes, every block reserved (no hole)."""
    with open(path, "wb") as fh:
        fh.write(head)
        fh.flush()
        reserve(fh.fileno(), len(head), data)
        fh.truncate(len(head) + data)  # the size, whichever way the blocks were reserved


def table_of(tensors: Tensors) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``name -> (dtype name, shape)`` of a mapping of torch or host tensors."""
    return {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()}


__all__ = [
    "CheckpointError",
    "MappedCheckpoint",
    "TensorLocation",
    "checkpoint_files",
    "create_checkpoint",
    "locate",
    "read_header",
    "table_of",
]
