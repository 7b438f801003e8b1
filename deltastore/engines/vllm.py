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
the typed error (``{"error": {"type": "IntegrityError", "message": ...}}``). No worker method
raises into vLLM's RPC layer, and the ranks agree before every step that needs them all, so a
failure on one rank neither leaves a reply queued for the next call nor strands the other
ranks in a collective; the driver raises the failed rank's own error type (docs/engines.md,
"Failure behaviour").

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
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from deltastore.engines.vllm_layout import EngineLayout, derive_layout
from deltastore.engines.vllm_worker import Receiver, tp_group
from deltastore.engines.worker_errors import (
    agree,
    agreed,
    error_from_dict,
    error_to_dict,
    root_cause,
)
from deltastore.errors import DeltastoreError, EngineSyncError

if TYPE_CHECKING:
    from deltastore.sync.group import Group

log = logging.getLogger(__name__)

#: ``worker_extension_cls`` for vLLM.
EXTENSION = "deltastore.engines.vllm.DeltastoreWorkerExtension"


class DeltastoreWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); call through
    ``collective_rpc("deltastore_...", args=..., kwargs={"call": ...})``. Each method returns
    this worker's result as a dict of plain values; :func:`attach`, :func:`sync` and
    :func:`follow` call them for you.

    Call order: ``deltastore_attach`` once (all workers together), then either
    ``deltastore_sync`` (one call: fetch, verify, write), or ``deltastore_prepare`` (fetch and
    verify on a background thread while the engine keeps generating), ``deltastore_status``
    until every worker is ``ready`` or ``done``, the engine paused, ``deltastore_commit``
    (the write phase).

    No method raises: every result carries ``ok``, ``error`` (None, or ``{"type", "message",
    "fields"}``: :func:`error_to_dict`), ``rank`` (the TP rank) and ``call`` (the caller's
    token, echoed so the driver can tell this call's reply from an earlier one's). vLLM's
    ``collective_rpc`` stops reading replies at the first rank whose method raised and leaves
    the later ranks' replies queued, to be returned by the next call; a result never does that.
    Steps that start collectives (attach, sync, prepare) first make the ranks agree
    (:func:`~deltastore.engines.worker_errors.agree`, over vLLM's TP CPU group): when one rank
    fails, the others stop with :class:`~deltastore.errors.RankError` instead of waiting in a
    collective that rank never joins.
    """

    _deltastore: Receiver | None = None

    def deltastore_attach(
        self,
        url: str,
        version: int,
        storage_options: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        *,
        call: str | None = None,
    ) -> dict[str, Any]:
        """Bind this worker's parameters, which hold ``version`` of the store at ``url``
        (the engine was loaded from that version's checkpoint), and verify them once
        (Adler-32 of every local tensor; CPU shadows are filled from the store first).
        ``options``: ``mode`` ("auto" | "inplace" | "rebuild"), ``layout`` ("module:function"),
        ``pad_vocab_to`` (64), ``reader_id``, ``lease_ttl`` (s; 0: no lease), ``max_workers``,
        ``max_inflight_bytes``, ``threads`` (the threads that decode and write; default: every
        CPU), ``commit_timeout_s`` (600), ``rebuild_on_attach`` (True), ``priority`` (19: the
        nice value of a prepared sync's threads, 1-19; "idle": ``SCHED_IDLE``; 0: unchanged;
        :mod:`deltastore.sync.priority`).
        The error is a :class:`LayoutError` when the model does not fit its layout and a
        :class:`~deltastore.errors.TensorMismatchError` when the parameters are not at
        ``version``. Binds on every rank or on none: a failed attach (on any rank) leaves each
        worker's previous binding, or none, in place. While the new binding is made the old
        one is kept, so the CPU shadows exist twice for that time."""
        return self._deltastore_answer(
            call, lambda: self._deltastore_attach(url, int(version), storage_options, options)
        )

    def deltastore_sync(
        self, version: int | None = None, *, call: str | None = None
    ) -> dict[str, Any]:
        """Fetch, verify and write the versions up to ``version`` (newest: None) in one call.
        Result: ``ok``, ``version`` (the one the worker holds now), ``report`` (a
        :class:`~deltastore.sync.subscriber.SyncReport` as a dict), ``error``
        (``{"type", "message"}`` or None), ``rebuilt_modules``, ``rebuild_s``."""
        return self._deltastore_answer(call, lambda: self._deltastore_ready().run(version))

    def deltastore_prepare(
        self, version: int | None = None, *, call: str | None = None
    ) -> dict[str, Any]:
        """Start a sync on a background thread; it stops before writing (state ``ready``)."""
        return self._deltastore_answer(call, lambda: self._deltastore_ready().prepare(version))

    def deltastore_status(self, *, call: str | None = None) -> dict[str, Any]:
        """``state``: "idle", "preparing", "ready" (verified, waiting for the commit) or
        "done" (finished without writing: nothing new, or failed)."""
        return self._deltastore_answer(call, lambda: self._deltastore_receiver().status())

    def deltastore_commit(
        self, timeout_s: float = 600.0, *, call: str | None = None
    ) -> dict[str, Any]:
        """Let a prepared sync write and wait for it; its result as :meth:`deltastore_sync`."""
        return self._deltastore_answer(call, lambda: self._deltastore_receiver().commit(timeout_s))

    def deltastore_info(self, *, call: str | None = None) -> dict[str, Any]:
        """The binding: version held, tensors, modules rebuilt on change, shadow bytes."""
        return self._deltastore_answer(call, lambda: self._deltastore_receiver().info())

    def deltastore_close(self, *, call: str | None = None) -> dict[str, Any]:
        """Release this worker's lease and its binding."""

        def close() -> dict[str, Any]:
            rec, self._deltastore = self._deltastore, None
            if rec is not None:
                rec.sub.close()
            return {"closed": rec is not None}

        return self._deltastore_answer(call, close)

    # --- helpers (not RPC methods) ---

    def _deltastore_answer(
        self, call: str | None, step: Callable[[], Mapping[str, Any]]
    ) -> dict[str, Any]:
        """``step()``'s result with ``ok``, ``error``, ``rank`` and ``call``; whatever it
        raises becomes ``{"ok": False, "error": error_to_dict(exc)}`` (logged with its
        traceback here, in the worker's log)."""
        try:
            rank: int | None = _tp(self)[1]
        except Exception:  # vLLM's groups are gone (shutting down): the step says so too
            rank = None
        try:
            out = dict(step())
        except Exception as exc:
            log.warning("deltastore on rank %s failed", rank, exc_info=True)
            out = {"ok": False, "error": error_to_dict(exc)}
        out.setdefault("ok", True)
        out.setdefault("error", None)
        out.setdefault("rank", rank)
        out["call"] = call
        return out

    def _deltastore_receiver(self) -> Receiver:
        if self._deltastore is None:
            raise EngineSyncError("this worker is not attached; call deltastore_attach first")
        return self._deltastore

    def _deltastore_ready(self) -> Receiver:
        """The binding, once every rank agreed that it has one with no sync under way (a
        sync's collectives need all ranks)."""
        group = _tp(self)[0]
        try:
            rec = self._deltastore_receiver()
            if rec.status()["state"] in ("preparing", "ready"):
                raise EngineSyncError(
                    "a prepared sync is under way on this worker; call deltastore_commit first"
                )
        except Exception as exc:
            agree(group, error_to_dict(exc))
            raise
        agree(group, None)
        return rec

    def _deltastore_attach(
        self,
        url: str,
        version: int,
        storage_options: dict[str, Any] | None,
        options: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """Make the new binding, agreeing with the other ranks twice: before the binding's
        first collective (a rank that failed its local checks stops them all there), and
        after it (a rank that failed later makes the others drop their new binding)."""
        group = _tp(self)[0]
        old = self._deltastore

        def make(before_collectives: Callable[[], None]) -> Receiver:
            if old is not None and old.status()["state"] in ("preparing", "ready"):
                raise EngineSyncError(
                    "a prepared sync is under way on this worker; call deltastore_commit "
                    "before attaching again"
                )
            return Receiver(
                self, url, version, storage_options, dict(options or {}), before_collectives
            )

        rec = agreed(group, make, after=True)
        try:  # after the binding's collectives (or, if it had none, the only agreement)
            agree(group, None)
        except Exception:
            rec.sub.close()
            raise
        self._deltastore = rec
        if old is not None:
            old.sub.close()
        return rec.info()


def _tp(worker: Any) -> tuple[Group, int]:
    """:func:`~deltastore.engines.vllm_worker.tp_group` of ``worker``'s engine (the worker is
    what a test's fake engine tells its ranks apart by)."""
    return tp_group()


# --- driver side ------------------------------------------------------------------------


def raise_for_error(results: Sequence[Mapping[str, Any]]) -> None:
    """Raise the error of the rank that failed (a :class:`~deltastore.errors.RankError` of a
    rank that stopped because another failed only when no other error is there) as its type
    of ``deltastore.errors`` (:func:`error_from_dict`; :class:`EngineSyncError` for types not
    listed there), its message prefixed with the worker's rank."""
    r = root_cause(results)
    if r is None:
        return
    err = r.get("error") or {"type": "EngineSyncError", "message": "failed without an error"}
    raise error_from_dict(err, prefix=f"rank {r.get('rank')}: ")


def _escaped(method: str, exc: BaseException) -> EngineSyncError:
    return EngineSyncError(
        f"{method} failed in vLLM's collective_rpc, outside deltastore's worker methods "
        f"({type(exc).__name__}: {exc}). vLLM stops reading the workers' replies at the first "
        "rank that failed, so the engine's RPC channel may now be out of step: restart the "
        f"engine. (Was it launched with worker_extension_cls={EXTENSION!r}, and the same "
        "deltastore on the workers as here?)"
    )


def _answers(method: str, call: str, out: Any) -> list[dict[str, Any]]:
    """The workers' results of call ``call``, checked to be replies to that call."""
    if not isinstance(out, list) or not all(isinstance(r, dict) for r in out):
        raise EngineSyncError(
            f"{method}: the workers replied {type(out).__name__}, not one dict per rank; "
            "restart the engine"
        )
    stale = [r.get("rank", i) for i, r in enumerate(out) if r.get("call") != call]
    if stale:
        raise EngineSyncError(
            f"{method}: rank(s) {stale} replied to an earlier call, not this one: the engine's "
            "RPC channel is out of step (an earlier collective_rpc failed in vLLM, which then "
            "stops reading the later ranks' replies): restart the engine"
        )
    return out


def _rpc(engine: Any, method: str, *args: Any) -> list[dict[str, Any]]:
    """``engine.collective_rpc(method, args)`` (an ``LLM``), each rank's reply checked."""
    call = uuid.uuid4().hex
    try:
        out = engine.collective_rpc(method, args=args, kwargs={"call": call})
    except Exception as exc:
        raise _escaped(method, exc) from exc
    return _answers(method, call, out)


async def _rpc_async(engine: Any, method: str, *args: Any) -> list[dict[str, Any]]:
    """:func:`_rpc` for an ``AsyncLLM``."""
    call = uuid.uuid4().hex
    try:
        out = await engine.collective_rpc(method, args=args, kwargs={"call": call})
    except Exception as exc:
        raise _escaped(method, exc) from exc
    return _answers(method, call, out)


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
    (see :meth:`DeltastoreWorkerExtension.deltastore_attach`); results per worker. Raises the
    failed rank's error (:func:`raise_for_error`: a :class:`LayoutError`, ...); the workers
    then keep the binding they had (or none), and the engine serves on."""
    out = _rpc(llm, "deltastore_attach", os.fspath(url), version, storage_options, options)
    raise_for_error(out)
    llm.reset_prefix_cache()
    return out


def sync(llm: Any, version: int | None = None, *, check: bool = False) -> list[dict[str, Any]]:
    """Bring every worker of ``llm`` (an ``LLM``, not generating meanwhile: its calls block)
    to ``version`` (newest: None) and reset the prefix cache. ``check``: raise the workers'
    typed error (:func:`raise_for_error`) instead of returning it. A failure inside vLLM's
    RPC (not a worker's result) raises :class:`EngineSyncError` either way."""
    out = _rpc(llm, "deltastore_sync", version)
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
    out = await _rpc_async(
        engine, "deltastore_attach", os.fspath(url), version, storage_options, options
    )
    raise_for_error(out)
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
    the prefix cache is reset and generation resumes (also when writing failed). A prepare
    that failed (on any rank: then none started) is returned (``check``: raised) as a sync
    result; a status poll that failed raises."""
    started = await _rpc_async(engine, "deltastore_prepare", version)
    if root_cause(started) is not None:
        if check:
            raise_for_error(started)
        return started
    while True:
        states = await _rpc_async(engine, "deltastore_status")
        raise_for_error(states)
        if all(s["state"] in ("ready", "done") for s in states):
            break
        await asyncio.sleep(poll_s)
    paused = any(s["state"] == "ready" for s in states)
    if paused:
        await engine.pause_generation(mode=pause_mode, clear_cache=False)
    try:
        out = await _rpc_async(engine, "deltastore_commit", commit_timeout_s)
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
