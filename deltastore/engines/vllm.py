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
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from deltastore.engines.vllm_layout import EngineLayout, derive_layout
from deltastore.engines.vllm_worker import Receiver
from deltastore.engines.worker_errors import error_from_dict, error_to_dict
from deltastore.errors import DeltastoreError, EngineSyncError

log = logging.getLogger(__name__)

#: ``worker_extension_cls`` for vLLM.
EXTENSION = "deltastore.engines.vllm.DeltastoreWorkerExtension"


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

    _deltastore: Receiver | None = None

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
        self._deltastore = Receiver(self, url, int(version), storage_options, dict(options or {}))
        return self._deltastore.info()

    def _deltastore_receiver(self) -> Receiver:
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
