"""Parts of a version written by several writers, and the coordinator that commits them.

See :mod:`deltastore.publish.sharded` for the protocol; this module holds the part keys, the strict
part models, :func:`commit_parts` and its checks. Functions are stateless.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from functools import partial
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from deltastore.catalog.chain import ChainReader
from deltastore.errors import (
    ChainError,
    DeltastoreError,
    ManifestError,
    ManifestNotFoundError,
    SupersededRunError,
    VersionExistsError,
    VersionNotCommittedError,
    VersionOrderError,
    WrongParentError,
)
from deltastore.format.chain import PARENT_ADLER32, PARENT_DIGEST, PARENT_TABLE, State, link_misfits
from deltastore.format.checksum import combine_frames
from deltastore.format.codecs import NEW_WORDS_CODECS
from deltastore.format.dtypes import itemsize
from deltastore.format.keys import data_prefix, manifest_key
from deltastore.format.manifest import (
    MAX_DIMS,
    MAX_ELEMENTS,
    NAME_PATTERN,
    U32,
    Count,
    DtypeName,
    Frame,
    Manifest,
    Parent,
    TensorEntry,
    Version,
    load_json,
    validation_summary,
)
from deltastore.format.signing import FROM_ENV, KeyOption, resolve_keys
from deltastore.publish.commit import (
    check_version_number,
    commit_version,
    conditional_writes,
    head_version,
)
from deltastore.publish.runs import (
    RUN_ID,
    abandon_parts,
    abort_key,
    abort_reason,
    check_run,
    check_run_id,
    current_run,
    part_key,
    parts_prefix,
    register_run,
    write_abort,
)
from deltastore.publish.snapshot import row_range
from deltastore.store import Store, open_store

log = logging.getLogger("deltastore.publish.sharded")

Rows = tuple[int, int]


# --- parts -------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class PartTensor(_Strict):
    """A writer's slice of a tensor: dim-0 rows ``[row_start, row_stop)``, flat elements
    ``[start, stop)`` of the global tensor of ``shape``. ``adler32``, ``parent_adler32`` and
    ``changed`` are those of the slice's bytes; ``frames`` lie inside the slice, in order."""

    dtype: DtypeName
    shape: Annotated[list[Count], Field(max_length=MAX_DIMS)]
    row_start: Count
    row_stop: Count
    start: Count
    stop: Count
    adler32: U32
    parent_adler32: U32 | None
    changed: Count
    frames: list[Frame]

    @model_validator(mode="after")
    def _check(self) -> PartTensor:
        rows = self.shape[0] if self.shape else 1
        if math.prod(self.shape) > MAX_ELEMENTS or not self.row_start <= self.row_stop <= rows:
            raise ValueError(f"rows [{self.row_start}, {self.row_stop}) of a {self.shape} tensor")
        if (self.start, self.stop) != row_range(self.shape, (self.row_start, self.row_stop)):
            raise ValueError(f"elements [{self.start}, {self.stop}) are not the slice's rows")
        if self.changed > self.stop - self.start or self.changed != sum(
            f.changed for f in self.frames
        ):
            raise ValueError("changed is over the slice's size or not the sum of its frames'")
        end = self.start
        for f in self.frames:
            if f.start < end or f.stop > self.stop:
                raise ValueError(f"frame [{f.start}, {f.stop}) is out of order or of the slice")
            if (f.parent_adler32 is None) != (self.parent_adler32 is None):
                raise ValueError("frames and slice disagree on parent_adler32")
            end = f.stop
        return self


