"""The crossover runs' part of the performance page (``deltastore bench --mode crossover``):
recognizing and loading their JSONs, one summary line per run, and each run's report under
the page's headings. Pure functions; thread-safe."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import ValidationError

from deltastore.bench.crossover import crossover_markdown
from deltastore.bench.crossover_schema import CrossoverResult


def is_crossover_json(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file holding a crossover run's JSON (``"mode": "crossover"``)."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        return bool(json.loads(p.read_text()).get("mode") == "crossover")
    except (ValueError, AttributeError):
        return False


def load_crossover(path: str | os.PathLike[str]) -> CrossoverResult:
    """A crossover results JSON; :class:`ValueError` when it does not validate."""
    try:
        return CrossoverResult.model_validate_json(Path(path).read_text())
    except ValidationError as exc:
        raise ValueError(
            f"{path} is not a crossover results JSON of schema version 1: "
            f"{exc.error_count()} errors, first: {exc.errors()[0]['loc']}"
        ) from None


def crossover_summary(result: CrossoverResult) -> str:
    """One line: the crossover density per store."""

    def where(store: str, status: str, density: float | None) -> str:
        if density is None:
            return f"{store}: {status}"
        return f"{store}: {100 * density:.2f}% changed"

    parts = [where(s.store, s.crossover.status, s.crossover.density) for s in result.stores]
    return (
        f"- crossover density ({result.size}; deltastore's sync beats the strongest dense "
        f"load below it): {'; '.join(parts)}."
    )


def crossover_section(result: CrossoverResult) -> list[str]:
    """The run's report under a ``## Results`` heading of the page (its own headings one
    level down)."""
    body = crossover_markdown(result).rstrip("\n").splitlines()
    body = [("#" + line) if line.startswith("#") else line for line in body]
    return [f"## Results: crossover density, {result.size} ({result.created[:10]})", "", *body]


__all__ = ["crossover_section", "crossover_summary", "is_crossover_json", "load_crossover"]
