"""The layout of a vLLM worker: its parameter names and checkpoint-format shapes mapped to the
HF tensors the trainer publishes (pure; imports no vLLM).

:func:`derive_layout` maps them with the presets of :mod:`deltastore.layout.presets`; a custom
``"package.module:function"`` layout is fitted the same way. Thread-safe (no state).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from typing import Any

from deltastore.errors import LayoutError
from deltastore.layout.boxes import Layout
from deltastore.layout.presets import FAMILIES, ModelSpec, hf_shapes, vllm_layout

#: Path segments vLLM adds between a module and its parameters (MoE runners, LoRA wrappers).
_WRAPPERS = (".routed_experts.", ".base_layer.")


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """A worker's layout: ``layout`` maps the worker's parameter names to boxes of the HF
    tensors; ``shapes`` gives each local tensor's checkpoint-format shape (elements);
    ``sources`` the HF tensors each local tensor holds parts of; ``derived``: the worker's
    parameters no HF tensor writes (a trace found them; the model computes them), not in
    ``layout``."""

    layout: Layout
    shapes: Mapping[str, tuple[int, ...]]
    sources: Mapping[str, tuple[str, ...]]
    derived: tuple[str, ...] = ()


def _canonical(name: str) -> str:
    """The preset's name of a vLLM parameter (wrapper segments removed)."""
    for seg in _WRAPPERS:
        name = name.replace(seg, ".")
    return name


def derive_layout(
    shapes: Mapping[str, Sequence[int]],
    hf_config: Mapping[str, Any],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    pad_vocab_to: int = 64,
) -> EngineLayout:
    """The layout of a vLLM worker whose parameters have the checkpoint-format ``shapes``
    (parameter name -> shape, as ``named_parameters()`` names them), for the model of the HF
    config ``hf_config`` (a ``config.json`` as a dict) at TP rank ``tp_rank`` of ``tp_size``.

    Raises :class:`LayoutError` naming every parameter the preset does not know, every preset
    tensor the worker lacks and every shape that differs, or, for an architecture without a
    preset, what to pass instead.
    """
    family = hf_config.get("model_type")
    if family not in FAMILIES:
        raise LayoutError(
            f"model_type {family!r} has no deltastore preset (presets: {', '.join(FAMILIES)}); "
            "pass layout='package.module:function' to deltastore_attach, a function "
            "(shapes, hf_config, tp_rank, tp_size) -> deltastore.layout.Layout that maps this "
            "worker's parameter names to the published HF tensors"
        )
    spec = ModelSpec.from_hf_config(hf_config)
    preset = vllm_layout(spec, tp_rank=tp_rank, tp_size=tp_size, pad_vocab_to=pad_vocab_to)
    return _fit(preset, spec, shapes, f"{family} at TP rank {tp_rank} of {tp_size}")


def _fit(
    preset: Layout, spec: ModelSpec | None, shapes: Mapping[str, Sequence[int]], what: str
) -> EngineLayout:
    """Rename ``preset`` to the worker's parameter names and check it against ``shapes``."""
    by_canonical = {_canonical(n): n for n in shapes}
    unknown = sorted(n for c, n in by_canonical.items() if c not in preset.parts)
    missing = sorted(c for c in preset.parts if c not in by_canonical)
    parts = {by_canonical[c]: p for c, p in preset.parts.items() if c in by_canonical}
    layout = Layout(parts)
    global_shapes = hf_shapes(spec) if spec is not None else None
    bound = layout.bind(global_shapes) if global_shapes is not None else None
    bad = [
        f"{n}: vLLM {list(shapes[n])}, preset {list(bound.local_shapes[n])}"
        for n in parts
        if bound is not None and tuple(shapes[n]) != bound.local_shapes[n]
    ]
    problems = [
        *(f"parameter {n} is not in the preset" for n in unknown[:5]),
        *(f"preset tensor {n} is not a parameter of the worker" for n in missing[:5]),
        *bad[:5],
    ]
    if problems:
        raise LayoutError(
            f"the vLLM model ({what}) does not fit deltastore's preset "
            f"({len(unknown)} unknown, {len(missing)} missing, {len(bad)} shapes differ): "
            + "; ".join(problems)
            + "; pass layout='package.module:function' to describe this model"
        )
    local_shapes = {n: tuple(int(d) for d in shapes[n]) for n in parts}
    return EngineLayout(layout, local_shapes, layout.sources())


def _custom_layout(
    qualname: str,
    shapes: Mapping[str, Sequence[int]],
    hf_config: Mapping[str, Any],
    rank: int,
    size: int,
) -> Layout:
    module, _, attr = qualname.partition(":")
    if not module or not attr:
        raise LayoutError(f"layout={qualname!r}: expected 'package.module:function'")
    fn = getattr(importlib.import_module(module), attr)
    out = fn(shapes, hf_config, rank, size)
    if not isinstance(out, Layout):
        raise LayoutError(f"layout function {qualname} returned {type(out).__name__}, not a Layout")
    return out


def worker_layout(
    choice: str | None,
    model: Any,
    vllm_config: Any,
    shapes: Mapping[str, Sequence[int]],
    *,
    url: str,
    version: int,
    storage_options: Mapping[str, Any] | None,
    tp_rank: int,
    tp_size: int,
    pad_vocab_to: int = 64,
    cache: bool = True,
) -> tuple[EngineLayout, tuple[str, ...]]:
    """The layout a vLLM worker attaches with, and its derived parameters (no checkpoint
    source: the model computes them). ``choice``: None or ``"trace"`` (default): traced from
    the model's own ``load_weights`` against the manifest of ``version`` in the store at
    ``url`` (cached, see :mod:`deltastore.engines.vllm_trace_cache`; ``cache=False`` traces
    anew); ``"preset"``: :func:`derive_layout`; ``"package.module:function"``: a custom layout
    fitted to ``shapes`` (the worker's parameter names -> checkpoint-format shapes)."""
    hf_config = vllm_config.model_config.hf_config.to_dict()
    if choice == "preset":
        el = derive_layout(
            shapes, hf_config, tp_rank=tp_rank, tp_size=tp_size, pad_vocab_to=pad_vocab_to
        )
        return el, ()
    if choice and choice != "trace":
        custom = _custom_layout(choice, shapes, hf_config, tp_rank, tp_size)
        return _fit(custom, None, shapes, f"layout {choice}"), ()
    from deltastore.catalog.chain import ChainReader
    from deltastore.engines.vllm_trace_cache import cached_trace, vllm_key
    from deltastore.store.registry import open_store

    manifest = ChainReader(open_store(url, dict(storage_options or {}))).manifest(version)
    global_shapes = {n: tuple(e.shape) for n, e in manifest.tensors.items()}
    key = vllm_key(vllm_config, tp_rank, tp_size)
    key["dtypes"] = sorted({str(e.dtype) for e in manifest.tensors.values()})
    got = cached_trace(model, global_shapes, key, cache=cache)
    wrong = [
        f"{n}: traced {list(s)}, the worker holds {list(shapes[n])}"
        for n, s in got.layout.shapes.items()
        if n in shapes and tuple(shapes[n]) != tuple(s)
    ]
    missing = sorted(set(got.layout.shapes) - set(shapes))
    if wrong or missing:
        raise LayoutError(
            "the traced layout does not fit the worker's parameters: "
            + "; ".join([*wrong[:5], *(f"{n} is not a parameter" for n in missing[:5])])
        )
    return dataclasses.replace(got.layout, derived=got.derived), got.derived