class Part(_Strict):
    """What writer ``rank`` of ``world`` published for ``version``: its slices, delta on
    ``parent`` (the version the writer holds) or, without one, an anchor."""

    part_format: Literal[1]
    version: Version
    rank: Annotated[int, Field(ge=0)]
    world: Annotated[int, Field(ge=1)]
    token: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    library: Annotated[str, Field(max_length=64)]
    parent: Parent | None
    tensors: dict[Annotated[str, Field(pattern=NAME_PATTERN)], PartTensor]
    #: The run of the writers (None: a writer without one).
    run: Annotated[str, Field(pattern=RUN_ID.pattern)] | None = None
    #: The writer's slices of the version's anchor copy (None: no copy), at the rows of
    #: ``tensors``; frames of new words.
    anchor_copy: dict[Annotated[str, Field(pattern=NAME_PATTERN)], PartTensor] | None = None

    @model_validator(mode="after")
    def _check(self) -> Part:
        if self.anchor_copy is not None:
            if self.parent is None or set(self.anchor_copy) != set(self.tensors):
                raise ValueError("an anchor copy is of a delta, with a slice per tensor")
            for name, c in self.anchor_copy.items():
                t = self.tensors[name]
                if (c.dtype, c.shape, c.row_start, c.row_stop) != (
                    t.dtype,
                    t.shape,
                    t.row_start,
                    t.row_stop,
                ) or not _anchor_slice(c):
                    raise ValueError(f"{name}: the copy's slice is not an anchor slice of it")
        if self.rank >= self.world:
            raise ValueError(f"rank {self.rank} is not below world {self.world}")
        if self.parent is not None and self.parent.version >= self.version:
            raise ValueError(f"parent version {self.parent.version} is not below {self.version}")
        prefix = data_prefix(self.version)
        copies = list((self.anchor_copy or {}).items())
        if any(not f.object.startswith(prefix) for _, c in copies for f in c.frames):
            raise ValueError(f"the copy's frames must be stored under {prefix}")
        for name, t in self.tensors.items():
            if any(not f.object.startswith(prefix) for f in t.frames):
                raise ValueError(f"{name}: frames must be stored under {prefix}")
            if self.parent is not None and t.parent_adler32 is None:
                raise ValueError(f"{name}: a slice of a delta needs parent_adler32")
            if self.parent is None and not _anchor_slice(t):
                raise ValueError(
                    f"{name}: without a parent, all of the slice changed, in frames of new words"
                )
        return self


def _anchor_slice(t: PartTensor) -> bool:
    """Whether ``t`` is a slice of an anchor: frames of new words (``raw``, ``raw-planes``)
    cover it, all of it changed."""
    end = t.start
    for f in t.frames:
        if f.start != end or f.codec not in NEW_WORDS_CODECS:
            return False
        end = f.stop
    return end == t.stop and t.changed == t.stop - t.start and t.parent_adler32 is None


def parse_part(data: bytes, *, key: str = "part") -> Part:
    """Parse and validate a part; :class:`ManifestError` for anything malformed."""
    try:
        return Part.model_validate(load_json(data, key))
    except ValidationError as exc:
        raise ManifestError(f"{key} is malformed: {validation_summary(exc)}") from None


def wait_committed(
    store: Store, version: int, timeout_s: float, poll_s: float, run: str | None = None
) -> Manifest:
    """The manifest of ``version`` once it exists; :class:`VersionNotCommittedError` when the
    version (of ``run``) is aborted or ``timeout_s`` passes first."""
    reader, deadline = ChainReader(store), time.monotonic() + timeout_s
    while True:
        try:
            return reader.manifest(version)
        except ManifestNotFoundError:
            pass
        reason = abort_reason(store, version, run)
        if reason is not None:
            raise VersionNotCommittedError(f"version {version} was aborted: {reason}")
        if time.monotonic() >= deadline:
            raise VersionNotCommittedError(
                f"version {version} was not committed within {timeout_s} s (is commit_parts "
                "running?); this writer stays at its previous version"
            )
        time.sleep(poll_s)


# --- coordinator -------------------------------------------------------------------------


