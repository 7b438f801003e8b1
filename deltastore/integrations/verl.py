"""deltastore as a verl checkpoint engine: ``rollout.checkpoint_engine.backend=deltastore``.

verl (0.9.x) moves weights from the trainer's actor workers to the rollout workers through a
*checkpoint engine* chosen by name from ``verl.checkpoint_engine.CheckpointEngineRegistry``.
This module registers the backend ``"deltastore"`` there (:func:`register`; also done when
this module is imported with verl installed, which is what verl's
``checkpoint_engine.custom_backend_module`` does on every worker)::

    actor_rollout_ref.rollout.checkpoint_engine.backend=deltastore
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=deltastore.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltastore.url=s3://bucket/run

The store is the channel: no process group joins trainer and rollout. Each weight update
(``CheckpointEngineManager.update_weights(global_steps)``):

- trainer side (every actor rank calls ``send_weights`` with the HF-named full tensors;
  producing them is collective, so every rank walks the generator): actor rank 0
  (``is_master``) publishes them as version ``global_steps`` with a
  :class:`~deltastore.Publisher` (held across calls: a delta on the previous version; the
  first publish of a process attaches to the store's head when that head is the version being
  sent and holds these very tensors, else publishes an anchor);
- rollout side (every rollout worker): a :class:`~deltastore.Subscriber` held across calls
  waits until version ``global_steps`` is committed, checks that it is a delta on exactly the
  version it holds (else :class:`~deltastore.errors.ChainError` for a skipped or deleted
  version, :class:`~deltastore.errors.WrongParentError` for another state of that version),
  syncs, and yields ``(name, tensor)`` for the tensors that changed in that version (all of
  them on the first receive, or for an anchor). A failure raises before anything is yielded.

The verl-free halves, :class:`TrainerSide` and :class:`RolloutSide`, do the work;
:class:`DeltastoreEngine` maps verl's ``CheckpointEngine`` methods onto them, and the
registered class is it mixed into verl's ``CheckpointEngine`` (made by :func:`register`).
This module imports verl only in :func:`register`; importing it without verl works.
Thread-safety: one call at a time per engine (verl's order: ``prepare``,
``init_process_group``, ``send_weights`` / ``receive_weights``, ``finalize``).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from deltastore.errors import (
    ChainError,
    ManifestNotFoundError,
    TensorMismatchError,
    WrongParentError,
)

if TYPE_CHECKING:
    import torch

    from deltastore.format.manifest import Manifest
    from deltastore.publish.publisher import Publisher, PublishReport
    from deltastore.sync.subscriber import Subscriber

log = logging.getLogger(__name__)

#: The backend's name in verl's ``CheckpointEngineRegistry``.
BACKEND = "deltastore"
#: Seconds a rollout worker waits for the version it is told to receive (``timeout_s``).
DEFAULT_TIMEOUT_S = 600.0
#: Seconds between two polls of the store while waiting (``poll_s``).
DEFAULT_POLL_S = 0.2


def _plain(value: Any) -> Any:
    """``value`` with every mapping made a ``dict`` (verl hands OmegaConf ``DictConfig`` s)."""
    if isinstance(value, Mapping) or hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


class TrainerSide:
    """Publishes the trainer's weights, one version per :meth:`send` (verl-free).

    ``url`` / ``storage_options``: the store; ``is_master``: only this rank publishes (the
    others walk the weights and return); ``options``: keyword options of
    :class:`~deltastore.Publisher` (``anchor_policy``, ``max_workers``, ``zstd_level``,
    ``signing_key``, ...). Not thread-safe: one :meth:`send` at a time.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        is_master: bool = True,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.url = url
        self.is_master = is_master
        self._storage_options = dict(storage_options) if storage_options else None
        self._options = dict(options or {})
        self._optimizer: torch.optim.Optimizer | None = None
        self._publisher: Publisher | None = None

    @property
    def version(self) -> int | None:
        """The version last published or attached to (None before the first :meth:`send`)."""
        return None if self._publisher is None else self._publisher.version

    def use_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Publish snapshot-free (``snapshot="none"``): the previous words are rebuilt from
        ``optimizer`` (the ``torch.optim.AdamW`` that steps the parameters the weights
        generator yields, *as those very tensors*) instead of a host copy of the model; float32
        parameters are then published as bfloat16. Call before the first :meth:`send` and
        before the first ``optimizer.step()`` whose result is published."""
        if self._publisher is not None:
            raise ValueError("use_optimizer() must come before the first send()")
        self._optimizer = optimizer

    def send(
        self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> dict[str, float]:
        """Publish ``weights`` (``(name, tensor)``, each name once) as ``version`` (default:
        the next after the last one; on a fresh store 0) and return verl metrics (bytes,
        seconds). Each tensor is copied to host memory as it comes (with a snapshot: the
        generator may free it), so rank 0 holds one host copy of the model during the call
        beside the publisher's snapshot. Raises :class:`~deltastore.errors.VersionOrderError`
        for a version not above the store's newest and the publisher's other errors; a failed
        send leaves the store and this side at the previous version."""
        if not self.is_master:
            for _ in weights:  # producing a weight is collective over the actor ranks
                pass
            return {}
        return self.publish(self.gather(weights), version)

    def keep(self, name: str, tensor: torch.Tensor, into: dict[str, torch.Tensor]) -> None:
        """Add ``tensor`` to ``into`` as this side publishes it: a host copy (with a snapshot:
        the generator may free or reuse it), or the tensor itself (snapshot-free: it must be
        the optimizer's parameter). :class:`~deltastore.errors.TensorMismatchError` for a name
        given twice."""
        if name in into:
            raise TensorMismatchError(f"the weights name {name!r} twice")
        snapfree = self._optimizer is not None
        into[name] = tensor.detach() if snapfree else tensor.detach().to("cpu", copy=True)

    def gather(self, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``weights`` kept by :meth:`keep`, by name."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            self.keep(name, tensor, out)
        return out

    def publish(self, tensors: Mapping[str, torch.Tensor], version: int | None) -> dict[str, float]:
        """:meth:`send` of tensors already gathered (rank 0 only)."""
        from deltastore.catalog.chain import ChainReader

        pub = self._open()
        if pub.version is None:  # the first publish of this process
            head = ChainReader(pub.store).newest()
            target = version if version is not None else 0 if head is None else head + 1
            if head is not None and head == target:
                t0 = time.perf_counter()
                pub.attach(tensors, version=head)  # TensorMismatchError: not these tensors
                log.info("attached to version %d of %s", head, self.url)
                return {
                    "deltastore/version": float(head),
                    "deltastore/publish_s": time.perf_counter() - t0,
                }
            if head is not None:
                log.warning(
                    "store %s is at version %d: version %d is published as an anchor (a delta "
                    "needs this process to hold the tensors of version %d)",
                    self.url,
                    head,
                    target,
                    head,
                )
        else:
            target = version if version is not None else pub.version + 1
        return _metrics(pub.publish(tensors, version=target))

    def _open(self) -> Publisher:
        if self._publisher is None:
            from deltastore.publish.publisher import Publisher

            options = dict(self._options)
            if self._optimizer is not None:
                options.update(snapshot="none", optimizer=self._optimizer)
            self._publisher = Publisher(self.url, storage_options=self._storage_options, **options)
        return self._publisher


def _metrics(report: PublishReport) -> dict[str, float]:
    """verl metrics of one publish (bytes, seconds; ``anchor``: 1.0 for an anchor)."""
    return {
        "deltastore/version": float(report.version),
        "deltastore/anchor": float(report.kind == "anchor"),
        "deltastore/changed_fraction": report.changed_fraction,
        "deltastore/payload_bytes": float(report.payload_bytes),
        "deltastore/dense_bytes": float(report.dense_bytes),
        "deltastore/publish_s": report.total_s,
    }


class RolloutSide:
    """Receives one version per :meth:`receive` into tensors it holds (verl-free).

    ``url`` / ``storage_options``: the store; ``options``: keyword options of
    :class:`~deltastore.Subscriber` (``device``, ``max_workers``, ``threads``, ``reader_id``,
    ``lease_ttl``, ``trusted_keys``, ...); ``timeout_s``: how long :meth:`receive` waits for
    its version to be committed, polling every ``poll_s`` seconds. The subscriber allocates
    and holds one copy of the model (on ``device``, default CPU); the tensors :meth:`receive`
    returns are those live tensors: read (copy) them before the next call, which writes them
    in place. Not thread-safe: one :meth:`receive` at a time.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        poll_s: float = DEFAULT_POLL_S,
    ) -> None:
        if timeout_s < 0 or poll_s <= 0:
            raise ValueError("timeout_s must be >= 0 and poll_s > 0")
        self.url = url
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._storage_options = dict(storage_options) if storage_options else None
        self._options = dict(options or {})
        self._subscriber: Subscriber[Any] | None = None
        self._held: Manifest | None = None  # the manifest of the version the tensors are at

    @property
    def version(self) -> int | None:
        """The version the held tensors are at (None before the first :meth:`receive`)."""
        return None if self._held is None else self._held.version

    def receive(self, version: int | None = None) -> list[tuple[str, torch.Tensor]]:
        """Go to ``version`` (default: the next after the held one; on the first call the
        newest) and return ``(name, tensor)`` of the tensors that changed in it, in the
        manifest's order: every tensor on the first call or for an anchor, none when the held
        version is ``version`` already.

        Waits up to ``timeout_s`` for ``version`` to be committed
        (:class:`~deltastore.errors.ManifestNotFoundError` after). Before anything is fetched:
        :class:`~deltastore.errors.ChainError` when ``version`` is not a delta on the held
        version (a version was skipped or deleted, or is older than the held one);
        :class:`~deltastore.errors.WrongParentError` when it is a delta on another state of
        the held version (another run wrote the store). While syncing: the subscriber's
        errors, e.g. :class:`~deltastore.errors.IntegrityError` or
        :class:`~deltastore.errors.FrameError` for damaged data (verified before anything is
        written). Any failure leaves the tensors at the held version, and returns nothing.
        """
        sub = self._open()
        held = self._held
        target = version if version is not None or held is None else held.version + 1
        newest = self._wait(sub, target)
        if held is None:  # first receive: the newest anchor at or below it, then deltas
            target = newest if target is None else target
            sub.sync(target)
            self._held = sub.manifest(target)
            return self._named(list(self._held.tensors))
        if target is None:  # pragma: no cover - set above when held
            raise ChainError("no version to receive")
        if target == held.version:
            return []
        if target < held.version:
            raise ChainError(
                f"version {target} is older than version {held.version}, which this rollout "
                f"holds (store {self.url})"
            )
        m = self._manifest(sub, target, held.version, newest)
        if m.kind == "delta":
            parent = m.parent
            if parent is None or parent.version != held.version:
                raise ChainError(
                    f"version {target} of {self.url} is a delta on version "
                    f"{None if parent is None else parent.version}, but this rollout holds "
                    f"version {held.version}: versions between were skipped or deleted; "
                    "nothing was received"
                )
            if parent.state_digest != held.state_digest:
                raise WrongParentError(
                    f"version {target} of {self.url} is a delta on another state of version "
                    f"{held.version} than this rollout holds (state {held.state_digest[:12]}, "
                    f"its parent {parent.state_digest[:12]}): the store was written by another "
                    "run; nothing was received"
                )
            changed = [n for n, e in m.tensors.items() if e.changed > 0]
        else:
            changed = list(m.tensors)
        sub.sync(target)
        self._held = m
        return self._named(changed)

    def close(self) -> None:
        """Drop the subscriber's lease (best effort); the held tensors are kept."""
        if self._subscriber is not None:
            self._subscriber.close()

    def _named(self, names: list[str]) -> list[tuple[str, torch.Tensor]]:
        sub = self._subscriber
        if sub is None or sub.tensors is None:  # pragma: no cover - after a sync
            raise ChainError("no tensors held")
        tensors = sub.tensors
        return [(n, tensors[n]) for n in names]

    def _manifest(self, sub: Subscriber[Any], target: int, held: int, newest: int) -> Manifest:
        """The manifest of ``target``; :class:`ChainError` when it is missing while ``newest``
        (above it) is committed: it was skipped or deleted."""
        try:
            return sub.manifest(target)
        except ManifestNotFoundError:
            raise ChainError(
                f"version {target} is not in {self.url}, whose newest version is {newest}: "
                f"it was skipped or deleted; this rollout holds version {held}; nothing was "
                "received"
            ) from None

    def _wait(self, sub: Subscriber[Any], target: int | None) -> int:
        """The store's newest version once it is ``target`` or above (any, for None)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            newest = sub.latest()
            if newest is not None and (target is None or newest >= target):
                return newest
            if time.monotonic() >= deadline:
                raise ManifestNotFoundError(
                    f"version {'any' if target is None else target} was not committed to "
                    f"{self.url} within {self.timeout_s:g} s (newest: {newest})"
                )
            time.sleep(self.poll_s)

    def _open(self) -> Subscriber[Any]:
        if self._subscriber is None:
            from deltastore.sync.subscriber import Subscriber

            self._subscriber = Subscriber(
                self.url, storage_options=self._storage_options, **self._options
            )
        return self._subscriber


class DeltastoreEngine:
    """verl's ``CheckpointEngine`` methods over :class:`TrainerSide` / :class:`RolloutSide`.

    Built by verl as ``cls(bucket_size=..., [is_master=...,] **engine_kwargs)`` where
    ``engine_kwargs`` is ``rollout.checkpoint_engine.engine_kwargs.deltastore``: ``url``
    (required: the store, e.g. ``s3://bucket/run``), ``storage_options``, ``publisher``
    (:class:`~deltastore.Publisher` options), ``subscriber`` (:class:`~deltastore.Subscriber`
    options, e.g. ``device``), ``timeout_s`` and ``poll_s`` (rollout wait). ``bucket_size``
    is accepted and unused (frames are sized by the publisher). An actor worker uses the
    trainer half, a rollout worker the rollout half, each made on first use.
    """

    #: verl's ``wire_format``: full tensors by name, bucketed by the server adapter.
    wire_format = "named_tensors"

    def __init__(
        self,
        bucket_size: int = 0,
        is_master: bool = False,
        *,
        url: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        publisher: Mapping[str, Any] | None = None,
        subscriber: Mapping[str, Any] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        poll_s: float = DEFAULT_POLL_S,
    ) -> None:
        if not url:
            raise ValueError(
                "the deltastore checkpoint engine needs the store: set "
                "rollout.checkpoint_engine.engine_kwargs.deltastore.url"
            )
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.url = str(url)
        self._storage_options = _plain(storage_options) if storage_options else None
        self._publisher_options = _plain(publisher or {})
        self._subscriber_options = _plain(subscriber or {})
        self._timeout_s = float(timeout_s)
        self._poll_s = float(poll_s)
        self._trainer: TrainerSide | None = None
        self._rollout: RolloutSide | None = None

    @property
    def trainer(self) -> TrainerSide:
        """The trainer half (made on first use)."""
        if self._trainer is None:
            self._trainer = TrainerSide(
                self.url,
                storage_options=self._storage_options,
                is_master=self.is_master,
                options=self._publisher_options,
            )
        return self._trainer

    @property
    def rollout(self) -> RolloutSide:
        """The rollout half (made on first use)."""
        if self._rollout is None:
            self._rollout = RolloutSide(
                self.url,
                storage_options=self._storage_options,
                options=self._subscriber_options,
                timeout_s=self._timeout_s,
                poll_s=self._poll_s,
            )
        return self._rollout

    # --- verl's CheckpointEngine ---------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Before each update: nothing to allocate; the metadata names the store."""
        return {"url": self.url, "is_master": self.is_master}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """No process group: no arguments for ``init_process_group`` on either side."""
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        """Nothing to join: the store is the channel."""

    def finalize(self) -> None:
        """After each update: nothing to free (the publisher and subscriber are kept)."""

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Publish ``weights`` (a generator, sync or async, of ``(name, tensor)``) as version
        ``global_steps`` (:meth:`TrainerSide.send`). The generator is walked on the calling
        (event-loop) thread, as producing a weight may be a collective; the publish runs in a
        worker thread. Returns the publish's metrics (empty on ranks other than rank 0)."""
        trainer = self.trainer
        if not hasattr(weights, "__aiter__"):
            if not trainer.is_master:
                return trainer.send(weights, global_steps)
            gathered = trainer.gather(weights)
        else:
            gathered = {}
            async for name, tensor in weights:
                if trainer.is_master:
                    trainer.keep(name, tensor, gathered)
            if not trainer.is_master:
                return {}
        return await asyncio.to_thread(trainer.publish, gathered, global_steps)

    async def receive_weights(
        self, global_steps: int | None = None
    ) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield the tensors that changed in version ``global_steps``
        (:meth:`RolloutSide.receive`; the sync runs in a worker thread before the first
        yield, so a failure raises with nothing yielded). The tensors are the rollout half's
        live tensors: the consumer copies them before the next call."""
        received = await asyncio.to_thread(self.rollout.receive, global_steps)
        for name, tensor in received:
            yield name, tensor

    def use_optimizer(self, optimizer: Any) -> None:
        """Trainer side: publish snapshot-free (:meth:`TrainerSide.use_optimizer`)."""
        self.trainer.use_optimizer(optimizer)

    def close(self) -> None:
        """Drop the rollout half's lease (best effort)."""
        if self._rollout is not None:
            self._rollout.close()


_ENGINE: type[Any] | None = None


def register() -> type[Any]:
    """Register the backend ``"deltastore"`` in verl's ``CheckpointEngineRegistry`` and
    return its class (:class:`DeltastoreEngine` mixed into verl's ``CheckpointEngine``,
    made once per process). Idempotent. Raises ``ImportError`` without verl."""
    global _ENGINE
    base = importlib.import_module("verl.checkpoint_engine.base")
    if _ENGINE is None:
        _ENGINE = type(
            "DeltastoreCheckpointEngine",
            (DeltastoreEngine, base.CheckpointEngine),
            {"__module__": __name__, "__doc__": DeltastoreEngine.__doc__},
        )
    base.CheckpointEngineRegistry.register(BACKEND)(_ENGINE)
    return _ENGINE


if importlib.util.find_spec("verl") is not None:  # verl imports this module to register
    try:
        register()
    except ImportError as exc:  # verl present but broken: say so, stay importable
        log.warning("verl is installed but its checkpoint engines do not import: %s", exc)


__all__ = ["BACKEND", "DeltastoreEngine", "RolloutSide", "TrainerSide", "register"]
