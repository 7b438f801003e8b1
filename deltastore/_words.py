"""Gather and scatter of words (unsigned element bits) in local tensors, CPU or device.

Positions are int32 or int64 flat element indices; values are unsigned little-endian words. Not
thread-safe for writes to the same tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

#: One write: words of a tensor (1-D), int32/int64 positions in it, XOR masks to apply there.
MaskWrite = tuple[torch.Tensor, np.ndarray, np.ndarray]
Scatter = Callable[[torch.Tensor, np.ndarray, np.ndarray], None]


def signed(size: int) -> np.dtype[Any]:
    return np.dtype(f"<i{size}") if size > 1 else np.dtype(np.uint8)


def gather(local: torch.Tensor, positions: np.ndarray, wdt: np.dtype[Any]) -> np.ndarray:
    if local.device.type == "cpu":
        out: np.ndarray = local.numpy().view(wdt)[positions]
        return out
    idx = torch.from_numpy(positions).to(local.device, torch.int64)
    return local.index_select(0, idx).cpu().numpy().view(wdt)


def gather_range(local: torch.Tensor, start: int, count: int, wdt: np.dtype[Any]) -> np.ndarray:
    if local.device.type == "cpu":
        out: np.ndarray = local.numpy().view(wdt)[start : start + count]
        return out
    return local[start : start + count].cpu().numpy().view(wdt)


def scatter(local: torch.Tensor, positions: np.ndarray, values: np.ndarray) -> None:
    if local.device.type == "cpu":
        local.numpy().view(values.dtype)[positions] = values
        return
    idx = torch.from_numpy(positions).to(local.device, torch.int64)
    vals = torch.from_numpy(values.view(signed(values.dtype.itemsize))).to(local.device)
    local.index_copy_(0, idx, vals)


def scatter_range(local: torch.Tensor, start: int, values: np.ndarray) -> None:
    """Write ``values`` (unsigned words) to elements ``[start, start + len(values))``."""
    if local.device.type == "cpu":
        local.numpy().view(values.dtype)[start : start + values.size] = values
        return
    vals = torch.from_numpy(values.view(signed(values.dtype.itemsize)))
    local[start : start + values.size].copy_(vals)


def apply_masks(writes: Sequence[MaskWrite], scatter_fn: Scatter = scatter) -> None:
    """XOR each write's masks into its words, all or nothing: if a write fails, the words
    written so far (that write's included) are restored before the error is re-raised.

    Only masks are kept between verification and writing (XOR is its own inverse), so staged
    changes cost a position and a mask per changed element."""
    done = 0
    try:
        for local, pos, masks in writes:
            old = gather(local, pos, masks.dtype)
            try:
                scatter_fn(local, pos, old ^ masks)
            except BaseException:
                scatter_fn(local, pos, old)
                raise
            done += 1
    except BaseException:
        undo_masks(writes[:done], scatter_fn)
        raise


def undo_masks(writes: Sequence[MaskWrite], scatter_fn: Scatter = scatter) -> None:
    """Undo fully applied :func:`apply_masks` writes (XOR the masks in again), newest first."""
    for local, pos, masks in reversed(writes):
        scatter_fn(local, pos, gather(local, pos, masks.dtype) ^ masks)
