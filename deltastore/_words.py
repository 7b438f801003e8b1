"""Gather and scatter of words (unsigned element bits) in local tensors, CPU or device.

Positions are int64 flat element indices; values are unsigned little-endian words. Not
thread-safe for writes to the same tensor.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def signed(size: int) -> np.dtype[Any]:
    return np.dtype(f"<i{size}") if size > 1 else np.dtype(np.uint8)


def gather(local: torch.Tensor, positions: np.ndarray, wdt: np.dtype[Any]) -> np.ndarray:
    if local.device.type == "cpu":
        out: np.ndarray = local.numpy().view(wdt)[positions]
        return out
    idx = torch.from_numpy(positions).to(local.device)
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
    idx = torch.from_numpy(positions).to(local.device)
    vals = torch.from_numpy(values.view(signed(values.dtype.itemsize))).to(local.device)
    local.index_copy_(0, idx, vals)


def scatter_range(local: torch.Tensor, start: int, values: np.ndarray) -> None:
    """Write ``values`` (unsigned words) to elements ``[start, start + len(values))``."""
    if local.device.type == "cpu":
        local.numpy().view(values.dtype)[start : start + values.size] = values
        return
    vals = torch.from_numpy(values.view(signed(values.dtype.itemsize)))
    local[start : start + values.size].copy_(vals)
