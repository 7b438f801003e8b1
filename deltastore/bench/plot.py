"""An optional PNG of a :class:`~deltastore.bench.schema.BenchResult` (matplotlib, the
``plot`` extra). Not thread-safe (matplotlib's global state)."""

from __future__ import annotations

import importlib
import os
from typing import Any

from deltastore.bench.schema import BenchResult


class PlotUnavailable(ImportError):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'deltastore[plot]'") from None
    return plt


def check_plot() -> None:
    """Raise :class:`PlotUnavailable` now rather than after a long run."""
    _pyplot()


def plot(result: BenchResult, path: str | os.PathLike[str]) -> None:
    """A PNG: median payload per system, then per store the median publish and sync times."""
    plt = _pyplot()
    stores = result.stores
    fig, axes = plt.subplots(1, 1 + len(stores), figsize=(5 * (1 + len(stores)), 4.5))
    axes = list(axes) if len(stores) else [axes]
    if stores:
        first = stores[0].systems
        axes[0].bar(list(first), [r.median.publish.payload_bytes for r in first.values()])
    axes[0].set_yscale("log")
    axes[0].set_title("payload per version (bytes)")
    for ax, s in zip(axes[1:], stores, strict=True):
        names = list(s.systems)
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [r.median.publish.total_s for r in s.systems.values()], 0.4)
        ax.bar([x + 0.2 for x in xs], [r.median.sync.total_s for r in s.systems.values()], 0.4)
        ax.set_xticks(list(xs), names)
        ax.set_yscale("log")
        ax.legend(["publish", "sync"])
        ax.set_title(f"seconds per version, store {s.store}")
    w = result.workload
    fig.suptitle(f"deltastore bench: {w.size} ({w.elements / 1e6:.0f}M elements), lr {w.lr:g}")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)
