"""The collectives a multi-rank receiver needs, over torch.distributed (gloo or NCCL).

Every rank of the group calls every method in the same order (they are collectives); a rank
with nothing to send still calls them with empty buffers. ``Group(None)`` is a group of one
whose methods are local no-ops, so single-process code takes the same path. Not thread-safe:
one thread per rank drives the collectives. Buffers travel as CPU tensors (gloo), or on the
group's device for NCCL (``device``). A group of one imports no torch (a receiver of host
tensors, such as a checkpoint folder's, never loads it).

A ``Group`` never keeps the process group alive: torch.distributed owns it (its registry holds
every group ``Group`` accepts) and ``destroy_process_group()`` frees it, which joins gloo's
threads, only when no other reference to it is left. A Subscriber held by a reference cycle (a
failed sync's exception and its traceback) or a caller keeping such an exception must not keep
those threads running into interpreter shutdown: a gloo worker thread drops its references to
the last collective's tensors after waking the caller, and takes the GIL to do so; if the
interpreter is finalizing by then, CPython ends the thread with ``pthread_exit`` inside a C++
destructor and the process dies of ``std::terminate`` (SIGABRT, "terminate called without an
active exception"). So the group is held through a weak reference, and the traceback of a
failed collective is stripped of the locals of torch's frames (they hold the group too).
"""

from __future__ import annotations

import traceback
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from deltastore.tensors.dtypes import dtype_from_name

if TYPE_CHECKING:
    import torch


class Group:
    """A process group (or none) with the few collectives a sync uses."""

    def __init__(self, group: Any | None = None, device: torch.device | None = None) -> None:
        self._ref: Callable[[], Any] | None = None
        self._device = device  # None in a group of one, which moves no buffers
        if group is None:  # a group of one imports no torch
            self.rank, self.world = 0, 1
            return
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; init_process_group first")
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._ref = _weak(group)
        if device is None:
            backend = dist.get_backend(group)
            self._device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")

    @property
    def _pg(self) -> Any:
        """The process group (None for a group of one); an error once it was destroyed."""
        if self._ref is None:
            return None
        group = self._ref()
        if group is None:
            raise RuntimeError(
                "the process group of this receiver was destroyed (destroy_process_group); "
                "create a new Subscriber with a live group"
            )
        return group

    def _collective(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """``fn(*args, **kwargs, group=...)``; on failure, the finished frames of the traceback
        (torch's, holding the group and the buffers) lose their locals, so a caller keeping
        the error does not keep the group alive."""
        try:
            fn(*args, **kwargs, group=self._pg)
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)
            raise

    def _to(self, a: np.ndarray) -> torch.Tensor:
        import torch

        return torch.from_numpy(np.ascontiguousarray(a)).to(self._device)

    def all_reduce_sum(self, values: np.ndarray) -> np.ndarray:
        """Element-wise sum of an int64 vector over all ranks."""
        if self._ref is None:
            return values
        import torch.distributed as dist

        t = self._to(values.astype(np.int64))
        self._collective(dist.all_reduce, t, op=dist.ReduceOp.SUM)
        out: np.ndarray = t.cpu().numpy()
        return out

    def broadcast_int(self, value: int, src: int = 0) -> int:
        """``value`` of group rank ``src`` on every rank."""
        if self._ref is None:
            return value
        import torch.distributed as dist

        t = self._to(np.array([value], dtype=np.int64))
        self._collective(dist.broadcast, t, src=dist.get_global_rank(self._pg, src))
        return int(t.cpu()[0])

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order (two collectives: sizes, then padded bytes)."""
        if self._ref is None:
            return [data]
        sizes = np.zeros(self.world, dtype=np.int64)
        sizes[self.rank] = len(data)
        sizes = self.all_reduce_sum(sizes)
        width = int(sizes.max(initial=0))
        buf = np.zeros((self.world, max(width, 1)), dtype=np.uint8)
        buf[self.rank, : len(data)] = np.frombuffer(data, dtype=np.uint8)
        gathered = self.all_reduce_sum(buf.reshape(-1).astype(np.int64)).reshape(self.world, -1)
        return [bytes(gathered[r, : sizes[r]].astype(np.uint8)) for r in range(self.world)]

    def all_to_all(
        self, sends: list[np.ndarray], dtype: np.dtype[Any], counts: np.ndarray
    ) -> list[np.ndarray]:
        """Send ``sends[r]`` (1-D, ``dtype``) to rank r; return what each rank sent here.

        ``counts`` is the ``[world]`` element count this rank receives from each rank (known
        from a first round of counts), so both rounds are fixed-size collectives.
        """
        if self._ref is None:
            return [sends[0]]
        import torch
        import torch.distributed as dist

        send = np.concatenate([s.astype(dtype, copy=False) for s in sends])
        recv = torch.empty(
            int(counts.sum()), dtype=dtype_from_name(np.dtype(dtype).name), device=self._device
        )
        self._collective(
            dist.all_to_all_single,
            recv,
            self._to(send),
            output_split_sizes=[int(c) for c in counts],
            input_split_sizes=[int(s.size) for s in sends],
        )
        flat: np.ndarray = recv.cpu().numpy()
        bounds = np.concatenate(([0], np.cumsum(counts)))
        return [flat[bounds[r] : bounds[r + 1]] for r in range(self.world)]

    def exchange_counts(self, counts: np.ndarray) -> np.ndarray:
        """Round 1: ``counts[r, :]`` is what this rank sends to rank r; returns ``[world, k]``
        of what each rank sends here."""
        if self._ref is None:
            return counts
        k = counts.shape[1]
        got = self.all_to_all(
            [counts[r] for r in range(self.world)], np.dtype(np.int64), np.full(self.world, k)
        )
        return np.stack(got)


def _weak(group: Any) -> Callable[[], Any]:
    """A weak reference to ``group`` (a strong one for the rare object that takes none)."""
    try:
        return weakref.ref(group)
    except TypeError:
        return lambda: group


__all__ = ["Group"]
