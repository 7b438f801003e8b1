"""TRL's ``AsyncGRPOTrainer`` syncs its policy to ``vllm serve`` through deltastore.

TRL 1.16's ``trl.experimental.async_grpo.AsyncGRPOTrainer(weight_transfer=...)`` takes any
object with ``init_weight_transfer()``, ``pause()``, ``send_weights(iterator)``, ``resume()``
and ``destroy()`` (its ``WeightTransferProtocol``). :class:`DeltastoreWeightTransfer` is one:
``send_weights`` publishes the trainer's parameters as the store's next version
(:class:`~deltastore.Publisher`: only what changed is stored) and has the server apply it
through vLLM's ``"deltastore"`` weight-transfer backend
(:mod:`deltastore.engines.vllm_transfer`)::

    VLLM_SERVER_DEV_MODE=1 vllm serve /ckpt/v0 --weight-transfer-config '{"backend":"deltastore"}'

    trainer = AsyncGRPOTrainer(..., weight_transfer=DeltastoreWeightTransfer(
        "http://rollout:8000", "s3://bucket/run"))

The server's model folder is a version of the store (``deltastore pull STORE /ckpt/v0``: its
``.deltastore.json`` names the version). No TRL import: plain HTTP (``urllib``) to the
server's dev-mode routes.

Call order (TRL's): :meth:`~DeltastoreWeightTransfer.init_weight_transfer` once, then per sync
:meth:`~DeltastoreWeightTransfer.pause`, :meth:`~DeltastoreWeightTransfer.send_weights`,
:meth:`~DeltastoreWeightTransfer.resume`; :meth:`~DeltastoreWeightTransfer.destroy` at the end.
Not thread-safe: one thread drives it (TRL's main process, rank 0).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from deltastore.engines.worker_errors import error_from_dict
from deltastore.errors import (
    DeltastoreError,
    EngineSyncError,
    TableChangedError,
    TensorMismatchError,
)
from deltastore.format.signing import FROM_ENV, KeyOption

if TYPE_CHECKING:
    import torch

    from deltastore.publish.publisher import Publisher, PublishReport

log = logging.getLogger(__name__)

#: Seconds allowed for the calls that scale with the model (publish aside): init (attach:
#: one verification of the engine's weights) and ``/update_weights``.
DEFAULT_TIMEOUT = 1800.0
#: Seconds allowed for the control calls (pause, resume, start/finish, cache reset).
CONTROL_TIMEOUT = 300.0
#: The backend's failure message (``deltastore update to version V failed on rank R (Type)``).
_FAILED = re.compile(r"failed on rank \d+ \((\w+)\): ")


class DeltastoreWeightTransfer:
    """TRL's ``WeightTransferProtocol`` over a deltastore store and one ``vllm serve``.

    ``server_url``: the server's base URL (``http://host:port``), started with
    ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend":"deltastore"}'``
    from a model folder pulled from ``store`` (``deltastore pull``). ``store``: the store's URL
    or path as the *server* reads it (and this process writes it), ``storage_options`` for
    both. ``signing_key``: signs each manifest (default ``DELTASTORE_SIGNING_KEY``; the
    server's readers check it as configured there). ``publisher_options``: more keyword
    options of :class:`~deltastore.Publisher` (``max_workers``, ``anchor_policy``, ...).
    ``optimizer``: the ``torch.optim.AdamW`` stepping the sent parameters: publish
    snapshot-free (``Publisher(snapshot="none", optimizer=...)``: no copy of the weights
    kept; construct this object before the first ``step()``; float32 parameters are sent as
    bfloat16, so the server must serve bfloat16). ``dtype``: the dtype the tensors are
    published in (None: the server's, from ``/server_info``; bfloat16 if it does not say).
    ``server_version``: the version the server's weights are at (None: its model folder's
    ``.deltastore.json``). ``binding_options``: the backend's binding options (``mode``,
    ``lease_ttl``, ``reader_id``, ...; docs/engines.md). ``pause_mode``: ``/pause``'s mode
    (``"keep"``, TRL's: requests in flight are frozen and continue on the new weights;
    ``"abort"``; ``"wait"``). ``timeout`` / ``control_timeout`` / ``ready_timeout``: seconds
    for the heavy calls, the control calls, and the wait for the server at init.
    ``on_publish``: called with each :class:`~deltastore.PublishReport` after the version is
    committed and before the server is told (metrics; a test hook).

    Thread-safety: none; one thread calls the methods, in the protocol's order.
    """

    def __init__(
        self,
        server_url: str,
        store: str,
        *,
        storage_options: dict[str, Any] | None = None,
        signing_key: KeyOption = FROM_ENV,
        publisher_options: Mapping[str, Any] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        dtype: torch.dtype | None = None,
        server_version: int | None = None,
        binding_options: dict[str, Any] | None = None,
        pause_mode: str = "keep",
        timeout: float = DEFAULT_TIMEOUT,
        control_timeout: float = CONTROL_TIMEOUT,
        ready_timeout: float = 600.0,
        on_publish: Callable[[PublishReport], None] | None = None,
    ) -> None:
        if pause_mode not in ("keep", "abort", "wait"):
            raise ValueError(f"pause_mode must be 'keep', 'abort' or 'wait', not {pause_mode!r}")
        if urllib.parse.urlsplit(server_url).scheme not in ("http", "https"):
            raise ValueError(f"server_url must be http(s)://host:port, not {server_url!r}")
        self.server_url = server_url.rstrip("/")
        self.store = store
        self.storage_options = storage_options
        self.signing_key = signing_key
        self.publisher_options = dict(publisher_options or {})
        self.optimizer = optimizer
        self.dtype = dtype
        self.server_version = server_version
        self.binding_options = binding_options
        self.pause_mode = pause_mode
        self.timeout = timeout
        self.control_timeout = control_timeout
        self.ready_timeout = ready_timeout
        self.on_publish = on_publish
        #: The store's version the server serves, as far as this object knows (None: not yet
        #: told by a ``send_weights``: the server's own starting version).
        self.version: int | None = None
        self._publisher: Publisher | None = None
        self._paused = False
        self._anchor_next = False  # after a failed server update: the next version is whole
        self._store_head: int | None = None  # the store's newest version at the first send

    # --- the protocol ------------------------------------------------------------------

    def init_weight_transfer(self) -> None:
        """Wait for the server (``/health``, up to ``ready_timeout`` s), read its dtype, and
        bind its backend to the store (``/init_weight_transfer_engine``: attach at
        ``server_version``, default its model folder's version; one verification of its
        weights). Raises :class:`EngineSyncError` when the server is not ready or refuses
        (e.g. not started with the deltastore backend, or its weights are not that version)."""
        self._wait_ready()
        if self.dtype is None:
            self.dtype = self._server_dtype()
        if self.optimizer is not None:
            import torch

            if self.dtype != torch.bfloat16:
                raise ValueError(
                    f"optimizer= publishes float32 parameters as bfloat16, but the server "
                    f"serves {self.dtype}: start it with --dtype bfloat16 or drop optimizer="
                )
        info: dict[str, Any] = {"url": self.store}
        if self.server_version is not None:
            info["version"] = self.server_version
        if self.storage_options is not None:
            info["storage_options"] = self.storage_options
        if self.binding_options is not None:
            info["options"] = self.binding_options
        status, body = self._post("/init_weight_transfer_engine", {"init_info": info}, self.timeout)
        if status != 200:
            raise _server_error(
                f"deltastore init of the vLLM server at {self.server_url} on {self.store} "
                f"failed (HTTP {status})",
                body,
            )
        log.info("deltastore: %s bound to %s", self.server_url, self.store)

    def pause(self) -> None:
        """``POST /pause?mode=<pause_mode>``: the server stops scheduling (TRL calls it before
        :meth:`send_weights`)."""
        self._control("/pause", query={"mode": self.pause_mode})
        self._paused = True

    def send_weights(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Publish ``iterator``'s ``(name, tensor)`` pairs (every parameter the server loads,
        under its checkpoint name) as the store's next version, then bring the server to it
        (``/start_weight_update``, ``/update_weights {"version": v}``,
        ``/finish_weight_update``, ``/reset_prefix_cache``).

        The tensors are cast to :attr:`dtype` on the CPU (with ``optimizer=``, the optimizer's
        float32 parameters are handed over as they are). The first call attaches to the
        store's newest version: equal weights publish nothing (the server is brought to that
        version); other values of the same tensor table are published whole (an anchor; a
        warning); another table raises :class:`TableChangedError` before anything is written.

        Raises, leaving the server on the version it had: a publish error (the store's; e.g.
        :class:`VersionOrderError`, :class:`VersionExistsError` or :class:`ChainError` when
        another writer committed on this chain), or the server's failure to apply the
        version (HTTP 500 from ``/update_weights``: the deltastore type named in the
        server's message, else :class:`EngineSyncError`; the message names the version).
        After a failed update the next call publishes an anchor, so the server can skip the
        version it could not read.
        """
        tensors = self._gather(iterator)
        _, version = self._publish(tensors)
        self._update_server(version)

    def resume(self) -> None:
        """``POST /resume``: the server schedules again (also after a failed send)."""
        self._control("/resume")
        self._paused = False

    def destroy(self) -> None:
        """Release the server's binding (``/shutdown_weight_transfer_engine``: its lease) and
        the publisher; resume the server if this object paused it and it was not resumed (the
        trainer stopped inside a sync). Best effort: errors are logged, not raised."""
        if self._paused:
            try:
                self.resume()
            except Exception as exc:  # the trainer is stopping: report, do not mask
                log.warning("deltastore: resuming %s at destroy failed: %s", self.server_url, exc)
        try:
            status, body = self._post("/shutdown_weight_transfer_engine", {}, self.control_timeout)
            if status != 200:
                log.warning("deltastore: %s shutdown_weight_transfer_engine: HTTP %d %s",
                            self.server_url, status, _text(body))  # fmt: skip
        except OSError as exc:
            log.warning("deltastore: %s unreachable at destroy: %s", self.server_url, exc)
        self._publisher = None

    # --- publishing ----------------------------------------------------------------------

    def _gather(self, iterator: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The tensors to publish, by name: host copies in :attr:`dtype` (never a view of a
        parameter the optimizer changes later), or the optimizer's own float32 parameters."""
        import torch

        dtype = self.dtype if self.dtype is not None else torch.bfloat16
        own = _param_storage(self.optimizer)
        out: dict[str, torch.Tensor] = {}
        for name, t in iterator:
            t = t.detach()
            if name in out:
                raise TensorMismatchError(f"{name} is sent twice by the iterator")
            if (
                t.dtype == torch.float32
                and t.device.type != "meta"
                and (t.data_ptr(), tuple(t.shape)) in own
            ):
                out[name] = t  # snapshot-free: the publisher reads the parameter itself
                continue
            host = t.to(device="cpu", dtype=dtype)
            if host.data_ptr() == t.data_ptr():
                host = host.clone()
            out[name] = host.contiguous()
        return out

    def _publish(self, tensors: dict[str, torch.Tensor]) -> tuple[Publisher, int]:
        """Commit ``tensors`` as the next version (attaching on the first call); the publisher
        and the version the server should go to."""
        pub = self._publisher
        if pub is None:
            pub, attached = self._attach(tensors)
            self._publisher = pub
            if attached is not None:
                return pub, attached
            anchor: bool | None = True
        else:
            anchor = True if self._anchor_next else None
        head = pub.version if pub.version is not None else self._store_head
        version = 0 if head is None else head + 1
        try:
            report = pub.publish(tensors, version=version, anchor=anchor)
        except DeltastoreError as exc:
            log.error(
                "deltastore: publishing version %d to %s failed: %s", version, self.store, exc
            )
            raise
        self._anchor_next = False
        if self.on_publish is not None:
            self.on_publish(report)
        return pub, version

    def _attach(self, tensors: dict[str, torch.Tensor]) -> tuple[Publisher, int | None]:
        """A publisher on the store's newest version: attached (the version) when
        ``tensors`` are its values, else positioned after it for an anchor (None)."""
        from deltastore.catalog.chain import ChainReader
        from deltastore.publish.publisher import Publisher, table_entry

        options: dict[str, Any] = dict(self.publisher_options)
        if self.optimizer is not None:
            options.update(snapshot="none", optimizer=self.optimizer)
        pub = Publisher(
            self.store,
            storage_options=self.storage_options,
            signing_key=self.signing_key,
            **options,
        )
        reader = ChainReader(pub.store)
        head = reader.newest()
        if head is None:
            raise EngineSyncError(
                f"store {self.store} holds no version: the server's model folder must be one "
                "of its versions (publish it, then `deltastore pull`)"
            )
        self._store_head = head
        manifest = reader.manifest(head)
        dtype = self.dtype
        mine = {
            n: table_entry(n, dtype if t.dtype == _float32() and dtype is not None else t.dtype,
                           t.shape)
            for n, t in tensors.items()
        }  # fmt: skip
        theirs = {n: (e.dtype, list(e.shape)) for n, e in manifest.tensors.items()}
        if mine != theirs:
            added = tuple(sorted(set(mine) - set(theirs)))
            removed = tuple(sorted(set(theirs) - set(mine)))
            both = set(mine) & set(theirs)
            reshaped = tuple(sorted(n for n in both if mine[n][1] != theirs[n][1]))
            retyped = tuple(sorted(n for n in both if mine[n][0] != theirs[n][0]))
            raise TableChangedError(
                f"the trainer's tensors are not the tensor table of version {head} of "
                f"{self.store} (the server's model): added {list(added)[:8]}, removed "
                f"{list(removed)[:8]}, reshaped {list(reshaped)[:8]}, retyped {list(retyped)[:8]}",
                added=added, removed=removed, reshaped=reshaped, retyped=retyped,
            )  # fmt: skip
        try:
            return pub, pub.attach(tensors, version=head)
        except TensorMismatchError as exc:
            log.warning(
                "deltastore: the trainer's weights are not version %d of %s (%s); publishing "
                "them whole as version %d",
                head, self.store, exc, head + 1,
            )  # fmt: skip
        return pub, None

    # --- the server ------------------------------------------------------------------------

    def _update_server(self, version: int) -> None:
        """Bring the server to ``version`` (start, update, finish with the version as vLLM's
        weight version, prefix-cache reset); raise its failure as a typed error."""
        self._control("/start_weight_update")
        t0 = time.perf_counter()
        status, body = self._post(
            "/update_weights", {"update_info": {"version": version}}, self.timeout
        )
        if status != 200:
            # the failed update ended the worker's session (TP > 1: the others' sessions
            # stay open, so finish them); the error on an ended session is expected
            with contextlib.suppress(OSError):
                self._post("/finish_weight_update", {}, self.control_timeout)
            self._anchor_next = True
            was = "its starting version" if self.version is None else f"version {self.version}"
            err = _server_error(
                f"deltastore update of the vLLM server at {self.server_url} to version "
                f"{version} of {self.store} failed (HTTP {status}); the server keeps {was}",
                body,
            )
            log.error("%s", err)
            raise err
        self._control("/finish_weight_update", {"weight_version": str(version)})
        status, body = self._post("/reset_prefix_cache", None, self.control_timeout)
        if status != 200 or not (isinstance(body, dict) and body.get("success")):
            log.info("deltastore: %s prefix cache not reset (%s)", self.server_url, _text(body))
        log.info("deltastore: %s at version %d (update %.2f s)",
                 self.server_url, version, time.perf_counter() - t0)  # fmt: skip
        self.version = version

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        last: object = None
        while time.monotonic() < deadline:
            try:
                status, body = self._request("GET", "/health", None, 5.0)
                if status == 200:
                    return
                last = f"HTTP {status} {_text(body)}"
            except OSError as exc:
                last = exc
            time.sleep(1.0)
        raise EngineSyncError(
            f"the vLLM server at {self.server_url} was not ready after {self.ready_timeout} s "
            f"({last})"
        )

    def _server_dtype(self) -> torch.dtype:
        """The server's model dtype (``/server_info``, a dev-mode route); bfloat16 when it
        does not say."""
        import torch

        try:
            status, body = self._request(
                "GET", "/server_info?config_format=json", None, self.control_timeout
            )
            name = str(body["vllm_config"]["model_config"]["dtype"]) if status == 200 else ""
        except (OSError, KeyError, TypeError) as exc:
            name, status = "", -1
            log.debug("deltastore: /server_info: %s", exc)
        dtype = getattr(torch, name.removeprefix("torch."), None) if name else None
        if not isinstance(dtype, torch.dtype):
            log.warning("deltastore: %s does not say its dtype (/server_info: %s); "
                        "publishing bfloat16", self.server_url, status)  # fmt: skip
            return torch.bfloat16
        return dtype

    def _control(
        self, path: str, body: dict[str, Any] | None = None, query: dict[str, str] | None = None
    ) -> None:
        url = path if not query else f"{path}?{urllib.parse.urlencode(query)}"
        status, got = self._post(url, body if body is not None else {}, self.control_timeout)
        if status != 200:
            raise EngineSyncError(
                f"the vLLM server at {self.server_url}: POST {url} failed (HTTP {status}): "
                f"{_text(got)}"
            )

    def _post(self, path: str, body: dict[str, Any] | None, timeout: float) -> tuple[int, Any]:
        return self._request("POST", path, body, timeout)

    def _request(
        self, method: str, path: str, body: dict[str, Any] | None, timeout: float
    ) -> tuple[int, Any]:
        """(HTTP status, the body as JSON, or as text when it is not JSON). Raises OSError
        (``urllib.error.URLError``) when the server cannot be reached."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(  # noqa: S310 - http(s) only (checked in __init__)
            self.server_url + path, data=data, method=method,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - as above
                status, raw = int(resp.status), resp.read()
        except urllib.error.HTTPError as err:
            status, raw = int(err.code), err.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")


def _param_storage(optimizer: torch.optim.Optimizer | None) -> set[tuple[int, tuple[int, ...]]]:
    """``(data_ptr, shape)`` of every parameter of ``optimizer`` (empty for None)."""
    if optimizer is None:
        return set()
    return {(p.data_ptr(), tuple(p.shape)) for g in optimizer.param_groups for p in g["params"]}


def _float32() -> torch.dtype:
    import torch

    return torch.float32


def _text(body: Any) -> str:
    """A response body for a message (at most 2,000 characters)."""
    text = body if isinstance(body, str) else json.dumps(body, default=str)
    return text[:2000]


def _server_error(what: str, body: Any) -> DeltastoreError:
    """The server's failure as a deltastore error: the type its message names (the backend's
    ``failed on rank R (Type): ...``), else :class:`EngineSyncError`."""
    text = _text(body)
    found = _FAILED.search(text)
    if found is None:
        return EngineSyncError(f"{what}: {text}")
    return error_from_dict({"type": found.group(1), "message": text}, prefix=f"{what}: ")


__all__ = ["CONTROL_TIMEOUT", "DEFAULT_TIMEOUT", "DeltastoreWeightTransfer"]
