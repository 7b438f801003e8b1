"""Runs of sharded writers: which group of writer processes may commit, and what a crashed
group left behind.

A *run* is one start of a group of writers (every rank of a trainer job), named by a random
32-hex id that all its writers share and write into their parts. The store keeps a record per
run; the newest record names the store's *current run*, and :func:`commit_parts` commits only
the current run's parts: a run that a restart replaced (*superseded*) can never commit again,
even if some of its processes are still alive. Keys (not part of the format: readers ignore
them, like the parts themselves):

- ``runs/<seq:020d>.json``: a run record ``{"run", "world", "started", "library"}``, created
  with ``put_if_absent`` at one above the highest ``seq`` (:func:`register_run`);
- ``versions/<v:020d>/parts/<run>/<rank:06d>-of-<world:06d>.json``: a part of run ``<run>``;
- ``versions/<v:020d>/parts/<run>/abort.json``: run ``<run>`` gave version ``v`` up, or a
  later run abandoned it (:func:`abandon_parts`); that version of that run is never committed.

Functions are stateless; each store call is one request unless said otherwise.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone

from deltastore._version import __version__
from deltastore.errors import (
    DeltastoreError,
    ObjectNotFoundError,
    SupersededRunError,
    VersionExistsError,
)
from deltastore.format.keys import DATA_PREFIX, data_prefix, manifest_key
from deltastore.store import Store

log = logging.getLogger("deltastore.publish.sharded")

RUN_PREFIX = "runs/"
#: A run id: 32 lowercase hex digits.
RUN_ID = re.compile(r"^[0-9a-f]{32}$")
_RUN_KEY = re.compile(r"^runs/([0-9]{20})\.json$")
#: A run's abort marker: groups version, run.
RUN_ABORT_KEY = re.compile(r"^versions/([0-9]{20})/parts/([0-9a-f]{32})/abort\.json$")
#: A part key, with or without a run folder: groups version, run (or None), rank, world.
PART_KEY = re.compile(
    r"^versions/([0-9]{20})/parts/(?:([0-9a-f]{32})/)?([0-9]{6})-of-([0-9]{6})\.json$"
)
_REGISTER_TRIES = 16


def new_run_id() -> str:
    """A fresh run id (a UUID4 as 32 lowercase hex digits)."""
    return uuid.uuid4().hex


def check_run_id(run: object) -> None:
    """:class:`ValueError` unless ``run`` is None or 32 lowercase hex digits."""
    if run is not None and not (isinstance(run, str) and RUN_ID.match(run)):
        raise ValueError(f"a run id is 32 lowercase hex digits (new_run_id()), got {run!r}")


def parts_prefix(version: int, run: str | None = None) -> str:
    """Key prefix of the parts of ``version`` (of run ``run``; None: the parts without a run)."""
    return f"{data_prefix(version)}parts/" + (f"{run}/" if run is not None else "")


def part_key(version: int, rank: int, world: int, run: str | None = None) -> str:
    """Key of the part of writer ``rank`` of ``world`` for ``version`` (of run ``run``)."""
    return f"{parts_prefix(version, run)}{rank:06d}-of-{world:06d}.json"


def abort_key(version: int, run: str | None = None) -> str:
    """Key of the marker that gives ``version`` (of run ``run``) up."""
    return f"{parts_prefix(version, run)}abort.json"


def run_key(seq: int) -> str:
    """Key of the run record number ``seq``."""
    return f"{RUN_PREFIX}{seq:020d}.json"


@dataclass(frozen=True)
class RunRecord:
    """The store's newest run record: its number and run id."""

    seq: int
    run: str


def current_run(store: Store) -> str | None:
    """The id of the store's current run (None: no run ever registered); see
    :func:`newest_run`."""
    record = newest_run(store)
    return None if record is None else record.run


def newest_run(store: Store) -> RunRecord | None:
    """The store's current run: the run record with the highest number (None: no run ever
    registered). Two requests (a listing and a read). A record that cannot be read or names
    no valid run id counts as a run of its own that no writer has (it supersedes the older
    ones: a writer that sees it is refused, which is the safe side)."""
    seqs = [int(m.group(1)) for k in store.list(RUN_PREFIX) if (m := _RUN_KEY.match(k))]
    if not seqs:
        return None
    seq = max(seqs)
    try:
        run = json.loads(store.get(run_key(seq)))["run"]
    except (ValueError, KeyError, TypeError, ObjectNotFoundError):
        run = "(unreadable run record)"
    return RunRecord(seq, run if isinstance(run, str) else "(unreadable run record)")