def commit_parts(
    url: str | os.PathLike[str] | Store,
    *,
    version: int,
    world: int,
    run: str | None = None,
    timeout_s: float = 60.0,
    poll_s: float = 0.05,
    storage_options: dict[str, Any] | None = None,
    signing_key: KeyOption = FROM_ENV,
    unsafe_commits: bool = False,
) -> Manifest:
    """Commit ``version`` from the parts of writers ``0 .. world - 1`` of run ``run`` (None:
    writers without a run); returns its manifest.

    Waits (polling every ``poll_s`` seconds, at most ``timeout_s``) until every part exists,
    checks them, commits the manifest (create-if-absent), advances ``LATEST``, writes the
    version's anchor copy when every part carries its slice of one, and deletes the parts. Run
    it in one process per version (any one: a writer's, or another). If anything fails before
    the commit, the version (of this run) is aborted (see :mod:`deltastore.publish.runs`),
    nothing is committed and the error is raised: :class:`SupersededRunError` (a newer run of
    writers registered: this run's parts are never committed), :class:`VersionNotCommittedError`
    (a part missing at the timeout, or the version of this run aborted or abandoned),
    :class:`ManifestError` (a malformed part or one of another run; slices that overlap, leave
    rows without a writer, or disagree on a tensor's dtype or shape; a delta whose tensors are
    not its parent's), :class:`ChainError` (writers name different parents, or the parent is
    not the store's newest version), :class:`WrongParentError` (the parent's digest or a
    tensor's Adler-32 is not what the writers' snapshots started from),
    :class:`VersionOrderError`. :class:`VersionExistsError` when ``version`` is committed
    already (nothing is aborted then). ``signing_key`` signs the manifest and its copy
    (default: ``DELTASTORE_SIGNING_KEY`` if set; None: unsigned). ``unsafe_commits``: commit on
    a store whose service ignores preconditions (refused with
    :class:`PreconditionsIgnoredError` otherwise; one committer only): the manifest is read
    back and :class:`ForkError` raised when it is not this commit's.
    """
    check_version_number(version)
    check_run_id(run)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive integer, got {world!r}")
    keys = resolve_keys(signing_key)
    store = open_store(url, storage_options)
    enforced = conditional_writes(store, unsafe_commits=unsafe_commits)
    abort = partial(_abort, store, version, run)
    try:
        _check_open(store, version, run)
    except SupersededRunError as exc:  # this run's writers stop waiting in finish()
        abort(exc)
        raise
    try:
        parts = _wait_for_parts(store, version, world, timeout_s, poll_s, run)
        parent, entries, copy = _join_parts(parts)
        if parent is not None:
            _check_parent(store, version, parent, entries)
    except VersionExistsError:
        raise
    except ValidationError as exc:
        error = ManifestError(f"version {version}: {validation_summary(exc)}")
        abort(error)
        raise error from None
    except DeltastoreError as exc:
        abort(exc)
        raise
    manifest = commit_version(  # checks again that the version is open, then commits
        store,
        version=version,
        kind="delta" if parent is not None else "anchor",
        parent=parent,
        entries=entries,
        token=parts[0].token,
        signing_key=keys[0] if keys else None,
        enforced=enforced,
        check=partial(_check_open, store, version, run),
        copy_entries=copy,
        abort=abort,
    ).manifest
    for rank in range(world):
        try:
            store.delete(part_key(version, rank, world, run))
        except DeltastoreError as exc:  # garbage that does no harm
            log.debug("part %d of version %d not deleted: %s", rank, version, exc)
    log.info(
        "committed v%d (%s%s) from %d writers",
        version,
        manifest.kind,
        ", with an anchor copy" if copy is not None else "",
        world,
    )
    return manifest


def _check_open(store: Store, version: int, run: str | None) -> None:
    """Raise unless ``version`` can still be committed by run ``run``: the version of this run
    given up (its abort marker says why), then a superseded run (whatever else, its parts
    are never committed), then a version committed already or not above the newest."""
    _check_not_aborted(store, version, run)
    check_run(store, run)
    if store.exists(manifest_key(version)):
        raise VersionExistsError(f"version {version} is already committed in store {store.url}")
    head = head_version(store)
    if head is not None and version <= head:
        raise VersionOrderError(f"version {version} is not above the store's newest version {head}")


