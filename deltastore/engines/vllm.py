"""vLLM as a receiver: a worker extension that keeps a running engine at the store's versions.

Launch the engine with ``worker_extension_cls="deltastore.engines.vllm.DeltastoreWorkerExtension"``
and drive it from the process that owns the ``LLM`` / ``AsyncLLM`` (docs/engines.md)::

    llm = LLM(model=checkpoint_of_version_v, worker_extension_cls=EXTENSION, ...)
    follow(llm, "s3://bucket/run", version=v)              # polls, syncs, resets the prefix cache

Every worker (one per tensor-parallel rank) runs the methods ``deltastore_*`` through
``collective_rpc``; arguments and results are plain values (str, int, dict), so they cross
vLLM's process boundary. Per version: the driver polls the store; each worker fetches and
decodes its share of the frames (one fetch of each frame per engine), the ranks verify together
(Adler-32, before anything is written); then the write phase: changes are scattered into the
worker's parameters in vLLM's own coordinates (TP shards, fused ``qkv_proj`` / ``gate_up_proj``,
stacked experts, padded vocabulary). With an ``AsyncLLM`` the driver pauses generation only
around that write phase (:func:`follow` / :func:`sync_async`); afterwards the prefix cache is
reset, since cached KV was computed with the old weights.

Where vLLM keeps parameters in checkpoint format (GPU, unquantized; the norms everywhere),
changes are written in place: no copy of the model, no full-size temporaries. Where it repacks
them for its kernels (CPU: linear layers and their biases are replaced by empty parameters,
MoE experts are prepacked, the LM head keeps a packed copy), the worker keeps a *shadow*: the
local, checkpoint-format tensor of each such parameter (memory: the worker's share of those
weights, about the model's size over TP), applies changes to it, and rebuilds the packed kernel
of every module a version changed (whole fused groups: ``qkv_proj`` is rebuilt from all of q,
k and v) with vLLM's own ``process_weights_after_loading``.

The layout comes from the live model (:func:`derive_layout`): the worker's parameter names and
checkpoint-format shapes, the model's HF config and vLLM's TP rank and size, mapped to the HF
names the trainer publishes by the presets of :mod:`deltastore.layout.presets` (Llama, Qwen2,
Qwen3, Qwen3-MoE, Mixtral). Another architecture: pass ``layout="pkg.module:function"``, a
function ``(shapes, hf_config, tp_rank, tp_size) -> Layout`` importable on the workers.

A failed sync (a corrupted frame, a wrong parent, a store error) writes nothing, or rolls back
what it wrote: the engine keeps serving the version it had, and every worker's result carries
the typed error (``{"error": {"type": "IntegrityError", "message": ...}}``).

Thread-safety: the driver helpers are called from one thread per engine; on the workers, one
sync runs at a time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import logging
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from deltastore.engines.worker_errors import error_from_dict, error_to_dict
from deltastore.errors import DeltastoreError, EngineSyncError, LayoutError
from deltastore.layout.boxes import Layout
from deltastore.layout.presets import FAMILIES, ModelSpec, hf_shapes, vllm_layout

if TYPE_CHECKING:
    import torch

    from deltastore.format.manifest import Manifest
    from deltastore.sync.subscriber import Subscriber

log = logging.getLogger(__name__)

#: ``worker_extension_cls`` for vLLM.
EXTENSION = "deltastore.engines.vllm.DeltastoreWorkerExtension"
#: Path segments vLLM adds between a module and its parameters (MoE runners, LoRA wrappers).
_WRAPPERS = (".routed_experts.", ".base_layer.")


# --- layout from the live model (pure; no vLLM import) --------------------------------------


@dataclasses.dataclass(frozen=True)
class EngineLayout:
    """A worker's layout: ``layout`` maps the worker's parameter names to boxes of the HF
    tensors; ``shapes`` gives each local tensor's checkpoint-format shape (elements);
    ``sources`` the HF tensors each local tensor holds parts of."""

    layout: Layout
    shapes: Mapping[str, tuple[int, ...]]
    sources: Mapping[str, tuple[str, ...]]


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


# --- worker side ------------------------------------------------------------------------


class _Gate:
    """The write phase's pause hook in a two-phase sync: says "ready", then waits for the
    driver's commit (the engine is paused by then)."""

    def __init__(self) -> None:
        self.armed = False
        self.ready = threading.Event()
        self.go = threading.Event()
        self.timeout_s = 600.0

    def pause(self) -> None:
        if not self.armed:
            return
        self.ready.set()
        if not self.go.wait(self.timeout_s):
            raise EngineSyncError(
                f"no commit within {self.timeout_s:.0f} s of the sync being ready; nothing was "
                "written (call deltastore_commit after deltastore_prepare)"
            )


