"""The worker side of the vLLM adapter: one worker's binding of its parameters to a store
(:class:`Receiver`), made by ``deltastore_attach`` and driven by the extension's methods
(:mod:`deltastore.engines.vllm`). Runs inside vLLM's worker processes; imports vLLM lazily.

Thread-safety: one sync runs at a time per worker; a two-phase sync runs its fetch and verify on
a background thread and its write phase after the driver's commit (:class:`_Gate`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from deltastore.engines.vllm_layout import worker_layout
from deltastore.engines.vllm_refresh import (
    find_consumers,
    modules_of_sources,
    refresh,
    refresh_order,
    stale,
)
from deltastore.engines.worker_errors import error_to_dict
from deltastore.errors import EngineSyncError, LayoutError
from deltastore.layout.boxes import Layout
from deltastore.sync.priority import (
    DEFAULT_PRIORITY,
    Priority,
    check_priority,
    lower_current_thread,
    restore_current_thread,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    import torch

    from deltastore.format.manifest import Manifest
    from deltastore.sync.group import Group
    from deltastore.sync.subscriber import Subscriber

log = logging.getLogger(__name__)


class _Gate:
    """The write phase's pause hook in a two-phase sync: says "ready", then waits for the
    driver's commit (the engine is paused by then)."""

    def __init__(self) -> None:
        self.armed = False
        self.ready = threading.Event()
        self.go = threading.Event()
        self.timeout_s = 600.0
        self.priority: Priority = 0  # the sync thread's own, given back for the write phase

    def pause(self) -> None:
        if not self.armed:
            return
        self.ready.set()
        if not self.go.wait(self.timeout_s):
            raise EngineSyncError(
                f"no commit within {self.timeout_s:.0f} s of the sync being ready; nothing was "
                "written (call deltastore_commit after deltastore_prepare)"
            )
        restore_current_thread(self.priority)  # generation is paused: write at full speed


def _stored_dtypes(
    url: str, version: int, storage_options: Mapping[str, Any] | None
) -> dict[str, str]:
    """The dtype (name) of every tensor of ``version``'s manifest in the store at ``url``."""
    from deltastore.catalog.chain import ChainReader
    from deltastore.store.registry import open_store

    manifest = ChainReader(open_store(url, dict(storage_options or {}))).manifest(version)
    return {n: e.dtype for n, e in manifest.tensors.items()}