def _check_not_aborted(store: Store, version: int, run: str | None) -> None:
    reason = abort_reason(store, version, run)
    if reason is not None:
        of = f" of run {run}" if run is not None else ""
        raise VersionNotCommittedError(
            f"version {version}{of} was aborted, it is never committed: {reason}"
        )


def _abort(store: Store, version: int, run: str | None, error: Exception) -> None:
    """Mark ``version`` as given up, so that writers waiting in finish() stop (best effort)."""
    write_abort(store, version, run, f"{type(error).__name__}: {error}")


#: Polls of the parts between two reads of the abort marker.
_ABORT_EVERY = 20


def _wait_for_parts(
    store: Store, version: int, world: int, timeout_s: float, poll_s: float, run: str | None
) -> list[Part]:
    keys = [part_key(version, rank, world, run) for rank in range(world)]
    deadline = time.monotonic() + timeout_s
    polls = 0
    while True:
        present = set(store.list(parts_prefix(version, run)))
        missing = [rank for rank, key in enumerate(keys) if key not in present]
        if not missing:
            break
        if time.monotonic() >= deadline:
            shown = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
            raise VersionNotCommittedError(
                f"version {version}: no part from {len(missing)} of {world} writers (rank "
                f"{shown}) after {timeout_s} s; the version is aborted, nothing was committed: "
                "publish a higher version from every writer"
            )
        polls += 1
        if polls % _ABORT_EVERY == 0:  # a writer that failed gave the version up
            _check_not_aborted(store, version, run)
        time.sleep(poll_s)
    parts = [parse_part(store.get(key), key=key) for key in keys]
    for rank, (key, part) in enumerate(zip(keys, parts, strict=True)):
        if (part.version, part.rank, part.world, part.run) != (version, rank, world, run):
            raise ManifestError(
                f"{key} is the part of rank {part.rank} of {part.world} for version "
                f"{part.version} of run {part.run}"
            )
    return parts


def _describe(parent: Parent | None) -> str:
    if parent is None:
        return "no parent (an anchor)"
    return f"version {parent.version} (state digest {parent.state_digest[:12]})"


def _join_parts(
    parts: list[Part],
) -> tuple[Parent | None, dict[str, TensorEntry], dict[str, TensorEntry] | None]:
    """The parent all parts name, the tensor entries their slices make, and those of the
    anchor copy when every part carries its slices of one (None otherwise)."""
    parent = parts[0].parent
    odd = [p.rank for p in parts if p.parent != parent]
    if odd:
        raise ChainError(
            f"writers disagree on the parent: rank 0 names {_describe(parent)}, rank {odd[0]} "
            f"{_describe(parts[odd[0]].parent)} ({len(odd)} ranks differ from rank 0); attach() "
            "the writers to the newest version, or publish an anchor from every writer"
        )
    entries = _join_tensors([(p.rank, p.tensors) for p in parts])
    with_copy = [p for p in parts if p.anchor_copy is not None]
    if with_copy and len(with_copy) != len(parts):
        log.warning(
            "version %d: %d of %d writers sent an anchor copy (their anchor policies or chain "
            "accounts differ); the version is committed without one",
            parts[0].version,
            len(with_copy),
            len(parts),
        )
    if parent is None or len(with_copy) != len(parts):
        return parent, entries, None
    return parent, entries, _join_tensors([(p.rank, p.anchor_copy or {}) for p in parts])


def _join_tensors(
    parts: list[tuple[int, Mapping[str, PartTensor]]],
) -> dict[str, TensorEntry]:
    """The tensor entries that the slices of the writers (rank, slices) make."""
    slices: dict[str, list[tuple[int, PartTensor]]] = {}
    for rank, tensors in parts:
        for name, t in tensors.items():
            slices.setdefault(name, []).append((rank, t))
    return {name: _join_slices(name, s) for name, s in slices.items()}


