"""Several writers, one version: publishing from sharded (FSDP-style) trainers.

Each trainer rank owns dim-0 row slices of some global tensors (rows ``[a, b)`` of a C-order
tensor are its flat elements ``[a * r, b * r)``, ``r`` being the product of the other
dimensions). One :class:`ShardWriter` per rank detects and encodes the changes of its slices
as a :class:`~deltastore.Publisher` does, uploads the frames (at global element positions)
under the version's data prefix, and writes a *part* describing its slices (and its slices of
the version's anchor copy, when the anchor policy asks for one). :func:`commit_parts`, run for
each version by one process, waits for the parts of all writers, checks that they tile every
tensor and name one parent, and commits an ordinary format-v1 manifest. Every writer then
calls :meth:`ShardWriter.finish`, which moves its snapshot to the version once it is
committed; until then a writer stays at its previous version. :class:`ModuleWriter`
(:mod:`deltastore.publish.module_writer`) drives all of this for a torch.distributed module.

Keys (readers ignore objects that no manifest names; :mod:`deltastore.publish.runs`):

- ``versions/<v:020d>/parts/<run>/<rank:06d>-of-<world:06d>.json``: a writer's :class:`Part`
  (``versions/<v:020d>/parts/<rank:06d>-of-<world:06d>.json`` for writers without a run),
  created if absent; deleted after the commit (best effort);
- ``versions/<v:020d>/parts/<run>/abort.json`` (``parts/abort.json`` without a run): the
  version given up (a part missing at the timeout, bad parts, a writer that failed, a restart
  that abandoned it); :func:`commit_parts` never commits it, :meth:`ShardWriter.finish` stops
  waiting when it appears;
- ``runs/<seq:020d>.json``: run records; only the newest run's parts are committed.
"""

from __future__ import annotations

import logging
import operator
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from deltastore._version import __version__
from deltastore.errors import (
    ChainError,
    ManifestError,
    ObjectNotFoundError,
    TensorMismatchError,
    VersionExistsError,
    VersionOrderError,
)
from deltastore.format.checksum import combine_frames
from deltastore.format.keys import anchor_key, manifest_key
from deltastore.format.manifest import Manifest, Parent, TensorEntry, parse_manifest
from deltastore.progress import ProgressFn
from deltastore.publish.commit import conditional_writes, stored_bytes
from deltastore.publish.parts import Part, PartTensor, commit_parts, parse_part, wait_committed
from deltastore.publish.policy import AnchorCosts
from deltastore.publish.publisher import ChainWriter, Pending, PublishReport, table_entry
from deltastore.publish.runs import abort_key, check_run, check_run_id, part_key, parts_prefix
from deltastore.publish.slice_check import check_slices, words_adler
from deltastore.publish.snapshot import TensorSums, row_range
from deltastore.store import Store
from deltastore.tensors.dtypes import CastWords, np_words

if TYPE_CHECKING:
    from torch import nn

    from deltastore.publish.module_writer import ModuleWriter
    from deltastore.publish.snapfree_prepare import Prepared
    from deltastore.publish.snapfree_writer import Item, SnapshotFree

log = logging.getLogger(__name__)

Rows = tuple[int, int]