class Receiver:
    """One worker's binding: the Subscriber over its parameters (and shadows), the modules to
    rebuild on CPU, the state of a two-phase sync."""

    def __init__(
        self,
        worker: Any,
        url: str,
        version: int,
        storage_options: dict[str, Any] | None,
        options: dict[str, Any],
        before_collectives: Callable[[], None] | None = None,
    ) -> None:
        import torch
        import torch.distributed as dist
        from vllm.distributed import parallel_state as ps
        from vllm.platforms import current_platform

        from deltastore.sync.subscriber import Subscriber

        known = {
            "mode", "layout", "pad_vocab_to", "reader_id", "lease_ttl", "max_workers",
            "max_inflight_bytes", "commit_timeout_s", "rebuild_on_attach", "priority",
            "trace_cache", "threads",
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
        self.rank = ps.get_tensor_model_parallel_rank()
        params = dict(model.named_parameters())
        owner = {n: model.get_submodule(n.rpartition(".")[0]) for n in params}
        shapes = {
            n: _checkpoint_shape(owner[n], n.rpartition(".")[2], p) for n, p in params.items()
        }
        # the layout: traced from the model's own load_weights (default, cached), the
        # presets (layout="preset") or a custom function (layout="package.module:function")
        el, self.derived = worker_layout(
            options.get("layout"), model, config, shapes, url=url, version=version,
            storage_options=storage_options, tp_rank=self.rank, tp_size=size,
            pad_vocab_to=int(options.get("pad_vocab_to", 64)),
            cache=bool(options.get("trace_cache", True)),
        )  # fmt: skip
        mode = options.get("mode", "auto")
        if mode not in ("auto", "inplace", "rebuild"):
            raise ValueError(f"mode={mode!r}: expected 'auto', 'inplace' or 'rebuild'")
        rebuild = mode == "rebuild" or (mode == "auto" and current_platform.is_cpu())
        tensors: dict[str, torch.Tensor] = {}
        self._shadows: dict[str, dict[str, torch.Tensor]] = {}  # module -> param -> shadow
        synced = {n: params[n] for n in el.layout.parts}
        # every module to refresh after a change, as vLLM's loader processes it (vllm_refresh)
        self._consumers = find_consumers(model, synced, derived=el.derived, rebuild=rebuild)
        self._dtype = config.model_config.dtype
        shadowed: list[str] = []
        stored: dict[str, str] | None = None  # HF tensor -> stored dtype, read when needed
        for name in el.layout.parts:
            p, mod = params[name], owner[name]
            mod_name, _, pname = name.rpartition(".")
            kind = self._consumers[mod_name].kind if mod_name in self._consumers else None
            if rebuild and kind == "quant":
                if (
                    type(mod.quant_method).__name__ == "UnquantizedEmbeddingMethod"
                    and tuple(p.shape) == el.shapes[name]
                ):
                    tensors[name] = p.data  # embeddings keep their weight: in place, re-packed
                    continue
                if stored is None:
                    stored = _stored_dtypes(url, version, storage_options)
                # in the checkpoint's dtype: vLLM's post-load processing may have changed the
                # parameter's (the CPU's small-GEMM path keeps a linear's bias in float32),
                # and it runs again on what a refresh gives it
                kinds = {stored[s] for s in el.sources.get(name, ()) if s in stored}
                from deltastore.tensors.dtypes import dtype_from_name

                held = dtype_from_name(kinds.pop()) if len(kinds) == 1 else p.dtype
                shadow = torch.empty(el.shapes[name], dtype=held, device=p.device)
                self._shadows.setdefault(mod_name, {})[pname] = shadow
                tensors[name] = shadow
                shadowed.append(name)
            elif tuple(p.shape) != el.shapes[name] or not p.data.is_contiguous():
                why = (
                    f"holds {list(p.shape)}, not its checkpoint shape {list(el.shapes[name])}"
                    if tuple(p.shape) != el.shapes[name]
                    else f"is not contiguous (strides {list(p.data.stride())})"
                )
                raise LayoutError(
                    f"parameter {name} {why}: vLLM repacked it; attach with mode='rebuild'"
                )
            else:
                tensors[name] = p.data
        self.sharers: dict[str, str] = {}  # module -> the synced parameter it shares
        by_id = {id(p): n for n, p in synced.items()}
        for mod_name, c in self._consumers.items():
            if c.kind != "quant":
                continue
            for pname, p in c.module._parameters.items():
                src = by_id.get(id(p)) if p is not None else None
                if src is None or src.rpartition(".")[0] == mod_name:
                    continue
                self.sharers[mod_name] = src  # e.g. a tied LM head: the embedding's weight
                src_mod, _, src_p = src.rpartition(".")
                if src_p in self._shadows.get(src_mod, {}):  # its own copy of the shadow
                    self._shadows.setdefault(mod_name, {})[pname] = self._shadows[src_mod][src_p]
        self._modules_of = modules_of_sources(self._consumers, el.sources)
        self._sources_of: dict[str, set[str]] = {}  # consumer -> the HF tensors it reads
        for src, names in self._modules_of.items():
            for n in names:
                self._sources_of.setdefault(n, set()).add(src)
        self.shadow_bytes = sum(
            t.numel() * t.element_size() for d in self._shadows.values() for t in d.values()
        )
        # the engine's own groups carry its collectives; a sync gets a group of its own
        if before_collectives is not None:  # the ranks agree that all got here (or all stop)
            before_collectives()
        self._group = dist.new_group(ranks=list(range(size)), backend="gloo") if size > 1 else None
        device = next(iter(tensors.values())).device
        common: dict[str, Any] = {
            "storage_options": storage_options,
            "layout": el.layout,
            "group": self._group,
            "device": device,
        }
        for key in ("max_workers", "max_inflight_bytes", "threads"):
            if key in options:
                common[key] = int(options[key])
        # a background sync's thread (and the pool it starts) yields the cores to serving
        self._priority = check_priority(options.get("priority", DEFAULT_PRIORITY))
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
        self._refreshed: list[str] = []  # consumers refreshed by the current sync, in order
        self._pending: set[str] = set()  # consumers written but not yet refreshed
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
            self._rebuild(set(self._consumers))
        self.attach_s = time.perf_counter() - t0

    def _rebuild(self, names: set[str]) -> None:
        """Refresh the consumers ``names`` (:mod:`deltastore.engines.vllm_refresh`) in vLLM's
        order of post-load processing; each one is taken off the pending set once refreshed.
        Raises :class:`EngineSyncError` naming the first that fails (it stays pending)."""
        t0 = time.perf_counter()
        try:
            for name in refresh_order(names, self._consumers):
                c = self._consumers[name]
                try:
                    refresh(name, c, self._shadows.get(name, {}), self._dtype)
                except Exception as exc:
                    raise EngineSyncError(
                        f"refreshing {name} ({c.kind}) after the weights it reads changed "
                        f"failed: {type(exc).__name__}: {exc}; the engine would serve stale "
                        "outputs from it: do not serve from this engine until a sync reports "
                        "ok (the next sync refreshes it again first)"
                    ) from exc
                self._pending.discard(name)
                self._refreshed.append(name)
                self._rebuilt += 1
        finally:
            self._rebuild_s += time.perf_counter() - t0

    def _on_version(self, m: Manifest) -> None:
        """After ``m`` was written: refresh every consumer of a tensor it changed (all of them
        after an anchor). Those whose refresh failed stay pending and are refreshed first by
        the next sync."""
        if not self._consumers:
            return
        if m.kind == "anchor":
            self._pending |= set(self._consumers)
        else:
            self._pending |= stale([n for n, e in m.tensors.items() if e.changed], self._modules_of)
        self._rebuild_pending()

    def _rebuild_pending(self) -> None:
        if self._pending:
            self._rebuild(set(self._pending))

    def info(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "version": self.sub.version,
            "reader_id": self.sub.reader_id,
            "tensors": len(self.sub.tensors or {}),
            "rebuilt_modules": len(self._consumers),
            # each module refreshed after a change: how, and after a change of which HF tensors
            "consumers": {
                n: {"kind": c.kind, "sources": sorted(self._sources_of.get(n, ()))}
                for n, c in self._consumers.items()
            },
            "shared_modules": dict(self.sharers),
            "shadow_bytes": self.shadow_bytes,
            "attach_s": self.attach_s,
            "filled": self.filled,
        }

    def run(self, version: int | None) -> dict[str, Any]:
        """One sync to ``version`` (newest: None); the result as plain values: ``ok`` only when
        every version was applied and every consumer of what it changed was refreshed
        (``refreshed``: their names, in order; ``pending``: those still stale)."""
        self._rebuilt, self._rebuild_s, self._refreshed = 0, 0.0, []
        out: dict[str, Any] = {"rank": self.rank, "from_version": self.sub.version}
        try:
            self._rebuild_pending()  # a previous sync wrote but failed to rebuild
            report = self.sub.sync(version, on_version=self._on_version)
            out.update(ok=True, report=dataclasses.asdict(report), error=None)
        except Exception as exc:
            log.warning("deltastore sync on rank %d failed: %s", self.rank, exc)
            out.update(ok=False, report=None, error=error_to_dict(exc))
        out.update(
            version=self.sub.version,
            rebuilt_modules=self._rebuilt,
            rebuild_s=self._rebuild_s,
            refreshed=list(self._refreshed),
            pending=sorted(self._pending),
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
            self._gate.priority = lower_current_thread(self._priority)
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


def tp_group() -> tuple[Group, int]:
    """The group the TP ranks of this worker's engine agree over (vLLM's TP CPU group; a
    group of one at TP 1) and this worker's TP rank. Imports vLLM (on a worker only)."""
    from vllm.distributed import parallel_state as ps

    from deltastore.sync.group import Group

    tp = ps.get_tp_group()
    return (Group(tp.cpu_group) if tp.world_size > 1 else Group(None)), tp.rank_in_group


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
