"""Number formatting of the bench's markdown reports (pure functions, thread-safe)."""

from __future__ import annotations

from deltastore.bench.analysis import holds


def nbytes(n: float) -> str:
    """Bytes in decimal units (B, kB, MB, GB, TB)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def times(v: float | None) -> str:
    """A ratio as ``1.23x`` (``-`` for None)."""
    return "-" if v is None else f"{v:.2f}x" if v < 100 else f"{v:.0f}x"


def pct(v: float | None) -> str:
    """A fraction as a percentage."""
    return "-" if v is None else f"{100 * v:.2f}%"


def secs(v: float | None) -> str:
    """Seconds with three decimals."""
    return "-" if v is None else f"{v:.3f}"


def measured(value: float | None, op: str, threshold: float) -> str:
    """The measured value with enough decimals that its rounding does not flip the check
    (four significant digits for a number reported without a bar)."""
    if value is None:
        return "-"
    if op == "report":
        return f"{value:.4g}"
    for digits in range(3, 8):
        text = f"{value:.{digits}f}"
        if holds(float(text), op, threshold) == holds(value, op, threshold):
            return text
    return repr(value)


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]