@dataclass(frozen=True, eq=False)
class RowSlice:
    """Rows ``[row_start, row_start + tensor.shape[0])`` of a global tensor of ``global_shape``.

    ``tensor`` has the global tensor's other dimensions. A tensor that is not sharded is one
    slice of all its rows (:meth:`whole`), given by exactly one writer; a 0-dim tensor is one
    row.
    """

    tensor: torch.Tensor
    global_shape: Sequence[int]
    row_start: int = 0
    #: The optimizer's parameter these rows belong to, when it is not ``tensor`` itself (an
    #: FSDP2 DTensor); a snapshot-free writer finds the optimizer state through it.
    param: torch.Tensor | None = None
    #: Publish the rows cast to this dtype (None: ``tensor``'s), cast a frame at a time
    #: during the publish, never all at once (a memory-snapshot writer; a snapshot-free one
    #: takes the dtype of what it is given).
    dtype: torch.dtype | None = None

    def words(self) -> np.ndarray | CastWords:
        """What is published of these rows: their words, or their cast words a slice at a
        time (:class:`~deltastore.tensors.dtypes.CastWords`) when :attr:`dtype` differs."""
        if self.dtype is not None and self.dtype != self.tensor.dtype:
            return CastWords(self.tensor, self.dtype)
        return np_words(self.tensor.detach().cpu().contiguous())

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> RowSlice:
        """All of ``tensor``, from one writer."""
        return cls(tensor, tuple(tensor.shape), 0)

    @classmethod
    def of(cls, param: torch.Tensor) -> RowSlice | None:
        """This rank's rows of a DTensor parameter on a 1-D device mesh (FSDP2): for a
        dim-0 ``Shard`` placement its local shard (``to_local()``), the global shape and the
        first row (torch's even split: ``ceil(rows / world)`` rows per rank, from the rank's
        mesh coordinate); for ``Replicate``, the whole tensor on coordinate 0 and None on the
        others (leave it out of their slices: one writer gives it). A plain tensor is
        :meth:`whole`. :class:`TensorMismatchError` for other placements."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not isinstance(param, DTensor):
            return cls.whole(param)
        placements = tuple(param.placements)
        coordinate = param.device_mesh.get_coordinate()
        if len(placements) != 1 or coordinate is None:
            raise TensorMismatchError(
                f"RowSlice.of takes a DTensor on a 1-D mesh this rank is part of, got "
                f"placements {placements}"
            )
        local = param.to_local()
        shape = tuple(param.shape)
        if isinstance(placements[0], Replicate):
            return cls(local, shape, 0, param) if coordinate[0] == 0 else None
        if not isinstance(placements[0], Shard) or placements[0].dim != 0:
            raise TensorMismatchError(
                f"RowSlice.of takes dim-0 Shard or Replicate placements, got {placements}"
            )
        rows = shape[0] if shape else 1
        per = -(-rows // param.device_mesh.size())
        start = min(coordinate[0] * per, rows)
        return cls(local, shape, start, param)


def _slice_spec(name: str, s: RowSlice) -> tuple[tuple[str, list[int]], Rows]:
    """``(dtype, global shape)`` and dim-0 rows of a slice; :class:`TensorMismatchError` when
    it is not a row range of its global shape."""
    try:
        shape = [operator.index(d) for d in s.global_shape]
        start = operator.index(s.row_start)
    except TypeError:
        raise TensorMismatchError(
            f"{name}: global_shape and row_start must be integers, got "
            f"{s.global_shape!r} and {s.row_start!r}"
        ) from None
    spec = table_entry(name, s.dtype or s.tensor.dtype, shape)
    local = list(s.tensor.shape)
    rows, n = (shape[0] if shape else 1), (local[0] if local else 1)
    fits = min(shape, default=0) >= 0 and len(local) == len(shape) and local[1:] == shape[1:]
    if not fits or not 0 <= start <= rows - n:
        raise TensorMismatchError(
            f"{name}: a {local} slice at row {start} is not a row range of a {shape} tensor"
        )
    return spec, (start, start + n)


@dataclass
class _Inflight:
    """A part published and waiting for its version's commit."""

    part: Part
    pending: Pending
    host: dict[str, np.ndarray]  # copies of an anchor's words (empty for a delta)
    prepared: Prepared | None = None  # a snapshot-free part (adopted by finish)