def _join_slices(name: str, slices: list[tuple[int, PartTensor]]) -> TensorEntry:
    """One tensor from the slices of the writers (rank, slice): they must tile its rows."""
    rank0, first = slices[0]
    for rank, t in slices[1:]:
        if (t.dtype, t.shape) != (first.dtype, first.shape):
            raise ManifestError(
                f"{name}: rank {rank} has a {t.dtype}{t.shape} tensor, rank {rank0} a "
                f"{first.dtype}{first.shape} one"
            )
    ordered = sorted((s for s in slices if s[1].row_start < s[1].row_stop), key=_row_start)
    end, last = 0, -1
    for rank, t in ordered:
        if t.row_start != end:
            what = (
                f"overlap those of rank {last}"
                if t.row_start < end
                else f"leave rows [{end}, {t.row_start}) without a writer"
            )
            raise ManifestError(f"{name}: rows [{t.row_start}, {t.row_stop}) of rank {rank} {what}")
        end, last = t.row_stop, rank
    rows = first.shape[0] if first.shape else 1
    if end != rows:
        raise ManifestError(f"{name}: rows [{end}, {rows}) have no writer")
    size = itemsize(first.dtype)
    return TensorEntry(
        dtype=first.dtype,
        shape=first.shape,
        adler32=combine_frames((t.adler32, (t.stop - t.start) * size) for _, t in ordered),
        parent_adler32=None
        if first.parent_adler32 is None
        else combine_frames(
            (t.parent_adler32, (t.stop - t.start) * size)
            for _, t in ordered
            if t.parent_adler32 is not None
        ),
        changed=sum(t.changed for _, t in ordered),
        frames=[f for _, t in ordered for f in t.frames],
    )


def _row_start(s: tuple[int, PartTensor]) -> int:
    return s[1].row_start


def _check_parent(
    store: Store, version: int, parent: Parent, entries: Mapping[str, TensorEntry]
) -> None:
    """A delta: its parent must be the store's newest version, with the digest and the
    tensors (and their Adler-32) the writers' slices started from (the chain-link rule of
    :mod:`deltastore.format.chain`)."""
    reader = ChainReader(store)
    head = reader.newest()
    if head is None or head != parent.version:
        raise ChainError(
            f"version {version} is a delta on version {parent.version}, but the store's newest "
            f"version is {head}; attach() the writers to it, or publish an anchor"
        )
    pm = reader.manifest(head)
    misfits = link_misfits(State.of(pm), kind="delta", parent=parent, tensors=entries)
    if any(x.kind == PARENT_DIGEST for x in misfits):
        raise WrongParentError(
            f"version {version}: the writers hold another version {head} than the store's "
            f"(state digest {parent.state_digest[:12]}, store {pm.state_digest[:12]})"
        )
    odd = [n for x in misfits if x.kind == PARENT_TABLE for n in x.tensors]
    if odd:
        raise ManifestError(
            f"version {version}: a delta must have the tensors of its parent {head} (names, "
            f"dtypes, shapes); {len(odd)} differ ({', '.join(odd[:5])})"
        )
    bad = [n for x in misfits if x.kind == PARENT_ADLER32 for n in x.tensors]
    if bad:
        raise WrongParentError(
            f"version {version}: the writers' slices of {len(bad)} tensors ({', '.join(bad[:5])})"
            f" did not start from version {head} (their parent Adler-32 does not add up to the "
            "parent's): a writer's snapshot is out of date; attach() it or publish an anchor"
        )


__all__ = [
    "Part",
    "PartTensor",
    "abandon_parts",
    "abort_key",
    "commit_parts",
    "current_run",
    "parse_part",
    "part_key",
    "parts_prefix",
    "register_run",
    "wait_committed",
]
