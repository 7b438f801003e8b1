"""Rendering a :class:`~deltastore.bench.schema.BenchResult`: a markdown report with the bar
checks, and an optional PNG (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

import importlib
import os
from typing import Any

from deltastore.bench.analysis import holds
from deltastore.bench.schema import BenchResult, StoreResult


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x" if v < 100 else f"{v:.0f}x"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def _measured(value: float | None, op: str, threshold: float) -> str:
    """The measured value with enough decimals that its rounding does not flip the check."""
    if value is None:
        return "-"
    for digits in range(3, 8):
        text = f"{value:.{digits}f}"
        if holds(float(text), op, threshold) == holds(value, op, threshold):
            return text
    return repr(value)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _store_section(s: StoreResult) -> list[str]:
    out = [f"### Store: {s.store}", ""]
    head = [
        "system",
        "payload",
        "B/changed",
        "publish s",
        "detect",
        "encode",
        "upload",
        "sync s",
        "fetch",
        "decode",
        "verify",
        "pause",
        "pub RSS+",
        "sub RSS+",
        "exact",
    ]
    rows = []
    for name, r in s.systems.items():
        m, p, y = r.median, r.median.publish, r.median.sync
        rows.append(
            [
                name,
                _bytes(p.payload_bytes),
                f"{m.bytes_per_changed:.3f}",
                f"{p.total_s:.3f}",
                f"{p.detect_s:.3f}",
                f"{p.encode_s:.3f}",
                f"{p.upload_s:.3f}",
                f"{y.total_s:.3f}",
                f"{y.fetch_s:.3f}",
                f"{y.decode_s:.3f}",
                f"{y.verify_s:.3f}",
                f"{y.pause_s:.3f}",
                f"{_bytes(m.publisher_rss_extra_bytes)} ({_pct(m.publisher_rss_extra_fraction)})",
                f"{_bytes(m.subscriber_rss_extra_bytes)} ({_pct(m.subscriber_rss_extra_fraction)})",
                "yes" if r.exact else "NO",
            ]
        )
    out += _table(head, rows)
    out.append("")
    if s.detect_bound_median_s is not None:
        out.append(
            f"Detect lower bound {s.detect_bound_median_s:.3f} s; deltastore publish / bound "
            f"{_x(s.publish_bound_ratio)}; pause / sync {_pct(s.pause_fraction)}."
        )
        out.append("")
    if s.ratios:
        rows = [
            [
                f"{b} / deltastore",
                _x(r.payload),
                _x(r.publish),
                _x(r.sync),
                _x(r.publisher_rss),
                _x(r.subscriber_rss),
            ]
            for b, r in s.ratios.items()
        ]
        out += _table(["ratio", "payload", "publish", "sync", "pub RSS+", "sub RSS+"], rows)
        out.append("")
    return out


def markdown(result: BenchResult) -> str:
    """The report: workload, one table per store, scaling and the bar checks."""
    w, m = result.workload, result.machine
    changed = ", ".join(_pct(f) for f in w.changed_fraction)
    out = [
        f"## deltastore bench: {w.size}, {w.elements / 1e6:.0f}M bf16 elements "
        f"({_bytes(w.dense_bytes)}), lr {w.lr:g}, {w.versions} measured versions",
        "",
        f"Changed per version: {changed}. Machine: {m.cpu_model}, {m.cores} cores, "
        f"{_bytes(m.memory_bytes)} RAM; torch {m.torch}, numpy {m.numpy}. {result.created}, "
        f"wall {result.wall_s:.0f} s. Medians over the measured versions; times in seconds; "
        "RSS+ is peak extra resident memory (share of the model's bytes).",
        "",
    ]
    for s in result.stores:
        out += _store_section(s)
    for line in result.skipped:
        out += [f"Skipped store {line}", ""]
    sc = result.scaling
    if sc is not None:
        line = (
            f"deltastore sync of {sc.changed_elements} changed elements (store {sc.store}): "
            f"{sc.small.size} {sc.small.median_s:.3f} s"
        )
        if sc.target.size == sc.small.size:
            line += " (the benchmarked size is small: ratio 1 by construction)."
        else:
            line += f", {sc.target.size} {sc.target.median_s:.3f} s, ratio {sc.ratio:.2f}."
        out += ["### Scaling", "", line, ""]
    rows = [
        [
            b.name,
            b.store or "-",
            _measured(b.measured, b.op, b.threshold),
            f"{b.op} {b.threshold:g}",
            "pass" if b.passed else "FAIL",
        ]
        for b in result.bars
    ]
    out += ["### The bar", "", *_table(["check", "store", "measured", "bar", "result"], rows)]
    out += ["", "All receivers bit-exact." if result.exact else "MISMATCH: some receiver differs."]
    return "\n".join(out) + "\n"


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