class ShardWriter(ChainWriter):
    """The writer of rank ``rank`` of ``world`` writers of a sharded trainer.

    Keyword options are :class:`~deltastore.Publisher`'s (``storage_options``, ``snapshot``,
    ``state_dir``, ``max_frame_bytes``, ``max_object_bytes``, ``zstd_level``, ``codecs``,
    ``anchor_policy``: every writer must use the same, ``unsafe_commits``: pass it to
    :func:`commit_parts` too); a disk snapshot is adopted only by a writer of the same rank
    and world. ``run``: the id of the writers' run (:mod:`deltastore.publish.runs`), the same
    for every writer of the group; its parts are committed only by ``commit_parts(...,
    run=run)`` while it is the store's current run (None: parts without a run, no fence).
    Per version: :meth:`publish`, then :func:`commit_parts` in one process, then
    :meth:`finish`. A delta gets an anchor copy by the anchor policy, as a
    :class:`~deltastore.Publisher`'s does (the decision is a function of the committed chain,
    so that every writer makes the same); each writer encodes its slices of it.
    :meth:`for_module` builds the writers of a torch.distributed module. Not thread-safe.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | Store,
        rank: int,
        world: int,
        *,
        run: str | None = None,
        **options: Any,
    ) -> None:
        if any(isinstance(x, bool) or not isinstance(x, int) for x in (rank, world)) or not (
            0 <= rank < world
        ):
            raise ValueError(f"need 0 <= rank < world, got rank {rank!r} of world {world!r}")
        check_run_id(run)
        self.rank, self.world, self.run = rank, world, run
        self._shard = (rank, world)
        self._inflight: _Inflight | None = None
        super().__init__(url, **options)

    @classmethod
    def for_module(
        cls, url: str | os.PathLike[str] | Store, model: nn.Module, **options: Any
    ) -> ModuleWriter:
        """The writer of this rank for a torch.distributed (FSDP2, DTensor) ``model``: a
        :class:`~deltastore.publish.module_writer.ModuleWriter` (collective: every rank
        calls it; see there for ``options``)."""
        from deltastore.publish.module_writer import ModuleWriter

        return ModuleWriter(url, model, **options)

    def publish(
        self,
        slices: Mapping[str, RowSlice],
        *,
        version: int,
        anchor: bool | None = None,
        progress: ProgressFn | None = None,
    ) -> PublishReport:
        """Upload this writer's part of ``version``: the changes of its ``slices`` (by global
        tensor name). Nothing is committed: see :func:`commit_parts` and :meth:`finish`.

        A delta on the version the writer holds when its slices (names, dtypes, global shapes,
        rows) are the same as then, else an anchor; ``anchor=True`` forces an anchor,
        ``anchor=False`` refuses one (:class:`ChainError`). All writers of a version must agree.
        The report counts this writer's slices. Raises :class:`VersionOrderError`,
        :class:`ChainError` (the store moved past this writer's version, or its last version
        was committed but not finished), :class:`TensorMismatchError` (a slice that is not a
        row range of its global shape) and :class:`VersionExistsError` (the part exists).
        """
        t_start = time.perf_counter()
        inflight = self._inflight
        if inflight is not None and self.store.exists(manifest_key(inflight.part.version)):
            check_run(self.store, self.run)  # a newer run committed it: say so
            raise ChainError(
                f"version {inflight.part.version} is committed but rank {self.rank} did not "
                f"finish() it; call finish({inflight.part.version}) before publishing {version}"
            )
        try:
            self._check_version(version, anchor=bool(anchor))
        except (ChainError, VersionOrderError):
            check_run(self.store, self.run)  # a newer run moved the chain: say so
            raise
        # before any upload: refuse unsafe commits unless accepted
        conditional_writes(self.store, unsafe_commits=self.unsafe_commits)
        specs: dict[str, tuple[str, list[int]]] = {}
        rows: dict[str, Rows] = {}
        for name, s in slices.items():
            specs[name], rows[name] = _slice_spec(name, s)
        if self._snapfree is not None:
            _no_cast(slices)
            return self._publish_snapshot_free(slices, rows, version, anchor, progress, t_start)
        held = self._held.tensors
        same = held is not None and {n: (*specs[n], rows[n]) for n in specs} == {
            n: (s.dtype, s.shape, s.rows) for n, s in held.items()
        }
        if anchor is False and not same:
            raise ChainError(
                "cannot publish a delta: this writer holds no version, or its slices (names, "
                "dtypes, shapes, rows) changed; publish an anchor from every writer"
            )
        parent_state = held if same and not anchor else None
        parent = self._parent() if parent_state is not None else None
        kind: Literal["anchor", "delta"] = "delta" if parent is not None else "anchor"
        reason = self._copy_reason() if kind == "delta" else _anchor_reason(anchor, held)
        host = {n: s.words() for n, s in slices.items()}
        self._inflight = None
        full = kind == "delta" and reason is not None
        pending = self._encode(version, host, specs, parent_state, kind, progress, rows, full=full)
        part = self._write_part(version, parent, pending, rows)
        kept = {} if parent is not None else {n: w.copy() for n, w in host.items()}
        self._inflight = _Inflight(part, pending, kept)
        return self._report(
            version, kind, parent, host, pending, t_start, reason, _copy_bytes(pending)
        )

    def _write_part(
        self, version: int, parent: Parent | None, pending: Pending, rows: Mapping[str, Rows]
    ) -> Part:
        """Create this writer's part of ``version`` (its entries at their rows; ``parent``:
        the version its deltas apply to); the request counts in ``upload_s``."""
        copy = pending.copy_entries
        part = Part(
            part_format=1,
            version=version,
            rank=self.rank,
            world=self.world,
            token=self.token,
            library=f"deltastore {__version__}",
            parent=parent,
            tensors={n: _part_tensor(e, rows[n]) for n, e in pending.entries.items()},
            run=self.run,
            anchor_copy=None
            if copy is None
            else {n: _part_tensor(e, rows[n]) for n, e in copy.items()},
        )
        t0 = time.perf_counter()
        key = part_key(version, self.rank, self.world, self.run)
        try:
            self.store.put_if_absent(key, part.model_dump_json(indent=1).encode())
        except VersionExistsError:
            committed = self.store.exists(manifest_key(version))
            raise VersionExistsError(
                f"version {version} is committed already; publish a higher version"
                if committed
                else f"{key} exists: an uncommitted part of rank {self.rank} for version "
                f"{version}, left by an earlier (crashed?) run of these writers; give the "
                "writers a new run id (ModuleWriter does, and its resume() abandons the old "
                "parts) or publish a higher version"
            ) from None
        pending.upload_s += time.perf_counter() - t0
        return part

    def finish(self, version: int, *, timeout_s: float = 60.0, poll_s: float = 0.05) -> Manifest:
        """Wait until ``version`` is committed, then hold it; returns its manifest.

        Checks that the manifest carries this writer's frames and parent. Raises
        :class:`VersionNotCommittedError` when the version is aborted or not committed within
        ``timeout_s`` (the writer stays at its previous version: publish a higher version from
        every writer), :class:`VersionExistsError` when it was committed without this writer's
        part, :class:`ChainError` when this writer has no part of ``version`` to finish.
        """
        inflight = self._inflight
        if inflight is None or inflight.part.version != version:
            raise ChainError(f"rank {self.rank} has no unfinished part of version {version}")
        manifest = wait_committed(self.store, version, timeout_s, poll_s, self.run)
        self._inflight = None
        part = inflight.part
        if manifest.parent != part.parent or not all(
            (e := manifest.tensors.get(n)) is not None
            and (e.dtype, e.shape) == (t.dtype, t.shape)
            and set(t.frames) <= set(e.frames)
            for n, t in part.tensors.items()
        ):
            check_run(self.store, self.run)  # a newer run committed it: say so
            raise VersionExistsError(
                f"version {version} was committed without the part of rank {self.rank}; "
                "attach() this writer to the newest version"
            )
        if inflight.prepared is not None and self._snapfree is not None:
            inflight.prepared.adopt(self, self._snapfree, manifest)
        else:
            incremental = part.parent is not None
            self._adopt(  # the host words are this writer's own copy of an anchor's
                manifest, inflight.host, inflight.pending, incremental=incremental, owned=True
            )
        if part.anchor_copy is None:
            self._account(manifest, stored_bytes(manifest), None)
        elif self._copy_done(version, timeout_s, poll_s):
            self._account(manifest, stored_bytes(manifest), self._read_copy(version))
        else:  # unknown: the account is read from the store before the next decision
            self._costs = AnchorCosts()
        return manifest

    def _copy_done(self, version: int, timeout_s: float, poll_s: float) -> bool:
        """Whether :func:`commit_parts` is past the anchor copy of ``version``: it deletes
        the parts after writing the copy (success or not), so this writer waits for its own
        part to go, at most ``timeout_s`` (every writer then reads the same copy, or none)."""
        key, deadline = part_key(version, self.rank, self.world, self.run), time.monotonic()
        deadline += timeout_s
        while self._io.exists(key):
            if time.monotonic() >= deadline:
                log.info("part of version %d still there after %g s", version, timeout_s)
                return False
            time.sleep(poll_s)
        return True

    def _read_copy(self, version: int) -> Manifest | None:
        """The anchor copy of ``version``, for the anchor account (None: it was not written,
        or cannot be read; every writer reads the same)."""
        try:
            return parse_manifest(self._io.get(anchor_key(version)))
        except (ObjectNotFoundError, ManifestError) as exc:
            log.info("version %d has no readable anchor copy (%s)", version, exc)
            return None

    def _publish_snapshot_free(
        self,
        slices: Mapping[str, RowSlice],
        rows: dict[str, Rows],
        version: int,
        anchor: bool | None,
        progress: ProgressFn | None,
        t_start: float,
    ) -> PublishReport:
        """:meth:`publish` with ``snapshot="none"``: this writer's slices reconstructed from
        its own optimizer shard (never an automatic anchor: all writers must agree)."""
        from deltastore.publish.snapfree_prepare import prepare

        sf = self._snapfree
        assert sf is not None
        items = _items(sf, slices)
        held = self._held.tensors
        same = held is not None and {n: (*it.spec, rows[n]) for n, it in items.items()} == {
            n: (s.dtype, s.shape, s.rows) for n, s in held.items()
        }
        self._inflight = None
        prep = prepare(
            self,
            sf,
            items,
            version=version,
            same_table=same,
            anchor=anchor,
            progress=progress,
            rows=rows,
            auto_anchor=False,
        )
        part = self._write_part(version, prep.parent, prep.pending, rows)
        self._inflight = _Inflight(part, prep.pending, {}, prep)
        return self._prepared_report(prep, version, t_start, prep.reason, _copy_bytes(prep.pending))

    def attach(self, slices: Mapping[str, RowSlice], *, version: int | None = None) -> int:
        """Continue the chain from this writer's ``slices`` of the store's newest version
        (``version``, when given, must be it); returns that version.

        Each slice must be of a tensor of that version (dtype, global shape), and its bytes must
        match the Adler-32 of the frames that last stored them: the version's frames, then
        those of its parents for rows they did not store, back to an anchor if need be. Raises
        :class:`ChainError` (an empty store, ``version`` not the newest) and
        :class:`TensorMismatchError` (a slice differs, or the frames do not align with it:
        after a change of sharding or ``max_frame_bytes``, publish an anchor from every writer).
        """
        manifest = self._head_manifest(version)
        specs: dict[str, tuple[str, list[int]]] = {}
        rows: dict[str, Rows] = {}
        for name, s in slices.items():
            specs[name], rows[name] = _slice_spec(name, s)
        if self._snapfree is not None:
            _no_cast(slices)
            return self._attach_snapshot_free(slices, rows, manifest)
        for name in slices:
            entry = manifest.tensors.get(name)
            if entry is None or (entry.dtype, entry.shape) != specs[name]:
                raise TensorMismatchError(
                    f"{name}: {specs[name][0]}{specs[name][1]} is not a tensor of version "
                    f"{manifest.version}"
                )
        host = {n: _array(s.words()) for n, s in slices.items()}
        sums = {n: self._checksums(w) for n, w in host.items()}
        ranges = {n: row_range(specs[n][1], rows[n]) for n in host}
        readers = {n: partial(words_adler, w) for n, w in host.items()}
        check_slices(self.store, manifest, readers, ranges, {n: s.whole for n, s in sums.items()})
        self._inflight = None
        self._held.replace(manifest.version, manifest.state_digest, host, specs, sums, rows)
        return manifest.version

    def _attach_snapshot_free(
        self, slices: Mapping[str, RowSlice], rows: dict[str, Rows], manifest: Manifest
    ) -> int:
        """:meth:`attach` with ``snapshot="none"``: the slices checked against the chain's
        frames chunk by chunk (the bf16 cast of a reconstructed slice is never held whole),
        then block digests for those and words for the snapshot slices."""
        from deltastore.publish.snapfree_prepare import chunk_sums, range_adler
        from deltastore.publish.snapfree_writer import EMPTY

        sf = self._snapfree
        assert sf is not None
        items = _items(sf, slices)
        sums: dict[str, TensorSums] = {}
        held: dict[str, np.ndarray] = {}
        digests: dict[str, np.ndarray] = {}
        readers: dict[str, Callable[[int, int], int]] = {}
        for name, it in items.items():
            entry = manifest.tensors.get(name)
            if entry is None or (entry.dtype, entry.shape) != it.spec:
                raise TensorMismatchError(
                    f"{name}: {it.spec[0]}{it.spec[1]} is not a tensor of version "
                    f"{manifest.version}"
                )
            if it.param is not None and it.reason is None:
                grid = self._frames_of(it.flat.numel(), 2)
                frames, digests[name] = chunk_sums(it.flat, grid, sf.chunk)
                sums[name] = TensorSums(
                    frames,
                    combine_frames(
                        (f, (b - a) * 2) for f, (a, b) in zip(frames, grid, strict=True)
                    ),
                )
                held[name] = EMPTY
                readers[name] = partial(range_adler, it.flat, sf.chunk)
            else:
                held[name] = it.words()
                sums[name] = self._checksums(held[name])
                readers[name] = partial(words_adler, held[name])
        ranges = {n: row_range(items[n].spec[1], rows[n]) for n in items}
        check_slices(self.store, manifest, readers, ranges, {n: s.whole for n, s in sums.items()})
        self._inflight = None
        specs = {n: it.spec for n, it in items.items()}
        self._held.replace(manifest.version, manifest.state_digest, held, specs, sums, rows)
        sf.digests = digests
        sf.inverter.mark()
        return manifest.version


def _items(sf: SnapshotFree, slices: Mapping[str, RowSlice]) -> dict[str, Item]:
    """The snapshot-free writer's classification of ``slices`` (local tensors, their
    optimizer parameters, global shapes)."""
    return sf.items(
        {n: s.tensor for n, s in slices.items()},
        table_entry,
        owners={n: s.param for n, s in slices.items()},
        shapes={n: s.global_shape for n, s in slices.items()},
    )


def _no_cast(slices: Mapping[str, RowSlice]) -> None:
    """:class:`TensorMismatchError` for a cast slice given to a snapshot-free writer."""
    cast = [n for n, s in slices.items() if s.dtype is not None and s.dtype != s.tensor.dtype]
    if cast:
        raise TensorMismatchError(
            f"RowSlice.dtype is for memory-snapshot writers ({', '.join(cast[:5])}); with "
            "snapshot='none' pass the tensors as they are (float32 parameters of the optimizer "
            "are published as bfloat16)"
        )


def _array(words: np.ndarray | CastWords) -> np.ndarray:
    return words.copy() if isinstance(words, CastWords) else words


def _anchor_reason(anchor: bool | None, held: object) -> str:
    """Why a shard writer's version is an anchor."""
    if anchor:
        return "forced"
    return "first version" if held is None else "the slices changed"


def _copy_bytes(pending: Pending) -> int | None:
    """Payload bytes of this writer's slices of the anchor copy (None: no copy)."""
    copy = pending.copy_entries
    return None if copy is None else sum(f.length for e in copy.values() for f in e.frames)


def _part_tensor(e: TensorEntry, rows: Rows) -> PartTensor:
    start, stop = row_range(e.shape, rows)
    return PartTensor(
        dtype=e.dtype,
        shape=e.shape,
        row_start=rows[0],
        row_stop=rows[1],
        start=start,
        stop=stop,
        adler32=e.adler32,
        parent_adler32=e.parent_adler32,
        changed=e.changed,
        frames=e.frames,
    )


__all__ = [
    "Part",
    "PartTensor",
    "RowSlice",
    "ShardWriter",
    "abort_key",
    "commit_parts",
    "parse_part",
    "part_key",
    "parts_prefix",
]