class _Receiver:
    """One worker's binding: the Subscriber over its parameters (and shadows), the modules to
    rebuild on CPU, the state of a two-phase sync."""

    def __init__(
        self,
        worker: Any,
        url: str,
        version: int,
        storage_options: dict[str, Any] | None,
        options: dict[str, Any],
    ) -> None:
        import torch
        import torch.distributed as dist
        from vllm.distributed import parallel_state as ps
        from vllm.platforms import current_platform

        from deltastore.sync.subscriber import Subscriber

        known = {
            "mode", "layout", "pad_vocab_to", "reader_id", "lease_ttl", "max_workers",
            "max_inflight_bytes", "commit_timeout_s", "rebuild_on_attach",
        }  # fmt: skip
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown deltastore_attach options {unknown}; known: {sorted(known)}")
        config = worker.vllm_config
        par = config.parallel_config
        if par.pipeline_parallel_size > 1 or getattr(par, "enable_expert_parallel", False):
            raise LayoutError(
                "pipeline and expert parallelism are not supported by the vLLM adapter yet: "
                "run with tensor parallelism only, or pass layout= for this worker"
            )
        size = ps.get_tensor_model_parallel_world_size()
        world = dist.get_world_size() if dist.is_initialized() else 1
        if size > 1 and world != size:
            raise LayoutError(
                f"{world} ranks in the torch world but TP {size}: data or pipeline parallel "
                "ranks in one world are not supported by the vLLM adapter yet"
            )
        model = worker.model_runner.model
        hf_config = config.model_config.hf_config.to_dict()
        self.rank = ps.get_tensor_model_parallel_rank()
        params = dict(model.named_parameters())
        owner = {n: model.get_submodule(n.rpartition(".")[0]) for n in params}
        shapes = {
            n: _checkpoint_shape(owner[n], n.rpartition(".")[2], p) for n, p in params.items()
        }
        if options.get("layout"):
            custom = _custom_layout(str(options["layout"]), shapes, hf_config, self.rank, size)
            el = _fit(custom, None, shapes, f"layout {options['layout']}")
        else:
            el = derive_layout(
                shapes,
                hf_config,
                tp_rank=self.rank,
                tp_size=size,
                pad_vocab_to=int(options.get("pad_vocab_to", 64)),
            )
        mode = options.get("mode", "auto")
        if mode not in ("auto", "inplace", "rebuild"):
            raise ValueError(f"mode={mode!r}: expected 'auto', 'inplace' or 'rebuild'")
        rebuild = mode == "rebuild" or (mode == "auto" and current_platform.is_cpu())
        tensors: dict[str, torch.Tensor] = {}
        self._shadows: dict[str, dict[str, torch.Tensor]] = {}  # module -> param -> shadow
        self._modules: dict[str, torch.nn.Module] = {}  # modules rebuilt after a change
        self._modules_of: dict[str, set[str]] = {}  # HF name -> modules to rebuild
        shadowed: list[str] = []
        for name in el.layout.parts:
            p, mod = params[name], owner[name]
            mod_name, _, pname = name.rpartition(".")
            method = getattr(mod, "quant_method", None)
            if rebuild and method is not None:
                self._modules[mod_name] = mod
                for src in el.sources.get(name, ()):
                    self._modules_of.setdefault(src, set()).add(mod_name)
                if (
                    type(method).__name__ == "UnquantizedEmbeddingMethod"
                    and tuple(p.shape) == el.shapes[name]
                ):
                    tensors[name] = p.data  # embeddings keep their weight: in place, re-packed
                    continue
                shadow = torch.empty(el.shapes[name], dtype=p.dtype, device=p.device)
                self._shadows.setdefault(mod_name, {})[pname] = shadow
                tensors[name] = shadow
                shadowed.append(name)
            elif tuple(p.shape) != el.shapes[name] or not p.data.is_contiguous():
                raise LayoutError(
                    f"parameter {name} holds {list(p.shape)}, not its checkpoint shape "
                    f"{list(el.shapes[name])}: vLLM repacked it; attach with mode='rebuild'"
                )
            else:
                tensors[name] = p.data
        self.sharers: dict[str, str] = {}  # module -> the synced parameter it shares
        if rebuild:
            self._add_sharers(model, {n: params[n] for n in el.layout.parts}, el.sources)
        self.shadow_bytes = sum(
            t.numel() * t.element_size() for d in self._shadows.values() for t in d.values()
        )
        # the engine's own groups carry its collectives; a sync gets a group of its own
        self._group = dist.new_group(ranks=list(range(size)), backend="gloo") if size > 1 else None
        device = next(iter(tensors.values())).device
        common: dict[str, Any] = {
            "storage_options": storage_options,
            "layout": el.layout,
            "group": self._group,
            "device": device,
        }
        for key in ("max_workers", "max_inflight_bytes"):
            if key in options:
                common[key] = int(options[key])
        t0 = time.perf_counter()
        self.filled: dict[str, Any] | None = None
        if shadowed:  # the packed weights cannot be read back: fill the shadows from the store
            fill = Subscriber(
                url,
                **{**common, "layout": Layout({n: el.layout.parts[n] for n in shadowed})},
                tensors={n: tensors[n] for n in shadowed},
                lease_ttl=None,
            )
            self.filled = dataclasses.asdict(fill.sync(version))
        self._thread: threading.Thread | None = None
        self._result: dict[str, Any] | None = None
        self._rebuilt, self._rebuild_s = 0, 0.0
        self._pending: set[str] = set()  # modules written but not yet rebuilt
        self._gate = _Gate()
        self._gate.timeout_s = float(options.get("commit_timeout_s", 600.0))
        self.sub: Subscriber = Subscriber(
            url,
            **common,
            tensors=tensors,
            version=version,
            pause=self._gate.pause,
            reader_id=options.get("reader_id") or f"vllm-{socket.gethostname()}-{os.getpid()}",
            lease_ttl=None if options.get("lease_ttl") == 0 else options.get("lease_ttl", 600.0),
        )
        self.sub.verify()  # every held tensor is at `version` (engine parameters and shadows)
        if options.get("rebuild_on_attach", True):
            self._rebuild(set(self._modules))
        self.attach_s = time.perf_counter() - t0

    def _add_sharers(
        self,
        model: torch.nn.Module,
        synced: Mapping[str, torch.Tensor],
        sources: Mapping[str, Sequence[str]],
    ) -> None:
        """Rebuild, with the owner of a synced parameter, every other module that holds the
        same parameter (``named_parameters()`` names a shared parameter once, after its first
        owner): a tied LM head holds the embedding's weight, and on CPU it keeps a packed copy
        of it that only its own ``process_weights_after_loading`` refreshes."""
        by_id = {id(p): n for n, p in synced.items()}
        by_ptr = {p.data_ptr(): n for n, p in synced.items() if p.numel()}
        for mod_name, mod in model.named_modules():
            if mod_name in self._modules or getattr(mod, "quant_method", None) is None:
                continue
            for p in mod._parameters.values():
                if p is None:
                    continue
                name = by_id.get(id(p)) or (by_ptr.get(p.data_ptr()) if p.numel() else None)
                if name is None:
                    continue
                self._modules[mod_name] = mod
                self.sharers[mod_name] = name
                for src in sources.get(name, ()):
                    self._modules_of.setdefault(src, set()).add(mod_name)

    def _rebuild(self, names: set[str]) -> None:
        """Rebuild the kernels of modules ``names`` from their checkpoint-format tensors."""
        import torch

        t0 = time.perf_counter()
        for name in sorted(names):
            mod = self._modules[name]
            for pname, shadow in self._shadows.get(name, {}).items():
                # a copy: a kernel may keep (or repack into) the tensor it is given
                setattr(mod, pname, torch.nn.Parameter(shadow.clone(), requires_grad=False))
            method: Any = mod.quant_method
            if getattr(method, "moe_kernel", None) is not None:
                method.moe_kernel = None  # MoE: the first-load path prepacks the experts again
            method.process_weights_after_loading(mod)
        self._rebuilt += len(names)
        self._rebuild_s += time.perf_counter() - t0

    def _on_version(self, m: Manifest) -> None:
        """After ``m`` was written: rebuild the kernels of the modules it changed. Modules
        whose rebuild failed stay pending and are rebuilt first by the next sync."""
        if not self._modules:
            return
        if m.kind == "anchor":
            self._pending |= set(self._modules)
        for name, entry in m.tensors.items():
            if entry.changed:
                self._pending |= self._modules_of.get(name, set())
        self._rebuild_pending()

    def _rebuild_pending(self) -> None:
        while self._pending:
            name = min(self._pending)
            self._rebuild({name})
            self._pending.discard(name)

    def info(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "version": self.sub.version,
            "reader_id": self.sub.reader_id,
            "tensors": len(self.sub.tensors or {}),
            "rebuilt_modules": len(self._modules),
            "shared_modules": dict(self.sharers),
            "shadow_bytes": self.shadow_bytes,
            "attach_s": self.attach_s,
            "filled": self.filled,
        }

    def run(self, version: int | None) -> dict[str, Any]:
        """One sync to ``version`` (newest: None); the result as plain values."""
        self._rebuilt, self._rebuild_s = 0, 0.0
        out: dict[str, Any] = {"rank": self.rank, "from_version": self.sub.version}
        try:
            self._rebuild_pending()  # a previous sync wrote but failed to rebuild
            report = self.sub.sync(version, on_version=self._on_version)
            out.update(ok=True, report=dataclasses.asdict(report), error=None)
        except Exception as exc:
            log.warning("deltastore sync on rank %d failed: %s", self.rank, exc)
            out.update(ok=False, report=None, error=error_to_dict(exc))
        out.update(
            version=self.sub.version, rebuilt_modules=self._rebuilt, rebuild_s=self._rebuild_s
        )
        return out

    def prepare(self, version: int | None) -> dict[str, Any]:
        if self._thread is not None and self._thread.is_alive():
            raise EngineSyncError("a sync is under way on this worker; commit it first")
        self._gate.armed = True
        self._gate.ready.clear()
        self._gate.go.clear()
        self._result = None

        def work() -> None:
            self._result = self.run(version)

        self._thread = threading.Thread(target=work, name="deltastore-sync", daemon=True)
        self._thread.start()
        return self.status()

    def status(self) -> dict[str, Any]:
        if self._thread is not None and self._thread.is_alive():
            state = "ready" if self._gate.ready.is_set() else "preparing"
        elif self._result is not None:
            state = "done"
        else:
            state = "idle"
        return {"rank": self.rank, "state": state, "version": self.sub.version}

    def commit(self, timeout_s: float) -> dict[str, Any]:
        if self._thread is None:
            raise EngineSyncError("no sync to commit; call deltastore_prepare first")
        self._gate.go.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise EngineSyncError(f"the sync did not finish within {timeout_s:.0f} s of commit")
        self._thread, self._gate.armed = None, False
        result = self._result or {"rank": self.rank, "ok": False, "error": None}
        self._result = None
        return result


