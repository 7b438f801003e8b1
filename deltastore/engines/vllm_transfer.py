"""deltastore as a vLLM weight-transfer backend: ``weight_transfer_config={"backend":
"deltastore"}``, driven by vLLM's own update calls (``LLM`` / ``AsyncLLM`` methods and the HTTP
routes of ``vllm serve``).

vLLM 0.32 looks for weight updates in its weight-transfer engine registry
(``vllm.distributed.weight_transfer.WeightTransferEngineFactory``); this module registers the
backend ``"deltastore"`` there (:func:`register`, the ``vllm.general_plugins`` entry point
``deltastore``, loaded by vLLM in every process), so a framework that already speaks vLLM's
update API gets deltastore by one config string::

    llm = LLM(model="/ckpt/v0", weight_transfer_config={"backend": "deltastore"})
    llm.start_weight_update()
    llm.update_weights({"update_info": {"url": "s3://bucket/run", "version": 3}})
    llm.finish_weight_update()
    llm.reset_prefix_cache()        # as after any backend's update: cached KV is stale

Over HTTP (``VLLM_SERVER_DEV_MODE=1 vllm serve /ckpt/v0 --weight-transfer-config
'{"backend": "deltastore"}'``): ``POST /pause`` (clears the prefix cache),
``/start_weight_update``, ``/update_weights`` with body ``{"update_info": {...}}``,
``/finish_weight_update``, ``/resume``.

Update info (:class:`UpdateInfo`, plain JSON values): ``version`` (the version to go to; the
versions between are applied in order), ``url`` and ``storage_options`` (the store; may be
left out after ``init_weight_transfer_engine`` named it), ``from_version`` (the version the
engine's weights are at when it is first bound; default: the version recorded in the model
folder's ``.deltastore.json`` by ``deltastore pull``), ``options`` (binding options, as
``deltastore_attach``'s: ``mode``, ``layout``, ``reader_id``, ``lease_ttl``, ...). The init
info (:class:`InitInfo`: ``url``, ``version``, ``storage_options``, ``options``) binds the
workers ahead of the first update, at ``version``.

Each worker syncs its own parameters with the worker extension's machinery
(:class:`~deltastore.engines.vllm_worker.Receiver`): fetch and decode its share of the frames,
verify with the other ranks, write in vLLM's coordinates, rebuild repacked modules (CPU).
``update_weights`` returns once the weights are written (``start_weight_update`` and
``finish_weight_update`` have nothing to do). A failed update (a corrupted frame, a version
the store lacks, a store error) writes nothing or rolls back what it wrote: the engine keeps
serving the version it had, and the call raises: the deltastore error type where the worker
runs in the caller's process, else vLLM's ``Exception`` (HTTP: status 500) whose message holds
``deltastore update to version V failed on rank R (<type>): ...``. A failed ``update_weights``
ends vLLM's update session on that worker: the next update starts with
``start_weight_update``. The ranks agree on the outcome first and only the last rank raises,
so vLLM reads every rank's reply (it stops at the first failed one and would leave the others
queued, to be read as the answers to the next call); at TP > 1 the other ranks' sessions stay
open: call ``finish_weight_update`` before the next ``start_weight_update``.

This module imports no vLLM until vLLM calls it (:func:`register`, :func:`engine_class`);
importing it is cheap. Thread-safety: vLLM calls one method at a time per worker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from deltastore.engines.worker_errors import (
    agreed,
    error_from_dict,
    error_to_dict,
    gather_errors,
    root_cause,
)
from deltastore.errors import EngineSyncError

if TYPE_CHECKING:
    import torch

    from deltastore.engines.vllm_worker import Receiver
    from deltastore.sync.group import Group

log = logging.getLogger(__name__)

#: The backend's name in vLLM's registry (``weight_transfer_config={"backend": BACKEND}``).
BACKEND = "deltastore"


@dataclasses.dataclass(frozen=True)
class InitInfo:
    """``init_weight_transfer_engine``'s info: bind every worker to ``version`` (the version
    its weights are at) of the store at ``url``. Optional: the first update binds too."""

    url: str
    version: int | None = None
    storage_options: dict[str, Any] | None = None
    options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _check_url(self.url)
        if self.version is not None:
            _check_version("version", self.version)
        _check_dict("storage_options", self.storage_options)
        _check_dict("options", self.options)


@dataclasses.dataclass(frozen=True)
class UpdateInfo:
    """``update_weights``' info: go to ``version`` of the store at ``url`` (None: the store
    the workers are bound to). ``from_version``: the version the weights are at when this
    update binds the workers (None: the model folder's recorded version). ``options``: the
    binding's options, used when this update binds."""

    version: int
    url: str | None = None
    storage_options: dict[str, Any] | None = None
    from_version: int | None = None
    options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _check_version("version", self.version)
        if self.url is not None:
            _check_url(self.url)
        if self.from_version is not None:
            _check_version("from_version", self.from_version)
        _check_dict("storage_options", self.storage_options)
        _check_dict("options", self.options)


def _check_url(url: object) -> None:
    if not isinstance(url, str) or not url:
        raise EngineSyncError(f"url={url!r}: expected the store's URL or path (a string)")


def _check_version(field: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise EngineSyncError(f"{field}={v!r}: expected a version number (an integer >= 0)")


def _check_dict(field: str, value: object) -> None:
    if value is not None and not isinstance(value, dict):
        raise EngineSyncError(f"{field}={value!r}: expected a JSON object (dict) or null")


_Info = TypeVar("_Info", InitInfo, UpdateInfo)


def parse_info(cls: type[_Info], info: Mapping[str, Any]) -> _Info:
    """``info`` (a JSON object from vLLM's API) as ``cls``; :class:`EngineSyncError` naming
    the unknown or missing fields and the known ones."""
    if not isinstance(info, Mapping):
        raise EngineSyncError(f"deltastore {cls.__name__}: expected a JSON object, got {info!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
    unknown = sorted(set(info) - set(fields))
    missing = [n for n in required if n not in info]
    if unknown or missing:
        raise EngineSyncError(
            f"deltastore {cls.__name__}: unknown fields {unknown}, missing fields {missing}; "
            f"known: {sorted(fields)} (required: {required})"
        )
    return cls(**info)


def folder_version(model: str | os.PathLike[str]) -> int | None:
    """The version recorded in the model folder's ``.deltastore.json`` (written by
    ``deltastore pull``), or None (no such folder or file: a hub id, a folder of other origin)."""
    from deltastore.checkpoint.state import read_state

    if not os.path.isdir(model):
        return None
    state = read_state(model)
    return None if state is None else state.version


class _WorkerView:
    """What :class:`Receiver` reads of a worker: ``vllm_config`` and ``model_runner.model``."""

    def __init__(self, vllm_config: Any, model: Any) -> None:
        self.vllm_config = vllm_config
        self.model_runner = self
        self.model = model


class _Backend:
    """The behaviour of the ``"deltastore"`` engine; :func:`engine_class` mixes it into
    vLLM's ``WeightTransferEngine`` (which sets ``vllm_config``, ``model_config``, ``device``
    and ``model``). One instance per worker, made by vLLM when it loads the model."""

    init_info_cls = InitInfo
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False
    defers_processing = False

    vllm_config: Any
    model_config: Any
    device: torch.device
    model: torch.nn.Module
    _receiver: Receiver | None = None
    _store: tuple[str, str] | None = None  # (url, storage options as JSON) bound to
    _held: int | None = None  # the version the parameters are at (once bound)
    _group: Group | None = None  # the TP ranks' group, to agree on each step's outcome

    #: the last update's result on this worker (:meth:`Receiver.run`'s dict)
    last: dict[str, Any] | None = None

    def parse_init_info(self, init_dict: Mapping[str, Any]) -> InitInfo:
        return parse_info(InitInfo, init_dict)

    def parse_update_info(self, update_dict: Mapping[str, Any]) -> UpdateInfo:
        return parse_info(UpdateInfo, update_dict)

    def init_transfer_engine(self, init_info: InitInfo) -> None:
        """Bind this worker to ``init_info.version`` of the store (see :class:`InitInfo`);
        raises (on the last rank) when that failed on any rank."""
        info = init_info
        group = self._ranks()
        error = None
        try:
            self._bind(info.url, info.storage_options, info.version, info.options)
        except Exception as exc:  # every rank says how it went before one raises
            error = error_to_dict(exc)
        _raise_agreed(group, error, f"deltastore init at version {info.version} of {info.url}")

    def start_weight_update(self) -> None:
        """Nothing to prepare: changes are written in place (and repacked) by ``update_weights``."""

    def finish_weight_update(self) -> None:
        """Nothing to finish: ``update_weights`` returned with the weights written."""

    def update_weights(self, update_info: Mapping[str, Any]) -> None:
        """Bring this worker's parameters to ``update_info["version"]`` (:class:`UpdateInfo`);
        returns once they are written, raises (on the last rank) when the update failed."""
        import torch

        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu" and torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: UpdateInfo) -> None:
        info = update_info
        group = self._ranks()
        try:
            if info.url is not None:
                rec = self._bind(info.url, info.storage_options, info.from_version, info.options)
            elif self._receiver is not None:
                rec = self._receiver
            else:
                raise EngineSyncError(
                    "deltastore update_info has no url and the workers are not bound to a "
                    "store: name the store in update_info (url, storage_options) or call "
                    "init_weight_transfer_engine first"
                )
        except Exception as exc:  # every rank says how it went before one raises
            self.last = {"ok": False, "version": self._held, "error": error_to_dict(exc)}
        else:
            self.last = rec.run(info.version)
            self._held = rec.sub.version
            if self.last.get("ok") and self._held != info.version:
                self.last = {**self.last, "ok": False, "error": error_to_dict(EngineSyncError(
                    f"the sync ended at version {self._held}, not {info.version}"))}  # fmt: skip
        error = None
        if not self.last.get("ok"):
            error = self.last.get("error") or {"type": "EngineSyncError", "message": "failed"}
        _raise_agreed(group, error, f"deltastore update to version {info.version}")

    def shutdown(self) -> None:
        """Release the lease and the binding (the parameters keep the version they hold)."""
        rec, self._receiver, self._store = self._receiver, None, None
        if rec is not None:
            rec.sub.close()

    # --- internals ----------------------------------------------------------------------

    def _bind(
        self,
        url: str,
        storage_options: dict[str, Any] | None,
        version: int | None,
        options: dict[str, Any] | None,
    ) -> Receiver:
        """The worker's :class:`Receiver` for the store ``url``: the bound one when it is
        that store (and ``version`` is None or the version held), else a new binding at
        ``version`` (None: the version held now, else the model folder's recorded one)."""
        from deltastore.engines.vllm_worker import Receiver

        key = (url, json.dumps(storage_options or {}, sort_keys=True, default=str))
        bound = self._receiver is not None and self._store == key
        if bound and version in (None, self._held) and self._receiver is not None:
            return self._receiver
        if version is None:
            version = self._held if self._held is not None else self._folder_version()
        if version is None:
            raise EngineSyncError(
                f"deltastore cannot tell which version of {url} the engine's weights are at: "
                f"its model {self.model_config.model!r} has no .deltastore.json (written by "
                "`deltastore pull`); pass from_version in update_info or version in init_info"
            )
        worker = _WorkerView(self.vllm_config, self.model)
        rec = agreed(  # a failure after the collectives: the update's _raise_agreed tells all
            self._ranks(),
            lambda before: Receiver(
                worker, url, version, storage_options, dict(options or {}), before
            ),
        )
        self.shutdown()  # the previous binding, if any: its lease
        self._receiver, self._store, self._held = rec, key, rec.sub.version
        log.info("deltastore: bound to %s at version %d", url, version)
        return rec

    def _folder_version(self) -> int | None:
        return folder_version(str(self.model_config.model))

    def _ranks(self) -> Group:
        """The group the TP ranks agree over: vLLM's TP CPU group (a group of one at TP 1)."""
        if self._group is None:
            from deltastore.engines.vllm_worker import tp_group

            self._group = tp_group()[0]
        return self._group


def _raise_agreed(group: Group, error: Mapping[str, Any] | None, what: str) -> None:
    """Every rank calls this with its outcome of a step (``error``: :func:`error_to_dict`'s,
    None: it went well); one all-gather of each rank's error as JSON. If any rank failed, the
    last rank raises the first failed rank's error (its deltastore type, the message prefixed
    with ``what``, the rank and the type) and the other ranks return: vLLM reads the replies
    in rank order and stops at the first error, so an error of an earlier rank would leave
    the later ranks' replies queued, to be read as the answers to the next call."""
    failed = gather_errors(group, error)
    if not failed or group.rank != group.world - 1:
        return
    # the rank that failed, not one that stopped because of it (RankError)
    cause = root_cause([{"rank": r, "error": e} for r, e in failed.items()])
    rank, err = cause["rank"], cause["error"]  # type: ignore[index]
    raise error_from_dict(err, prefix=f"{what} failed on rank {rank} ({err.get('type')}): ")


_ENGINE: type[Any] | None = None
#: The engine class's name, resolved by this module's ``__getattr__`` (:func:`engine_class`).
ENGINE_CLASS = "DeltastoreWeightTransferEngine"


def engine_class() -> type[Any]:
    """The ``"deltastore"`` engine class: :class:`_Backend` mixed into vLLM's
    ``WeightTransferEngine`` (made once per process; imports vLLM)."""
    global _ENGINE
    if _ENGINE is None:
        from vllm.distributed.weight_transfer.base import WeightTransferEngine

        _ENGINE = type(
            ENGINE_CLASS,
            (_Backend, WeightTransferEngine),
            {"__module__": __name__, "__doc__": _Backend.__doc__},
        )
    return _ENGINE


def __getattr__(name: str) -> Any:
    if name == ENGINE_CLASS:
        return engine_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register(factory: Any = None) -> None:
    """Register the backend ``"deltastore"`` in vLLM's weight-transfer registry (``factory``:
    ``WeightTransferEngineFactory`` by default), lazily: vLLM imports this module's engine
    class only when an engine uses the backend. Idempotent: vLLM loads its plugins once per
    process, in every process (API server, engine core, workers)."""
    if factory is None:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        factory = WeightTransferEngineFactory
    if BACKEND in factory._registry:
        return
    factory.register_engine(BACKEND, __name__, ENGINE_CLASS)


__all__ = [
    "BACKEND",
    "ENGINE_CLASS",
    "InitInfo",
    "UpdateInfo",
    "engine_class",
    "folder_version",
    "parse_info",
    "register",
]
