"""The cache of traced layouts (:mod:`deltastore.engines.vllm_trace`): one JSON file per
(architecture, config, TP rank and size, vLLM version, manifest shapes) key.

Files live in ``$XDG_CACHE_HOME/deltastore/vllm-layouts/`` (default
``~/.cache/deltastore/vllm-layouts/``), named by the SHA-256 of the key; each holds its key,
per parameter its checkpoint-format shape, boxes and padding, and the derived parameters. A
file is written atomically (a temporary file renamed over it) and checked on load against the
model's parameter names and shapes and the manifest's shapes: anything that differs, or a file
that does not parse, is a miss (the caller traces again and overwrites it).
``DELTASTORE_TRACE_CACHE=0`` in the environment, or ``cache=False``, disables the cache.

Thread-safe (no state; concurrent writers of one key each rename a whole file).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from deltastore.engines.vllm_layout import EngineLayout
from deltastore.engines.vllm_trace import Region, TraceResult, checkpoint_meta, trace_layout
from deltastore.errors import LayoutError
from deltastore.layout.boxes import Box, Layout, Placed

#: Bumped when the traced layouts or the file format change: older files are misses.
FORMAT = 1


def cache_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """``directory``, else ``$XDG_CACHE_HOME/deltastore/vllm-layouts`` (default
    ``~/.cache``)."""
    if directory is not None:
        return Path(directory)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deltastore" / "vllm-layouts"


def _file(key: Mapping[str, Any], directory: Path) -> Path:
    blob = json.dumps({"format": FORMAT, **key}, sort_keys=True, default=str)
    return directory / f"{hashlib.sha256(blob.encode()).hexdigest()[:40]}.json"


def save_cached(
    result: TraceResult, key: Mapping[str, Any], directory: str | os.PathLike[str] | None = None
) -> Path:
    """Write ``result`` under ``key`` (JSON-able values) atomically; the file's path."""
    folder = cache_dir(directory)
    folder.mkdir(parents=True, exist_ok=True)
    params = {}
    for name, part in result.layout.layout.parts.items():
        if not isinstance(part, Placed):
            raise LayoutError(f"only traced layouts are cached ({name} is {type(part).__name__})")
        params[name] = {
            "shape": list(part.shape),
            "boxes": [
                [b.source, list(b.offset), list(b.lengths), list(b.dst_offset)] for b in part.boxes
            ],
            "padding": [[list(o), list(n)] for o, n in part.padding],
        }
    doc = {"format": FORMAT, "key": dict(key), "params": params, "derived": list(result.derived)}
    path = _file(key, folder)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, sort_keys=True, default=str)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_cached(
    key: Mapping[str, Any],
    param_shapes: Mapping[str, Sequence[int]],
    global_shapes: Mapping[str, Sequence[int]],
    directory: str | os.PathLike[str] | None = None,
) -> TraceResult | None:
    """The cached layout of ``key`` if its parameters (traced and derived) are exactly
    ``param_shapes`` (name -> checkpoint-format shape) and it binds to ``global_shapes``;
    else None (missing, unreadable or stale)."""
    t0 = time.perf_counter()
    path = _file(key, cache_dir(directory))
    try:
        doc = json.loads(path.read_text())
        if doc.get("format") != FORMAT or doc.get("key") != json.loads(
            json.dumps(dict(key), default=str)
        ):
            return None
        parts: dict[str, Placed] = {}
        for name, p in doc["params"].items():
            boxes = tuple(Box(str(s), tuple(o), tuple(n), tuple(d)) for s, o, n, d in p["boxes"])
            pad: tuple[Region, ...] = tuple((tuple(o), tuple(n)) for o, n in p["padding"])
            parts[name] = Placed(tuple(p["shape"]), boxes, pad)
        derived = tuple(str(n) for n in doc["derived"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    want = {n: tuple(int(d) for d in s) for n, s in param_shapes.items()}
    have = {n: p.shape for n, p in parts.items()}
    if set(have) | set(derived) != set(want) or any(want[n] != s for n, s in have.items()):
        return None
    layout = Layout(parts)
    try:
        layout.bind(global_shapes)
    except LayoutError:
        return None
    padding = {n: p.padding for n, p in parts.items() if p.padding}
    el = EngineLayout(layout, have, layout.sources(), derived)
    return TraceResult(el, derived, padding, True, time.perf_counter() - t0)


def cached_trace(
    model: torch.nn.Module,
    global_shapes: Mapping[str, Sequence[int]],
    key: Mapping[str, Any],
    *,
    cache: bool = True,
    directory: str | os.PathLike[str] | None = None,
    load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], Any] | None = None,
) -> TraceResult:
    """The traced layout of ``model`` for ``global_shapes``: from the cache under ``key``
    (see :func:`load_cached`) unless ``cache`` is False or ``DELTASTORE_TRACE_CACHE=0``,
    else traced (:func:`~deltastore.engines.vllm_trace.trace_layout`) and written there. A
    cache folder that cannot be written costs the next attach a trace, nothing else."""
    use = cache and os.environ.get("DELTASTORE_TRACE_CACHE", "1") not in ("0", "off", "false")
    key = {**key, "shapes": _digest(global_shapes)}
    if use:
        shapes = {n: tuple(m.shape) for n, m in checkpoint_meta(model).items()}
        hit = load_cached(key, shapes, global_shapes, directory)
        if hit is not None:
            return hit
    result = trace_layout(model, global_shapes, load_weights=load_weights)
    if use:
        with contextlib.suppress(OSError):
            save_cached(result, key, directory)
    return result


def _digest(shapes: Mapping[str, Sequence[int]]) -> str:
    blob = json.dumps({n: list(s) for n, s in sorted(shapes.items())})
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def vllm_key(vllm_config: Any, tp_rank: int, tp_size: int) -> dict[str, Any]:
    """The cache key of a vLLM worker's model: architecture, a hash of its HF config and
    dtype, TP rank and size, the vLLM version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        from vllm import __version__ as vllm_version
    except ImportError:  # pragma: no cover - called in vLLM workers only
        vllm_version = "unknown"
    try:
        dist = version("deltastore")
    except PackageNotFoundError:  # pragma: no cover - a source checkout
        dist = "dev"
    mc = vllm_config.model_config
    hf = json.dumps(mc.hf_config.to_dict(), sort_keys=True, default=str)
    return {
        "architecture": list(getattr(mc.hf_config, "architectures", None) or []),
        "config": hashlib.sha256(hf.encode()).hexdigest()[:32],
        "dtype": str(mc.dtype),
        "quantization": str(getattr(mc, "quantization", None)),
        "tp_rank": int(tp_rank),
        "tp_size": int(tp_size),
        "vllm": str(vllm_version),
        "deltastore": dist,
    }
