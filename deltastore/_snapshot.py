"""Where a publisher keeps the words of the last published version (its parent for XOR).

``memory``: copies in host RAM. ``disk``: one memory-mapped file ``snapshot.bin`` in a state
folder plus ``state.json`` (version, state digest, per-tensor layout and checksums), so a
restarted publisher continues without re-reading the parent and without a copy in RAM.

Update protocol (crash-safe): `begin_update` marks the state dirty, the
caller changes words in place or calls `replace`, then
`commit` records the new clean state atomically. A dirty or missing
``state.json`` means "no saved state". Single writer; not thread-safe.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deltastore.checksum import adler32
from deltastore.dtypes import itemsize, word_dtype

STATE_FORMAT = 1


@dataclass
class TensorState:
    """Publisher-side memory of one tensor at the last published version."""

    dtype: str
    shape: list[int]
    words: np.ndarray  # unsigned little-endian words of the published version
    frame_adler: list[int]
    adler: int


@dataclass
class SavedState:
    """What a snapshot store remembers across restarts."""

    store: str
    version: int
    state_digest: str
    max_frame_bytes: int
    tensors: dict[str, TensorState]


class MemorySnapshot:
    """Copies in RAM; nothing survives the process. Base of the other snapshot stores."""

    def replace(self, words: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """New storage holding copies of ``words``; returns the stored arrays."""
        return {n: w.copy() for n, w in words.items()}

    def begin_update(self) -> None:
        """Mark the saved state as being changed (nothing is saved in memory)."""

    def commit(self, state: SavedState) -> None:
        """Record ``state`` as the clean saved state (nothing is saved in memory)."""

    def load(self) -> SavedState | None:
        """The saved clean state, or None."""
        return None


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class DiskSnapshot(MemorySnapshot):
    """``snapshot.bin`` (memory-mapped words, 64-byte aligned per tensor) + ``state.json``."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.dir = Path(state_dir).expanduser()
        self._state_file = self.dir / "state.json"
        self._data_file = self.dir / "snapshot.bin"
        self._offsets: dict[str, int] = {}
        self._map: np.memmap | None = None

    def begin_update(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(self._state_file, {"format": STATE_FORMAT, "dirty": True})

    def replace(self, words: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.dir.mkdir(parents=True, exist_ok=True)
        offsets, total = {}, 0
        for name, w in words.items():
            offsets[name] = total
            total += -(-w.nbytes // 64) * 64
        tmp = self.dir / f".snapshot.{uuid.uuid4().hex}"
        with open(tmp, "wb") as fh:
            fh.truncate(max(total, 1))
        new = np.memmap(tmp, dtype=np.uint8, mode="r+")
        out = {}
        for name, w in words.items():
            view = new[offsets[name] : offsets[name] + w.nbytes].view(w.dtype)
            view[:] = w
            out[name] = view
        new.flush()
        os.replace(tmp, self._data_file)
        self._map, self._offsets = new, offsets
        return out

    def commit(self, state: SavedState) -> None:
        if self._map is not None:
            self._map.flush()
        tensors = {
            name: {
                "dtype": t.dtype,
                "shape": t.shape,
                "offset": self._offsets[name],
                "adler32": t.adler,
                "frame_adler32": t.frame_adler,
            }
            for name, t in state.tensors.items()
        }
        _write_json_atomic(
            self._state_file,
            {
                "format": STATE_FORMAT,
                "dirty": False,
                "store": state.store,
                "version": state.version,
                "state_digest": state.state_digest,
                "max_frame_bytes": state.max_frame_bytes,
                "tensors": tensors,
            },
        )

    def load(self) -> SavedState | None:
        try:
            meta = json.loads(self._state_file.read_text())
            if meta.get("format") != STATE_FORMAT or meta.get("dirty", True):
                return None
            data = np.memmap(self._data_file, dtype=np.uint8, mode="r+")
            tensors: dict[str, TensorState] = {}
            offsets: dict[str, int] = {}
            for name, t in meta["tensors"].items():
                size = itemsize(t["dtype"])
                count = int(np.prod(t["shape"], dtype=np.int64))
                start = int(t["offset"])
                if start + count * size > data.size:
                    return None
                words = data[start : start + count * size].view(word_dtype(size))
                if adler32(words) != int(t["adler32"]):  # a damaged snapshot would poison deltas
                    return None
                tensors[name] = TensorState(
                    t["dtype"], list(t["shape"]), words, list(t["frame_adler32"]), int(t["adler32"])
                )
                offsets[name] = start
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self._map, self._offsets = data, offsets
        return SavedState(
            store=str(meta["store"]),
            version=int(meta["version"]),
            state_digest=str(meta["state_digest"]),
            max_frame_bytes=int(meta["max_frame_bytes"]),
            tensors=tensors,
        )
