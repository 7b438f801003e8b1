"""The collectives a multi-rank receiver needs, over torch.distributed (gloo or NCCL).

Every rank of the group calls every method in the same order (they are collectives); a rank
with nothing to send still calls them with empty buffers. ``Group(None)`` is a group of one
whose methods are local no-ops, so single-process code takes the same path. Not thread-safe:
one thread per rank drives the collectives. Buffers travel as CPU tensors (gloo), or on the
group's device for NCCL (``device``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist


class Group:
    """A process group (or none) with the few collectives a sync uses."""

    def __init__(self, group: Any | None = None, device: torch.device | None = None) -> None:
        self._pg = group
        if group is None:
            self.rank, self.world = 0, 1
        else:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError("torch.distributed is not initialized; init_process_group first")
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if device is None:
            backend = dist.get_backend(group) if group is not None else "gloo"
            device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
        self._device = device

    def _to(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self._device)

    def all_reduce_sum(self, values: np.ndarray) -> np.ndarray:
        """Element-wise sum of an int64 vector over all ranks."""
        if self._pg is None:
            return values
        t = self._to(values.astype(np.int64))
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._pg)
        out: np.ndarray = t.cpu().numpy()
        return out

    def broadcast_int(self, value: int, src: int = 0) -> int:
        """``value`` of group rank ``src`` on every rank."""
        if self._pg is None:
            return value
        t = self._to(np.array([value], dtype=np.int64))
        dist.broadcast(t, src=dist.get_global_rank(self._pg, src), group=self._pg)
        return int(t.cpu()[0])

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order (two collectives: sizes, then padded bytes)."""
        if self._pg is None:
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
        if self._pg is None:
            return [sends[0]]
        send = np.concatenate([s.astype(dtype, copy=False) for s in sends])
        recv = torch.empty(int(counts.sum()), dtype=_torch_dtype(dtype), device=self._device)
        dist.all_to_all_single(
            recv,
            self._to(send),
            output_split_sizes=[int(c) for c in counts],
            input_split_sizes=[int(s.size) for s in sends],
            group=self._pg,
        )
        flat: np.ndarray = recv.cpu().numpy()
        bounds = np.concatenate(([0], np.cumsum(counts)))
        return [flat[bounds[r] : bounds[r + 1]] for r in range(self.world)]

    def exchange_counts(self, counts: np.ndarray) -> np.ndarray:
        """Round 1: ``counts[r, :]`` is what this rank sends to rank r; returns ``[world, k]``
        of what each rank sends here."""
        if self._pg is None:
            return counts
        k = counts.shape[1]
        got = self.all_to_all(
            [counts[r] for r in range(self.world)], np.dtype(np.int64), np.full(self.world, k)
        )
        return np.stack(got)


def _torch_dtype(dtype: np.dtype[Any]) -> torch.dtype:
    return {np.dtype(np.int64): torch.int64, np.dtype(np.uint8): torch.uint8}[np.dtype(dtype)]


__all__ = ["Group"]
