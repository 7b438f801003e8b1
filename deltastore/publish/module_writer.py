"""Publishing a torch.distributed module (FSDP2, HSDP, DTensor) from every rank in one call.

:class:`ModuleWriter` reads the module's tensors on each rank, finds this rank's rows of each
(from the DTensor's own placements and device mesh: no offset is computed by the user), and
drives one :class:`~deltastore.publish.sharded.ShardWriter` per rank through the sharded
protocol (:meth:`ModuleWriter.step`: publish, commit on one rank, finish on all). All ranks of
the process group are writers of every version; a rank that owns no rows (an HSDP replica)
writes an empty part. The group shares a *run* id (:mod:`deltastore.publish.runs`): after a
restart, :meth:`ModuleWriter.resume` makes the new run the store's current one, so the crashed
run's leftovers can never be committed.

Which rank writes what, per tensor (the model's parameters, a tied one once under its first
name, then its persistent buffers, by state_dict name). When several copies of a tensor exist
in the group (the meshes of data-parallel replicas around tensor parallelism, a plain tensor
on every rank), the copy whose lowest global rank is lowest is written, the others skip it
(agreed once, by one collective); within that copy:

- a DTensor whose placements are ``Shard(0)`` or ``Replicate`` on every mesh dim (FSDP2's
  ``Shard(0)``; HSDP's ``(Replicate(), Shard(0))``; nested dim-0 shards): its local rows, at
  their global offset, written by the ranks whose mesh coordinate is 0 on every ``Replicate``
  dim (the other replicas skip it);
- any other DTensor with dims (a dim-1 or strided shard, a partial): redistributed to
  ``Shard(0)`` on each mesh dim that does not replicate it (a collective on its mesh: a
  shard's worth of memory per rank), then as above;
- a 0-dim DTensor: its value, from the rank at coordinate 0 on every mesh dim;
- a plain tensor: whole.

Every method is collective (every rank of the group calls it, in the same order) except
:meth:`commit`, which does something on the committer rank only. Not thread-safe.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from deltastore.errors import ChainError, TensorMismatchError
from deltastore.format.manifest import Manifest
from deltastore.progress import ProgressFn
from deltastore.publish.commit import head_version
from deltastore.publish.parts import commit_parts
from deltastore.publish.publisher import PublishReport
from deltastore.publish.runs import abandon_parts, new_run_id, register_run, write_abort
from deltastore.publish.sharded import RowSlice, ShardWriter
from deltastore.store import Store

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed import ProcessGroup

log = logging.getLogger("deltastore.publish.sharded")

T = TypeVar("T")


@dataclass(frozen=True)
class ResumeReport:
    """What :meth:`ModuleWriter.resume` found and decided."""

    #: The store's newest committed version (None: an empty store).
    head: int | None
    #: What the next step publishes: a delta on ``head`` when every rank's slices match it,
    #: else an anchor.
    kind: Literal["anchor", "delta"]
    #: Versions above ``head`` whose uncommitted parts (of earlier runs) were abandoned.
    abandoned: tuple[int, ...]
    #: Why the next step is an anchor (None: a delta).
    reason: str | None


class ModuleWriter:
    """This rank's writer of a torch.distributed module (see the module docstring).

    ``url``: the store; ``model``: the module (its parameters are read at every publish, so
    FSDP2's resharding between steps is fine); ``group``: the process group of the writers
    (default: the default group; ``torch.distributed`` must be initialized); ``dtype``: cast
    floating tensors to it before they are published (e.g. ``torch.bfloat16`` for fp32 master
    weights; with ``snapshot="none"`` the optimizer's float32 parameters are published as
    bfloat16 in any case, so only None or ``torch.bfloat16`` is accepted there);
    ``committer``: the group rank that commits each version; ``timeout_s`` and ``poll_s``: how
    long :meth:`commit` waits for the parts and :meth:`finish` for the commit (seconds), and
    how often they look; ``run``: the run id (default: a new one, made by the committer and
    broadcast). Other keyword options go to :class:`~deltastore.publish.sharded.ShardWriter`
    (``snapshot``, ``optimizer``, ``anchor_policy``, ``max_frame_bytes``, ``storage_options``,
    ...). Collective: every rank constructs it; the committer registers the run as the
    store's current one (older runs can no longer commit).
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | Store,
        model: nn.Module,
        *,
        group: ProcessGroup | None = None,
        dtype: torch.dtype | None = None,
        committer: int = 0,
        timeout_s: float = 300.0,
        poll_s: float = 0.05,
        run: str | None = None,
        **options: Any,
    ) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ModuleWriter needs torch.distributed: call init_process_group() first"
            )
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if not 0 <= committer < self.world:
            raise ValueError(f"committer must be a rank of the group, got {committer!r}")
        snapfree = options.get("snapshot") == "none"
        if dtype is not None and (
            not dtype.is_floating_point or (snapfree and dtype != torch.bfloat16)
        ):
            raise ValueError(
                f"dtype must be a floating dtype (torch.bfloat16 with snapshot='none'), got {dtype}"
            )
        self.model, self.dtype, self.committer = model, dtype, committer
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.run: str = self._broadcast(run or (new_run_id() if self.rank == committer else None))
        self.writer: ShardWriter = self._agree("start", partial(self._start, url, options))
        self.store = self.writer.store
        #: Why the next publish is an anchor, as :meth:`resume` decided (None: as usual).
        self._anchor_next: str | None = None
        self._tried: int | None = None  # the newest version this writer published or tried
        self._chosen: dict[str, bool] | None = None  # per tensor: this copy is written

    @property
    def version(self) -> int | None:
        """The version this rank holds (None before its first finished step or resume)."""
        return self.writer.version

    def _start(self, url: str | os.PathLike[str] | Store, options: dict[str, Any]) -> ShardWriter:
        writer = ShardWriter(url, self.rank, self.world, run=self.run, **options)
        if self.rank == self.committer:  # older runs can no longer commit
            register_run(writer.store, self.run, self.world)
        return writer

    # --- collectives ----------------------------------------------------------------------

    def _agree(self, what: str, work: Callable[[], T]) -> T:
        """``work()`` on this rank, then one collective: when it raised on any rank, every
        rank raises (this rank its own error, the others a :class:`ChainError` naming the
        rank), so that none is left waiting in a later collective."""
        failed: str | None = None
        try:
            result = work()
        except Exception as exc:
            self._gather(f"rank {self.rank}: {type(exc).__name__}: {exc}")
            raise
        others = [f for f in self._gather(failed) if f is not None]
        if others:
            raise ChainError(f"ModuleWriter {what} failed on another rank: {others[0]}")
        return result

    def _broadcast(self, value: Any) -> Any:
        """``value`` of the committer rank, on every rank."""
        import torch.distributed as dist

        box = [value]
        src = (
            self.committer
            if self.group is None
            else dist.get_global_rank(self.group, self.committer)
        )
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def _gather(self, value: Any) -> list[Any]:
        """``value`` of every rank, in rank order."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value, group=self.group)
        return out

    # --- tensors --------------------------------------------------------------------------

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's parameters (a tied one once), then its persistent buffers."""
        yield from self.model.named_parameters()
        for name, buf in self.model.named_buffers():
            owner, _, leaf = name.rpartition(".")
            module = self.model.get_submodule(owner) if owner else self.model
            if leaf not in getattr(module, "_non_persistent_buffers_set", ()):
                yield name, buf

    def slices(self) -> dict[str, RowSlice]:
        """This rank's slices of the module now, by tensor name (collective: the first call
        agrees on who writes what; later calls only when a DTensor is not sharded by rows).
        Raises :class:`TensorMismatchError` for a DTensor whose mesh does not include this
        rank."""
        from torch.distributed.tensor import DTensor

        chosen = self._plan()
        sf = self.writer._snapfree
        optimized = sf.param_ids() if sf is not None else set()
        out: dict[str, RowSlice] = {}
        for name, t in self._tensors():
            if not chosen.get(name, False):
                continue  # another mesh's replica (or another rank) writes it
            s = self._dtensor_slice(name, t) if isinstance(t, DTensor) else self._plain_slice(t)
            if s is not None:
                out[name] = self._cast(s, optimized=id(t) in optimized)
        return out

    def _plan(self) -> dict[str, bool]:
        """Per tensor this rank holds: whether its copy is the one written. Each rank sends
        the global ranks of each DTensor's mesh (itself for a plain tensor); of the copies of
        a tensor (meshes of data-parallel replicas, ranks of a pipeline stage that hold a plain
        tensor), the one whose lowest rank is lowest is written; within that mesh the rows go
        by placements. Collective, once (a module's layout is fixed)."""
        if self._chosen is not None:
            return self._chosen
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        mine: dict[str, tuple[int, ...]] = {}
        for name, t in self._tensors():
            if isinstance(t, DTensor):
                mine[name] = tuple(sorted(int(r) for r in t.device_mesh.mesh.flatten().tolist()))
            else:
                mine[name] = (dist.get_rank(),)
        tables: list[dict[str, tuple[int, ...]]] = self._gather(mine)
        self._chosen = {
            name: key == min((tab[name] for tab in tables if name in tab), key=_lowest)
            for name, key in mine.items()
        }
        return self._chosen

    def _plain_slice(self, t: torch.Tensor) -> RowSlice:
        return RowSlice(t.detach(), tuple(t.shape), 0, t)

    def _dtensor_slice(self, name: str, t: Any) -> RowSlice | None:
        """This rank's rows of the DTensor ``t`` (None: another rank writes them); its
        ``param`` is ``t`` when the rows are ``t``'s own local shard."""
        from torch.distributed.tensor import Replicate, Shard

        placements = tuple(t.placements)
        coordinate = t.device_mesh.get_coordinate()
        if coordinate is None:
            raise TensorMismatchError(
                f"{name}: this rank is not in the device mesh of the DTensor; a ModuleWriter's "
                "group must be the ranks of the module's mesh"
            )
        shape, param = tuple(t.shape), t
        if not shape:  # 0-dim: one writer, the whole of it
            full = t.full_tensor().detach()  # collective on the mesh: every rank
            return RowSlice(full, shape, 0, None) if not any(coordinate) else None
        if not all(_rows(p) or isinstance(p, Replicate) for p in placements):
            # a dim-1 or strided shard, a partial: this rank's rows of a dim-0 layout instead
            # (a collective on the mesh; a shard's worth of memory, never the whole tensor)
            placements = tuple(p if isinstance(p, Replicate) else Shard(0) for p in placements)
            t, param = t.detach().redistribute(t.device_mesh, placements), None
        writer = all(
            c == 0 for c, p in zip(coordinate, placements, strict=True) if isinstance(p, Replicate)
        )
        if not writer:
            return None
        local = t.to_local().detach()
        chunk = t.__create_chunk_list__()[0]
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if tuple(local.shape) != sizes or any(offsets[1:]):
            raise TensorMismatchError(
                f"{name}: the local chunk {sizes} at {offsets} of a {shape} DTensor is not a row "
                f"range (placements {placements})"
            )
        return RowSlice(local, shape, offsets[0], param)

    def _cast(self, s: RowSlice, *, optimized: bool) -> RowSlice:
        """``s`` as published. With ``snapshot="none"``, a slice of a float32 parameter the
        optimizer steps is published as bfloat16: the writer casts its own shard, a slice
        that is not that shard (redistributed) is cast here; any other slice keeps
        ``param`` only when it is an optimizer parameter (the writer takes the others for
        snapshots of their own). Then :attr:`dtype`, for floating slices of other tensors:
        cast by the writer a frame at a time (:attr:`RowSlice.dtype`), never a whole copy."""
        t, param = s.tensor, s.param
        snapfree = self.writer._snapfree is not None
        if snapfree:
            if not optimized:
                param = None
            elif param is None and t.dtype == torch.float32:
                return RowSlice(t.to(torch.bfloat16), s.global_shape, s.row_start, None)
            elif param is not None:
                return RowSlice(t, s.global_shape, s.row_start, param)
        dtype = self.dtype
        if dtype is None or not t.is_floating_point() or t.dtype == dtype:
            return RowSlice(t, s.global_shape, s.row_start, param)
        if snapfree:  # held as a snapshot of its own: the cast is that snapshot
            return RowSlice(t.to(dtype), s.global_shape, s.row_start, None)
        return RowSlice(t, s.global_shape, s.row_start, None, dtype)  # cast frame by frame

    # --- versions -------------------------------------------------------------------------

    def resume(self) -> ResumeReport:
        """Continue the store's chain after a (re)start; collective, before the first step.

        On the committer: the store's newest committed version, and an abort marker for every
        uncommitted version above it that holds parts of another run (a late ``commit_parts``
        of those is refused). Then every rank attaches its slices to that version (checked
        against the Adler-32 of the frames that stored them). The next :meth:`step` is a delta
        when every rank matched, else an anchor from every rank. Parts left behind are removed
        by ``gc --orphans`` (see :func:`deltastore.maintenance.gc`)."""
        head, abandoned = self._broadcast(self._agree("resume", self._abandon))
        why: str | None = "the store holds no version" if head is None else None
        if head is not None:
            try:
                self.writer.attach(self.slices(), version=head)
            except (TensorMismatchError, ChainError) as exc:
                why = f"rank {self.rank}: {exc}"
        whys = [w for w in self._gather(why) if w is not None]
        reason = whys[0] if whys else None
        self._anchor_next = reason if head is not None else None
        kind: Literal["anchor", "delta"] = "anchor" if reason is not None else "delta"
        if reason is not None and head is not None:
            log.warning("resume at version %d: the next version is an anchor (%s)", head, reason)
        return ResumeReport(head, kind, tuple(sorted(set(abandoned))), reason)

    def _abandon(self) -> tuple[int | None, list[int]] | None:
        """On the committer: the store's head, and the versions above it given up (see
        :meth:`resume`); None on the other ranks."""
        if self.rank != self.committer:
            return None
        head = head_version(self.store)
        given_up = abandon_parts(
            self.store,
            above=head,
            keep_run=self.run,
            reason=f"uncommitted parts of a crashed or stopped run, abandoned by resume() of run "
            f"{self.run}",
        )
        return head, [v for v, _ in given_up]

    def next_version(self) -> int:
        """One above the version held and the last one this writer tried (a version given
        up is never committed later), or above the store's newest version before the first
        step (every rank reads the same between steps)."""
        held = self.writer.version
        if held is None:
            held = head_version(self.store)
        return max(held or 0, self._tried or 0) + 1

    def publish(
        self,
        version: int | None = None,
        *,
        anchor: bool | None = None,
        progress: ProgressFn | None = None,
    ) -> PublishReport:
        """Upload this rank's part of ``version`` (default :meth:`next_version`); nothing is
        committed. ``anchor`` as :meth:`ShardWriter.publish` (after a :meth:`resume` that
        decided an anchor, the default is one). When it fails, this rank gives the version up
        (an abort marker), so that :meth:`commit` and the other ranks' :meth:`finish` stop
        at once instead of at their timeout."""
        version = self.next_version() if version is None else version
        resumed = anchor is None and self._anchor_next is not None
        try:
            report = self.writer.publish(
                self.slices(),
                version=version,
                anchor=True if resumed else anchor,
                progress=progress,
            )
        except Exception as exc:
            write_abort(
                self.store, version, self.run, f"rank {self.rank}: {type(exc).__name__}: {exc}"
            )
            raise
        finally:
            self._tried = max(self._tried or 0, version)
        if resumed:
            report = replace(report, anchor_reason=f"resume: {self._anchor_next}")
        self._anchor_next = None
        return report

    def commit(self, version: int) -> Manifest | None:
        """On the committer rank: :func:`commit_parts` of this run's ``version`` (its
        manifest); None on the other ranks."""
        if self.rank != self.committer:
            return None
        signing = self.writer._signing
        return commit_parts(
            self.store,
            version=version,
            world=self.world,
            run=self.run,
            timeout_s=self.timeout_s,
            poll_s=self.poll_s,
            signing_key=signing[0] if signing else None,
            unsafe_commits=self.writer.unsafe_commits,
        )

    def finish(self, version: int) -> Manifest:
        """Wait until ``version`` is committed, then hold it (:meth:`ShardWriter.finish`)."""
        return self.writer.finish(version, timeout_s=self.timeout_s, poll_s=self.poll_s)

    def step(
        self,
        version: int | None = None,
        *,
        anchor: bool | None = None,
        progress: ProgressFn | None = None,
    ) -> PublishReport:
        """Publish, commit and finish ``version`` (default :meth:`next_version`) on every rank;
        returns this rank's :class:`PublishReport` (its slices). Errors as the three calls'."""
        report = self.publish(version, anchor=anchor, progress=progress)
        self.commit(report.version)
        self.finish(report.version)
        return report


def _lowest(ranks: tuple[int, ...]) -> tuple[int, int]:
    """Order of the copies of a tensor: by lowest global rank (then size)."""
    return (min(ranks), len(ranks))


def _rows(placement: object) -> bool:
    """Whether ``placement`` shards dim 0 into contiguous row ranges (``Shard(0)``; not a
    strided shard, a subclass)."""
    from torch.distributed.tensor import Shard

    return type(placement) is Shard and placement.dim == 0


__all__ = ["ModuleWriter", "ResumeReport"]