def _checkpoint_shape(module: Any, pname: str, param: torch.Tensor) -> tuple[int, ...]:
    """The checkpoint-format shape of ``module.pname``: as vLLM recorded it before processing
    the weights (it may have repacked them since), else the live shape."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # pragma: no cover - older vLLM
        return tuple(param.shape)
    info = LAYERWISE_INFO.get(module)
    meta = info.restore_metadata[0].get(pname) if info is not None else None
    return tuple(meta.shape) if meta is not None else tuple(param.shape)


class DeltastoreWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); call through
    ``collective_rpc("deltastore_...", args=...)``. Each method returns this worker's result as
    a dict of plain values; :func:`attach`, :func:`sync` and :func:`follow` call them for you.

    Call order: ``deltastore_attach`` once (all workers together), then either
    ``deltastore_sync`` (one call: fetch, verify, write), or ``deltastore_prepare`` (fetch and
    verify on a background thread while the engine keeps generating), ``deltastore_status``
    until every worker is ``ready`` or ``done``, the engine paused, ``deltastore_commit``
    (the write phase).
    """

    _deltastore: _Receiver | None = None

    def deltastore_attach(
        self,
        url: str,
        version: int,
        storage_options: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Bind this worker's parameters, which hold ``version`` of the store at ``url``
        (the engine was loaded from that version's checkpoint), and verify them once
        (Adler-32 of every local tensor; CPU shadows are filled from the store first).
        ``options``: ``mode`` ("auto" | "inplace" | "rebuild"), ``layout`` ("module:function"),
        ``pad_vocab_to`` (64), ``reader_id``, ``lease_ttl`` (s; 0: no lease), ``max_workers``,
        ``max_inflight_bytes``, ``commit_timeout_s`` (600), ``rebuild_on_attach`` (True).
        Raises :class:`LayoutError` when the model does not fit its preset and
        :class:`~deltastore.errors.TensorMismatchError` when the parameters are not at
        ``version``."""
        if self._deltastore is not None:
            self._deltastore.sub.close()
        self._deltastore = _Receiver(self, url, int(version), storage_options, dict(options or {}))
        return self._deltastore.info()

    def _deltastore_receiver(self) -> _Receiver:
        if self._deltastore is None:
            raise EngineSyncError("this worker is not attached; call deltastore_attach first")
        return self._deltastore

    def deltastore_sync(self, version: int | None = None) -> dict[str, Any]:
        """Fetch, verify and write the versions up to ``version`` (newest: None) in one call.
        Result: ``ok``, ``version`` (the one the worker holds now), ``report`` (a
        :class:`~deltastore.sync.subscriber.SyncReport` as a dict), ``error``
        (``{"type", "message"}`` or None), ``rebuilt_modules``, ``rebuild_s``."""
        return self._deltastore_receiver().run(version)

    def deltastore_prepare(self, version: int | None = None) -> dict[str, Any]:
        """Start a sync on a background thread; it stops before writing (state ``ready``)."""
        return self._deltastore_receiver().prepare(version)

    def deltastore_status(self) -> dict[str, Any]:
        """``state``: "idle", "preparing", "ready" (verified, waiting for the commit) or
        "done" (finished without writing: nothing new, or failed)."""
        return self._deltastore_receiver().status()

    def deltastore_commit(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Let a prepared sync write and wait for it; its result as :meth:`deltastore_sync`."""
        return self._deltastore_receiver().commit(timeout_s)

    def deltastore_info(self) -> dict[str, Any]:
        """The binding: version held, tensors, modules rebuilt on change, shadow bytes."""
        return self._deltastore_receiver().info()

    def deltastore_close(self) -> dict[str, Any]:
        """Release this worker's lease and its binding."""
        rec, self._deltastore = self._deltastore, None
        if rec is not None:
            rec.sub.close()
        return {"closed": rec is not None}


# --- driver side ------------------------------------------------------------------------


def raise_for_error(results: Sequence[Mapping[str, Any]]) -> None:
    """Raise the first worker error of ``results`` as its type of ``deltastore.errors``
    (:func:`error_from_dict`; :class:`EngineSyncError` for types not listed there), its
    message prefixed with the worker's rank."""
    for r in results:
        err = r.get("error")
        if err:
            raise error_from_dict(err, prefix=f"rank {r.get('rank')}: ")


def _changed(results: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any worker wrote (or rebuilt) weights: the prefix cache is then stale."""
    return any(r.get("rebuilt_modules") or (r.get("report") or {}).get("applied") for r in results)


def _is_async(engine: Any) -> bool:
    return asyncio.iscoroutinefunction(getattr(engine, "collective_rpc", None))


def attach(
    llm: Any,
    url: str | os.PathLike[str],
    *,
    version: int,
    storage_options: dict[str, Any] | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """Bind every worker of ``llm`` (an ``LLM``) to ``version`` of the store at ``url``
    (see :meth:`DeltastoreWorkerExtension.deltastore_attach`); results per worker."""
    out: list[dict[str, Any]] = llm.collective_rpc(
        "deltastore_attach", args=(os.fspath(url), version, storage_options, options)
    )
    llm.reset_prefix_cache()
    return out


def sync(llm: Any, version: int | None = None, *, check: bool = False) -> list[dict[str, Any]]:
    """Bring every worker of ``llm`` (an ``LLM``, not generating meanwhile: its calls block)
    to ``version`` (newest: None) and reset the prefix cache. ``check``: raise the workers'
    typed error (:func:`raise_for_error`) instead of returning it."""
    out: list[dict[str, Any]] = llm.collective_rpc("deltastore_sync", args=(version,))
    if _changed(out):
        llm.reset_prefix_cache()
    if check:
        raise_for_error(out)
    return out


async def attach_async(
    engine: Any,
    url: str | os.PathLike[str],
    *,
    version: int,
    storage_options: dict[str, Any] | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """:func:`attach` for an ``AsyncLLM``."""
    out: list[dict[str, Any]] = await engine.collective_rpc(
        "deltastore_attach", args=(os.fspath(url), version, storage_options, options)
    )
    await engine.reset_prefix_cache()
    return out


async def sync_async(
    engine: Any,
    version: int | None = None,
    *,
    check: bool = False,
    pause_mode: str = "wait",
    poll_s: float = 0.02,
    commit_timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    """Sync an ``AsyncLLM`` while it serves: the workers fetch and verify in the background;
    once all are ready, generation is paused (``pause_mode``: vLLM's "wait" lets requests in
    flight finish first, "keep" freezes them, "abort" ends them), the changes are written,
    the prefix cache is reset and generation resumes (also when writing failed)."""
    await engine.collective_rpc("deltastore_prepare", args=(version,))
    while True:
        states = await engine.collective_rpc("deltastore_status")
        if all(s["state"] in ("ready", "done") for s in states):
            break
        await asyncio.sleep(poll_s)
    paused = any(s["state"] == "ready" for s in states)
    if paused:
        await engine.pause_generation(mode=pause_mode, clear_cache=False)
    try:
        out: list[dict[str, Any]] = await engine.collective_rpc(
            "deltastore_commit", args=(commit_timeout_s,)
        )
        if _changed(out):
            await engine.reset_prefix_cache()
    finally:
        if paused:
            await engine.resume_generation()
    if check:
        raise_for_error(out)
    return out


@dataclasses.dataclass
class Followed:
    """What :func:`follow` did: the version the engine serves, syncs that applied and failed."""

    version: int
    synced: int = 0
    failed: int = 0
    last: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def follow(
    engine: Any,
    url: str | os.PathLike[str],
    *,
    version: int,
    storage_options: dict[str, Any] | None = None,
    interval: float = 5.0,
    max_interval: float = 60.0,
    until: int | None = None,
    stop: threading.Event | None = None,
    on_sync: Callable[[list[dict[str, Any]]], None] | None = None,
    **options: Any,
) -> Followed | Awaitable[Followed]:
    """Attach ``engine`` (an ``LLM``, or an ``AsyncLLM``: then ``await follow(...)``) at
    ``version`` and follow the store: poll (one request) ``interval`` seconds after a new
    version, 1.5 times longer after each poll that finds nothing new and twice as long after
    a failure, never more than ``max_interval`` (±20% jitter;
    :class:`~deltastore.sync.poll.PollSchedule`), sync each new version, call
    ``on_sync`` with the workers' results. Stops when the engine holds ``until`` or ``stop``
    is set. A failed sync leaves the engine at the version it had; it is logged and retried
    at the next poll. ``options``: :meth:`DeltastoreWorkerExtension.deltastore_attach`'s."""
    if _is_async(engine):
        return _follow_async(
            engine, url, version, storage_options, interval, max_interval, until, stop, on_sync,
            options,
        )  # fmt: skip
    attach(engine, url, version=version, storage_options=storage_options, **options)
    poll = _Poller(url, storage_options, version, interval, max_interval)
    while not poll.done(until, stop):
        newest = poll.newest()
        if newest is not None and newest > poll.held:
            poll.record(sync(engine, newest), on_sync)
        poll.wait(stop)
    return poll.result


async def _follow_async(
    engine: Any,
    url: str | os.PathLike[str],
    version: int,
    storage_options: dict[str, Any] | None,
    interval: float,
    max_interval: float,
    until: int | None,
    stop: threading.Event | None,
    on_sync: Callable[[list[dict[str, Any]]], None] | None,
    options: dict[str, Any],
) -> Followed:
    await attach_async(engine, url, version=version, storage_options=storage_options, **options)
    poll = _Poller(url, storage_options, version, interval, max_interval)
    while not poll.done(until, stop):
        newest = await asyncio.to_thread(poll.newest)
        if newest is not None and newest > poll.held:
            poll.record(await sync_async(engine, newest), on_sync)
        await asyncio.sleep(poll.delay())
    return poll.result


class _Poller:
    """The driver's poll of the store and the follow loop's bookkeeping."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        storage_options: dict[str, Any] | None,
        version: int,
        interval: float,
        max_interval: float,
    ) -> None:
        from deltastore.catalog.chain import ChainReader
        from deltastore.store import open_store
        from deltastore.sync.poll import PollSchedule

        self.schedule = PollSchedule(interval, max_interval)
        self._chain = ChainReader(open_store(url, storage_options))
        self._chain.note(version)  # a poll lists only after it
        self.held = version
        self.result = Followed(version)

    def newest(self) -> int | None:
        """The newest committed version (None: nothing new, or the poll failed)."""
        try:
            newest = self._chain.latest()
        except DeltastoreError as exc:  # a store hiccup: poll again later
            log.warning("deltastore poll failed: %s", exc)
            self.schedule.failed()
            return None
        if newest is None or newest <= self.held:
            self.schedule.idle()
        return newest

    def record(
        self, results: list[dict[str, Any]], on_sync: Callable[[list[dict[str, Any]]], None] | None
    ) -> None:
        self.result.last = results
        if all(r.get("ok") for r in results):
            self.held = min(int(r["version"]) for r in results)
            self.result.version = self.held
            self.result.synced += 1
            self.schedule.found()
        else:
            self.result.failed += 1
            self.schedule.failed()
            err = next((r["error"] for r in results if r.get("error")), None)
            log.warning("deltastore sync failed, the engine keeps version %d: %s", self.held, err)
        if on_sync is not None:
            on_sync(results)

    def done(self, until: int | None, stop: threading.Event | None) -> bool:
        return (until is not None and self.held >= until) or (stop is not None and stop.is_set())

    def delay(self) -> float:
        return self.schedule.delay()

    def wait(self, stop: threading.Event | None) -> None:
        if stop is not None:
            stop.wait(self.delay())
        else:
            time.sleep(self.delay())


__all__ = [
    "EXTENSION",
    "DeltastoreWorkerExtension",
    "EngineLayout",
    "EngineSyncError",
    "Followed",
    "attach",
    "attach_async",
    "derive_layout",
    "error_from_dict",
    "error_to_dict",
    "follow",
    "raise_for_error",
    "sync",
    "sync_async",
]
