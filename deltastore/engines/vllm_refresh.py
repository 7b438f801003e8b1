"""Which modules of a vLLM model consume a synced parameter, and how each is refreshed after a
version changed it: the rule of vLLM's own weight loading, applied to the modules a version
touched (runs in vLLM's worker processes; imports vLLM lazily).

vLLM post-processes loaded weights in three steps (``model_loader.utils.
process_weights_after_loading``, and ``reload.layerwise`` when it reloads weights), and a
synced parameter has a consumer in each:

1. *Quantize-method modules* (``module.quant_method.process_weights_after_loading(module)``):
   repack, quantize or copy their parameters into kernel form. A module consumes a parameter it
   holds directly, also under another name: the same ``Parameter`` (a tied LM head holds the
   embedding's weight) or a tensor on the same storage (a view). Refreshed only where the
   worker rebuilds kernels (CPU, ``mode='rebuild'``); elsewhere its parameters are the kernel's.
2. *Attention-like layers* (``is_deferred_attention_layer``: ``layer.process_weights_after_
   loading(dtype)``, after every module of step 1): compute derived weights from other modules'
   weights, e.g. MLA's ``W_UV`` / ``W_UK_T`` from ``kv_b_proj``. A layer consumes every
   parameter of its sub-tree (``kv_b_proj`` is a sub-module of the MLA layer). Refreshed in
   every mode (the derived weights are copies).
3. The model's own ``process_weights_after_loading()`` hook, if it has one, after everything
   else: consumes every parameter.

A *derived* parameter (no checkpoint tensor writes it) must be computed by the refresh of its
own module (step 1 or 2); its module is then refreshed after any version that changed a
parameter of that module's sub-tree. Thread-safety: none (the worker calls it from one sync at
a time).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from deltastore.errors import LayoutError

if TYPE_CHECKING:
    import torch

#: The refresh kinds in the order they run (vLLM's own order of post-load processing).
KINDS = ("quant", "attention", "model")
#: The name of the model-level hook's consumer (the model itself).
MODEL = "<model>"


@dataclasses.dataclass
class Consumer:
    """A module to refresh: its ``kind`` (one of :data:`KINDS`) and the synced parameters
    (the worker's names) whose change makes it stale."""

    module: Any
    kind: str
    inputs: set[str] = dataclasses.field(default_factory=set)
    #: parameter name -> the tensor the last refresh gave the module, where its kernel kept it
    #: as its weight (the next refresh copies into it instead of allocating another)
    kept: dict[str, Any] = dataclasses.field(default_factory=dict)


def _storage_key(t: torch.Tensor) -> int | None:
    """The address of the storage ``t`` lives on (views share it); None for empty tensors."""
    if t.numel() == 0 or t.is_meta:
        return None
    return int(t.untyped_storage().data_ptr())


def find_consumers(
    model: torch.nn.Module,
    synced: Mapping[str, torch.Tensor],
    *,
    derived: Iterable[str] = (),
    rebuild: bool,
) -> dict[str, Consumer]:
    """Every module of ``model`` that consumes a parameter of ``synced`` (the worker's parameter
    names -> the tensors vLLM holds, read before any shadowing), by the module's name
    (``named_modules()``'s first name; :data:`MODEL` for the model hook). With ``rebuild``
    False the quantize-method modules are left out (their parameters are the kernel's).

    Raises :class:`LayoutError` for a ``derived`` parameter whose module has no post-load
    processing that could compute it.
    """
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    by_id = {id(p): n for n, p in synced.items()}
    by_storage: dict[int, set[str]] = {}
    for n, p in synced.items():
        key = _storage_key(p)
        if key is not None:
            by_storage.setdefault(key, set()).add(n)

    def uses(tensors: Iterable[torch.Tensor | None]) -> set[str]:
        out: set[str] = set()
        for t in tensors:
            if t is None:
                continue
            if id(t) in by_id:
                out.add(by_id[id(t)])
            key = _storage_key(t)
            if key is not None:
                out |= by_storage.get(key, set())
        return out

    found: dict[str, Consumer] = {}
    modules = dict(model.named_modules())
    for name, mod in modules.items():
        method = getattr(mod, "quant_method", None)
        if rebuild and callable(getattr(method, "process_weights_after_loading", None)):
            own = uses([*mod._parameters.values(), *mod._buffers.values()])
            if own:
                found[name] = Consumer(mod, "quant", own)
        if is_deferred_attention_layer(mod):
            tree = uses([*mod.parameters(), *mod.buffers()])
            if tree:
                found[name] = Consumer(mod, "attention", tree)
    for pname in sorted(derived):
        mod_name = pname.rpartition(".")[0]
        mod = modules.get(mod_name)
        is_quant = callable(
            getattr(getattr(mod, "quant_method", None), "process_weights_after_loading", None)
        )
        if mod is None or not (is_deferred_attention_layer(mod) or (rebuild and is_quant)):
            raise LayoutError(
                f"parameter {pname} has no checkpoint tensor, and its module "
                f"{mod_name or '<model>'} has no post-load processing that computes it: "
                "deltastore cannot keep it current; pass layout= naming its source"
            )
        inputs = uses([*mod.parameters(), *mod.buffers()])
        kind = "attention" if is_deferred_attention_layer(mod) else "quant"
        found.setdefault(mod_name, Consumer(mod, kind)).inputs |= inputs
    if callable(getattr(model, "process_weights_after_loading", None)):
        found[MODEL] = Consumer(model, "model", set(synced))
    return found


def _same(given: Any, held: Any, shadow: torch.Tensor) -> bool:
    """Whether the module still holds ``given`` itself as a tensor of ``shadow``'s layout (its
    kernel kept the weight it was given rather than packing a copy)."""
    return (
        given is not None
        and held is not None
        and held.data_ptr() == given.data_ptr()
        and held.shape == shadow.shape
        and held.dtype == shadow.dtype
        and held.is_contiguous()
    )


def refresh_order(names: Iterable[str], consumers: Mapping[str, Consumer]) -> list[str]:
    """``names`` in vLLM's order of post-load processing: quantize-method modules, then
    attention-like layers, then the model hook; by name within a kind."""
    return sorted(names, key=lambda n: (KINDS.index(consumers[n].kind), n))


def refresh(
    name: str,
    consumer: Consumer,
    shadows: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
) -> None:
    """Refresh one consumer as vLLM's loader processes it: a quantize-method module gets fresh
    parameters from its checkpoint-format ``shadows`` (parameter name -> tensor; a copy each,
    since a kernel may keep or repack what it is given: where it kept the previous copy as
    its weight, that copy is refilled in place, no allocation) and its quant method's
    ``process_weights_after_loading``; an attention-like layer its own
    ``process_weights_after_loading(dtype)``; the model its hook."""
    import torch

    mod = consumer.module
    if consumer.kind == "quant":
        given: dict[str, torch.Tensor] = {}
        for pname, shadow in shadows.items():
            kept = consumer.kept.get(pname)
            held = getattr(mod, pname, None)
            if kept is not None and _same(kept, held, shadow):
                kept.copy_(shadow)  # the kernel serves from this tensor: refill it in place
                given[pname] = kept
            else:
                given[pname] = shadow.clone()
            setattr(mod, pname, torch.nn.Parameter(given[pname], requires_grad=False))
        method: Any = mod.quant_method
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None  # MoE: the first-load path prepacks the experts again
        if hasattr(mod, "_already_called_process_weights_after_loading"):
            delattr(mod, "_already_called_process_weights_after_loading")
        method.process_weights_after_loading(mod)
        if hasattr(mod, "update_param_tp_status"):
            mod.update_param_tp_status()
        consumer.kept = {
            p: t for p, t in given.items() if _same(t, getattr(mod, p, None), shadows[p])
        }
    elif consumer.kind == "attention":
        mod.process_weights_after_loading(dtype)
    else:
        mod.process_weights_after_loading()


def stale(
    changed: Sequence[str],
    modules_of: Mapping[str, set[str]],
) -> set[str]:
    """The consumers made stale by a version that changed the HF tensors ``changed``."""
    out: set[str] = set()
    for n in changed:
        out |= modules_of.get(n, set())
    return out


def modules_of_sources(
    consumers: Mapping[str, Consumer], sources: Mapping[str, Sequence[str]]
) -> dict[str, set[str]]:
    """HF tensor name -> the consumers of the worker parameters that hold parts of it."""
    out: dict[str, set[str]] = {}
    for name, c in consumers.items():
        for p in c.inputs:
            for src in sources.get(p, ()):
                out.setdefault(src, set()).add(name)
    return out
