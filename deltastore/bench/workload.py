"""The benchmark workload: versions of a synthetic Qwen-like bf16 model made by real AdamW
steps, generated once and cached as flat files; benchmarks/README.md (Workload) describes it.

The weights come from the one AdamW generator, :class:`deltastore.testing.synthetic.AdamWTensor`
(fp32 masters, AdamW from its stationary state on seeded normal(0, 1) gradients, cast to bf16;
its module docstring says why the stationary start). ``warmup`` real steps come before the base
version. Generation goes tensor by tensor (one tensor's master and optimizer state at a time,
in buffers reused from tensor to tensor: 16 bytes per element of the largest tensor, ~5 GB for
the large model's embedding), writing each version's bf16 words into its own flat file.

Cache folder ``<workdir>/<size>-lr<lr>-seed<seed>-w<warmup>-v<versions>-ss/``: ``v000.bin`` (the
base), ``v001.bin`` ... (the measured versions; words of every tensor, in table order, no
padding), ``index.json`` (:class:`WorkloadIndex`: tensors, offsets, changed counts, digests)
and ``COMPLETE`` (SHA-256 of ``index.json``), written last: a folder without a matching marker
is generated again. Deterministic for a given spec (random streams depend on the seed, the
tensor's position and the step, not on threads); version ``i`` equals version ``i`` of an
:class:`~deltastore.testing.synthetic.AdamWTrajectory` with the same size, lr, seed and warm-up.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash
from pydantic import BaseModel, ConfigDict

from deltastore.bench.ops import Differ
from deltastore.testing.sizes import SIZES as SIZES
from deltastore.testing.sizes import ModelConfig
from deltastore.testing.synthetic import AdamWTensor

INDEX = "index.json"
MARKER = "COMPLETE"

Log = Callable[[str], None]


def default_workdir() -> Path:
    """``$XDG_CACHE_HOME/deltastore/bench`` (``~/.cache`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deltastore" / "bench"


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate: size name, learning rate, seed, warm-up steps, measured versions."""

    size: str = "large"
    lr: float = 1e-6
    seed: int = 0
    warmup: int = 1
    versions: int = 3

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"unknown size {self.size!r}; choose one of {sorted(SIZES)}")
        if self.versions < 1 or self.warmup < 0 or not self.lr > 0:
            raise ValueError("versions must be >= 1, warmup >= 0 and lr > 0")

    @property
    def config(self) -> ModelConfig:
        return SIZES[self.size]

    @property
    def key(self) -> str:
        """Cache folder name."""
        return f"{self.size}-lr{self.lr:g}-seed{self.seed}-w{self.warmup}-v{self.versions}-ss"


class TensorInfo(BaseModel):
    """One tensor of the flat files: name, shape, first element and element count."""

    model_config = ConfigDict(frozen=True)

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int


class WorkloadIndex(BaseModel):
    """``index.json`` of a cached workload."""

    model_config = ConfigDict(frozen=True)

    format: int = 1
    size: str
    lr: float
    seed: int
    warmup: int
    versions: int
    numel: int
    tensors: list[TensorInfo]
    #: Per file (base first): elements that differ from the previous file (0 for the base).
    changed: list[int]
    #: Per file: XXH3-64 (hex) of the file's bytes, i.e. of every tensor's words in order.
    digests: list[str]
    generate_s: float


class Workload:
    """A generated workload: flat int16 version files plus their index."""

    def __init__(self, folder: Path, index: WorkloadIndex) -> None:
        self.folder = folder
        self.index = index

    # --- cache ----------------------------------------------------------------------------

    @classmethod
    def load(cls, folder: str | os.PathLike[str]) -> Workload:
        """Open a complete cached workload; :class:`FileNotFoundError` otherwise."""
        folder = Path(folder)
        try:
            raw = (folder / INDEX).read_bytes()
            marker = (folder / MARKER).read_text().strip()
        except OSError as exc:
            raise FileNotFoundError(f"no complete workload in {folder}") from exc
        if marker != hashlib.sha256(raw).hexdigest():
            raise FileNotFoundError(f"{folder}: {MARKER} does not match {INDEX}")
        wl = cls(folder, WorkloadIndex.model_validate_json(raw))
        for i in range(wl.files):
            if not wl.path(i).is_file() or wl.path(i).stat().st_size != wl.dense_bytes:
                raise FileNotFoundError(f"{wl.path(i)} is missing or has the wrong size")
        return wl

    @classmethod
    def ensure(
        cls, spec: WorkloadSpec, workdir: str | os.PathLike[str] | None = None, log: Log = print
    ) -> tuple[Workload, bool]:
        """The cached workload of ``spec`` under ``workdir`` (default :func:`default_workdir`),
        generated first if missing or incomplete. Returns it and whether it was generated."""
        folder = Path(workdir).expanduser() if workdir is not None else default_workdir()
        folder = folder / spec.key
        try:
            return cls.load(folder), False
        except FileNotFoundError:
            pass
        log(
            f"generating workload {spec.key} ({spec.config.numel() / 1e6:.0f}M elements, "
            f"{spec.warmup + spec.versions} AdamW steps) in {folder}"
        )
        generate(spec, folder)
        return cls.load(folder), True

    # --- contents -------------------------------------------------------------------------

    @property
    def files(self) -> int:
        """Version files: the base and the measured versions."""
        return self.index.versions + 1

    @property
    def numel(self) -> int:
        return self.index.numel

    @property
    def dense_bytes(self) -> int:
        return 2 * self.index.numel

    def path(self, i: int) -> Path:
        return self.folder / f"v{i:03d}.bin"

    def words(self, i: int) -> np.ndarray:
        """Version ``i`` (0: base) as a read-only memory-mapped flat int16 array (zero-copy)."""
        return np.memmap(self.path(i), dtype=np.int16, mode="r", shape=(self.numel,))

    def read(self, i: int) -> np.ndarray:
        """Version ``i`` read into a new flat int16 array (anonymous memory, faulted in by the
        read itself)."""
        buf = np.empty(self.numel, dtype=np.int16)
        self.read_into(i, buf)
        return buf

    def read_into(self, i: int, buf: np.ndarray) -> None:
        """Read version ``i`` into ``buf`` (a flat int16 array of :attr:`numel` words)."""
        if buf.dtype != np.int16 or buf.shape != (self.numel,):
            raise ValueError("buf must be a flat int16 array of numel words")
        view = buf.data.cast("B")
        with open(self.path(i), "rb", buffering=0) as fh:
            done = 0
            while done < len(view):
                n = fh.readinto(view[done:])
                if not n:
                    raise EOFError(f"{self.path(i)} is shorter than {self.dense_bytes} bytes")
                done += n

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Name -> flat int16 view of that tensor's words in ``flat``."""
        return {t.name: flat[t.offset : t.offset + t.numel] for t in self.index.tensors}

    def tensors(self, flat: np.ndarray) -> dict[str, torch.Tensor]:
        """Name -> bf16 tensor of its shape, a zero-copy view of ``flat`` (writable arrays)."""
        return {
            t.name: torch.from_numpy(flat[t.offset : t.offset + t.numel])
            .view(torch.bfloat16)
            .view(t.shape)
            for t in self.index.tensors
        }

    def changed_fraction(self, i: int) -> float:
        """Share of elements of version ``i`` that differ from version ``i - 1``."""
        return self.index.changed[i] / self.numel


# --- generation ------------------------------------------------------------------------------


def _layout(config: ModelConfig) -> list[TensorInfo]:
    out, offset = [], 0
    for name, shape in config.shapes().items():
        n = math.prod(shape)
        out.append(TensorInfo(name=name, shape=tuple(shape), offset=offset, numel=n))
        offset += n
    return out


class _Arena:
    """Buffers reused for every tensor (fresh multi-GB allocations page-fault at ~0.5-2 GB/s):
    fp32 master, gradient and Adam moments, and the bf16 words of two consecutive versions."""

    def __init__(self, numel: int) -> None:
        self.f32 = [np.zeros(numel, dtype=np.float32) for _ in range(4)]
        self.words = [np.zeros(numel, dtype=np.int16) for _ in range(2)]

    def versions(
        self, spec: WorkloadSpec, index: int, info: TensorInfo, pool: ThreadPoolExecutor
    ) -> Iterator[np.ndarray]:
        """The bf16 words of one tensor at the base and after each measured step (the array
        yielded is overwritten two steps later)."""
        tensor = AdamWTensor(
            info.name,
            info.shape,
            position=index,
            lr=spec.lr,
            seed=spec.seed,
            buffers=self.f32,
            pool=pool,
        )
        for step in range(spec.warmup + spec.versions + 1):
            if step > 0:
                tensor.step()
            if step >= spec.warmup:
                words = self.words[step % 2][: info.numel]
                tensor.bf16_into(words)
                yield words


def generate(spec: WorkloadSpec, folder: Path) -> WorkloadIndex:
    """Generate ``spec`` into ``folder`` (replacing whatever is there); returns its index."""
    t0 = time.perf_counter()
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    layout = _layout(spec.config)
    numel = sum(t.numel for t in layout)
    files = spec.versions + 1
    handles = [open(folder / f"v{i:03d}.bin", "wb") for i in range(files)]  # noqa: SIM115
    hashes = [xxhash.xxh3_64() for _ in range(files)]
    changed = [0] * files
    differ = Differ()
    arena = _Arena(max(t.numel for t in layout))
    threads = torch.get_num_threads()
    # One torch thread: the fused AdamW kernel pays ~8 ms per call in thread barriers with
    # two (most tensors are small); the random numbers use the thread pool instead.
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
            for position, info in enumerate(layout):
                prev: np.ndarray | None = None
                for i, words in enumerate(arena.versions(spec, position, info, pool)):
                    data = words.data.cast("B")
                    handles[i].write(data)  # tensors in table order: the files stay flat
                    hashes[i].update(data)
                    if prev is not None:
                        changed[i] += differ.count(prev, words)
                    prev = words
    finally:
        torch.set_num_threads(threads)
        for fh in handles:
            fh.close()
    index = WorkloadIndex(
        size=spec.size,
        lr=spec.lr,
        seed=spec.seed,
        warmup=spec.warmup,
        versions=spec.versions,
        numel=numel,
        tensors=layout,
        changed=changed,
        digests=[h.hexdigest() for h in hashes],
        generate_s=time.perf_counter() - t0,
    )
    raw = json.dumps(index.model_dump(mode="json"), indent=1).encode()
    (folder / INDEX).write_bytes(raw)
    (folder / MARKER).write_text(hashlib.sha256(raw).hexdigest() + "\n")
    return index