def register_run(store: Store, run: str, world: int) -> int:
    """Make ``run`` (of ``world`` writers) the store's current run; returns its record number.

    Idempotent: a run that is current already is not registered again. Creates the record one
    above the highest with ``put_if_absent``; when another run takes that number first, the
    newest record is read again (at most 16 times). Call it from one process of the run (the
    committer); from then on :func:`check_run` refuses every older run."""
    check_run_id(run)
    body = json.dumps(
        {
            "run": run,
            "world": world,
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "library": f"deltastore {__version__}",
        }
    ).encode()
    for _ in range(_REGISTER_TRIES):
        record = newest_run(store)
        if record is not None and record.run == run:
            return record.seq
        seq = 0 if record is None else record.seq + 1
        try:
            store.put_if_absent(run_key(seq), body)
        except VersionExistsError:
            continue  # another run registered meanwhile: look again
        log.info(
            "run %s (%d writers) is the current run of %s (record %d)", run, world, store.url, seq
        )
        return seq
    raise SupersededRunError(
        f"run {run} could not register in store {store.url}: other runs keep registering; "
        "is another trainer job writing to this store?"
    )


def check_run(store: Store, run: str | None) -> None:
    """:class:`SupersededRunError` unless ``run`` may commit: it is the store's current run,
    or no run was ever registered (then only writers without a run commit, as before runs)."""
    record = newest_run(store)
    if record is None or record.run == run:
        return
    if run is None:
        raise SupersededRunError(
            f"store {store.url} belongs to run {record.run} (run record {record.seq}); parts "
            "without a run id are not committed there: publish through that run's writers"
        )
    raise SupersededRunError(
        f"run {run} was superseded by run {record.run} (run record {record.seq}, registered by "
        "a restart of the writers): its parts are never committed; stop the old run's "
        "processes, the new run publishes from now on"
    )


def abort_reason(store: Store, version: int, run: str | None) -> str | None:
    """Why ``version`` of ``run`` was given up (None: it was not). One request."""
    try:
        data = store.get(abort_key(version, run))
    except ObjectNotFoundError:
        return None
    try:
        return str(json.loads(data)["reason"])
    except (ValueError, KeyError, TypeError):
        return "(unreadable abort marker)"


def write_abort(store: Store, version: int, run: str | None, reason: str) -> None:
    """Give ``version`` of ``run`` up (best effort: an existing marker is kept, a store error
    is logged; writers then time out instead of stopping at once)."""
    body = json.dumps({"version": version, "run": run, "reason": reason})
    try:
        store.put_if_absent(abort_key(version, run), body.encode())
    except DeltastoreError as exc:
        log.debug("abort marker of version %d (run %s) not written: %s", version, run, exc)


def group_parts(
    keys: Iterable[str], *, above: int | None = None
) -> dict[tuple[int, str | None], list[str]]:
    """The part keys among ``keys`` (a listing of ``versions/``) by (version, run), for
    versions above ``above`` (all: None)."""
    found: dict[tuple[int, str | None], list[str]] = {}
    for key in keys:
        m = PART_KEY.match(key)
        if m is None:
            continue
        version = int(m.group(1))
        if above is None or version > above:
            found.setdefault((version, m.group(2)), []).append(key)
    return found


def abandon_parts(
    store: Store, *, above: int | None, keep_run: str | None, reason: str
) -> list[tuple[int, str | None]]:
    """Give up every uncommitted version above ``above`` (the store's newest committed version,
    None: all) that has parts of a run other than ``keep_run`` and no abort marker yet: an abort
    marker each, so that a late :func:`commit_parts` of it is refused with
    :class:`VersionNotCommittedError`. The parts
    and their data objects stay until ``gc --orphans`` removes them. Returns the (version, run)
    pairs given up, sorted."""
    given_up: list[tuple[int, str | None]] = []
    keys = store.list(DATA_PREFIX)  # grows with the data objects: for restarts, not publishes
    present = set(keys)
    for version, run in sorted(group_parts(keys, above=above), key=_by_version):
        if run == keep_run or abort_key(version, run) in present:
            continue  # this run's, or given up before (by its run, or an earlier restart)
        if store.exists(manifest_key(version)):
            continue
        write_abort(store, version, run, reason)
        given_up.append((version, run))
    if given_up:
        log.warning(
            "abandoned the uncommitted parts of %d versions (%s): %s",
            len(given_up),
            ", ".join(f"v{v} of run {r}" for v, r in given_up[:8]),
            reason,
        )
    return given_up


def _by_version(item: tuple[int, str | None]) -> tuple[int, str]:
    return item[0], item[1] or ""


__all__ = [
    "PART_KEY",
    "RUN_ABORT_KEY",
    "RUN_PREFIX",
    "RunRecord",
    "abandon_parts",
    "abort_key",
    "abort_reason",
    "check_run",
    "check_run_id",
    "current_run",
    "group_parts",
    "new_run_id",
    "newest_run",
    "part_key",
    "parts_prefix",
    "register_run",
    "run_key",
    "write_abort",
]
