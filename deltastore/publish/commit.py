"""The commit protocol (spec section 4.2) of :class:`~deltastore.publish.publisher.Publisher`
and of the sharded writers' coordinator (:func:`~deltastore.publish.parts.commit_parts`):
:func:`commit_version` is the one commit sequence both run once their data objects are stored
(the head check, creating the manifest: the commit point, the anchor copy, ``LATEST``); the
functions it is made of, the store's head and version numbers are here too. Functions are
stateless; each store call is one request."""

from __future__ import annotations

import enum
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import Literal, cast

from pydantic import ValidationError

from deltastore._version import __version__
from deltastore.catalog.chain import ChainReader
from deltastore.errors import (
    ChainError,
    DeltastoreError,
    ForkError,
    ManifestError,
    ObjectNotFoundError,
    PreconditionsIgnoredError,
    StoreError,
    VersionExistsError,
    VersionOrderError,
)
from deltastore.format.keys import (
    LATEST_KEY,
    MAX_VERSION,
    anchor_key,
    manifest_key,
)
from deltastore.format.manifest import (
    MAX_MANIFEST_BYTES,
    Latest,
    Manifest,
    Parent,
    TensorEntry,
    Writer,
    parse_latest,
    state_digest,
    validation_summary,
)
from deltastore.format.signing import Signer, sign_manifest
from deltastore.publish.policy import AnchorCosts
from deltastore.store import Store
from deltastore.store.counting import concurrently

log = logging.getLogger("deltastore.publish.publisher")


def head_version(store: Store) -> int | None:
    """The store's newest committed version (by listing ``manifests/``), or None."""
    return ChainReader(store).newest()


def stored_bytes(m: Manifest) -> int:
    """What a reader fetches for ``m``: its frames and its manifest (as serialized here)."""
    return m.payload_bytes + len(m.to_bytes())


def chain_costs(reader: ChainReader, version: int) -> AnchorCosts:
    """The anchor account of the chain that ends at ``version``: its manifests read back to
    the newest anchor version or anchor copy on it (``anchor`` None when the walk cannot get
    there: a version is missing or damaged). Other store errors are raised (before any
    upload of the publish that asks)."""
    copies = set(reader.anchor_versions())
    deltas: list[int] = []
    costs = AnchorCosts()
    v: int | None = version
    try:
        while v is not None:
            m = reader.manifest(v)
            copy = reader.usable_copy(m) if m.kind == "delta" and v in copies else None
            if copy is not None:
                costs.anchored(v, stored_bytes(copy), last_delta=stored_bytes(m))
                if deltas:
                    costs.last_delta = deltas[0]
                break
            if m.kind == "anchor":
                costs.anchored(v, stored_bytes(m))
                break
            deltas.append(stored_bytes(m))
            v = m.parent.version if m.parent is not None else None
    except (ObjectNotFoundError, ManifestError, ChainError) as exc:  # store errors propagate
        log.info("the chain below version %d has no anchor that can be read (%s)", version, exc)
        return AnchorCosts(last_delta=deltas[0] if deltas else 0)
    costs.delta_bytes, costs.deltas = sum(deltas), len(deltas)
    costs.last_delta = deltas[0] if deltas else costs.last_delta
    return costs


def check_version_number(version: object) -> None:
    """:class:`VersionOrderError` unless ``version`` is an integer in ``[0, MAX_VERSION]``."""
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise VersionOrderError(
            f"version must be an integer in [0, {MAX_VERSION}], got {version!r}"
        )


def commit_manifest(
    store: Store,
    *,
    version: int,
    kind: Literal["anchor", "delta"],
    parent: Parent | None,
    entries: dict[str, TensorEntry],
    token: str,
    signing_key: Signer | None = None,
) -> tuple[Manifest, bytes]:
    """Build the manifest of ``version`` (signed with ``signing_key`` when given) and create it
    with ``put_if_absent`` (the commit point); returns it and its bytes. Nothing is written
    when the model rejects it (``ValidationError``) or it is over the size readers accept
    (:class:`ManifestError`); :class:`VersionExistsError` when another writer committed the
    version first.

    When the create raises a :class:`StoreError` (a lost response; or a retry of the request
    that finds the first attempt's object), the manifest is read back: if it holds exactly
    these bytes, the version is committed by this writer and the call succeeds; otherwise
    the error is raised (the version is not this writer's; when even the read-back fails,
    whether it is committed is unknown: see docs/guide.md, Several publishers)."""
    manifest, body = build_manifest(
        version=version,
        kind=kind,
        parent=parent,
        entries=entries,
        token=token,
        signing_key=signing_key,
    )
    _create(store, manifest_key(version), body)
    return manifest, body


def build_manifest(
    *,
    version: int,
    kind: Literal["anchor", "delta"],
    parent: Parent | None,
    entries: dict[str, TensorEntry],
    token: str,
    signing_key: Signer | None = None,
) -> tuple[Manifest, bytes]:
    """The manifest of ``version`` (signed with ``signing_key`` when given) and its bytes;
    ``ValidationError`` when the model rejects it, :class:`ManifestError` when it is over the
    size readers accept."""
    manifest = Manifest(
        format_version=1,
        version=version,
        kind=kind,
        parent=parent,
        state_digest=state_digest((n, e.dtype, e.shape, e.adler32) for n, e in entries.items()),
        created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        writer=Writer(token=token, library=f"deltastore {__version__}"),
        tensors=entries,
    )
    if signing_key is not None:
        manifest = sign_manifest(manifest, signing_key)
    body = manifest.to_bytes()
    if len(body) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            f"the manifest would be {len(body)} bytes, over the {MAX_MANIFEST_BYTES} readers "
            "accept; raise max_frame_bytes to write fewer frames"
        )
    return manifest, body


def write_anchor_copy(
    store: Store,
    *,
    version: int,
    entries: dict[str, TensorEntry],
    token: str,
    signing_key: Signer | None = None,
) -> Manifest | None:
    """After ``version`` is committed: create its anchor copy ``anchors/<version>.json``
    (an anchor manifest of the same state, spec section 9.4) with ``put_if_absent``. As
    section 9.4 requires: ``parent`` null (``entries`` have no parent Adler-32s), ``writer``
    this writer's (``token``: the one that committed ``version`` and prefixes the copy's data
    objects), ``created`` the time the copy is built, never the manifest's. Best effort, like
    ``LATEST``: the version is committed either way; returns the copy, or None (logged) when
    it could not be written."""
    manifest, body = build_manifest(
        version=version,
        kind="anchor",
        parent=None,
        entries=entries,
        token=token,
        signing_key=signing_key,
    )
    try:
        _create(store, anchor_key(version), body)
    except DeltastoreError as exc:
        log.warning("version %d is committed but its anchor copy is not (%s)", version, exc)
        return None
    return manifest


def _create(store: Store, key: str, body: bytes) -> None:
    """Create ``key`` with ``body`` (``put_if_absent``). When the create raises a
    :class:`StoreError` (a lost response, or a retry that found its first attempt's object),
    the key is read back: holding exactly ``body`` (a writer's random token and a timestamp
    make it unique), it is this writer's and the call succeeds; otherwise the error is
    raised."""
    try:
        store.put_if_absent(key, body)
    except StoreError:
        if not _is_ours(store, key, body):
            raise
        log.info("%s: the create failed but the object is ours", key)


def _is_ours(store: Store, key: str, body: bytes) -> bool:
    try:
        return store.get(key) == body
    except ObjectNotFoundError:
        return False  # not committed
    except DeltastoreError as exc:
        log.warning("%s: commit state unknown, the manifest cannot be read back (%s)", key, exc)
        return False


def conditional_writes(store: Store, *, unsafe_commits: bool) -> bool:
    """Before any upload: whether ``store`` enforces create-if-absent (True), or ignores it
    and ``unsafe_commits`` (the writer's or the store's) accepts that (False: the commit must
    then be read back, see :func:`confirm_commit`). :class:`PreconditionsIgnoredError` when
    it ignores it and nothing accepts the risk."""
    try:
        return store.check_conditional_writes()
    except PreconditionsIgnoredError:
        if not unsafe_commits:
            raise
        return False


def confirm_commit(store: Store, version: int, body: bytes) -> None:
    """On a store that ignores preconditions: read the manifest of ``version`` back and raise
    :class:`ForkError` unless it holds exactly ``body`` (this writer's bytes: its random token
    and timestamp make them unique). Another publisher that wrote the same version meanwhile
    overwrote it, and readers may hold either manifest: the chain has forked."""
    key = manifest_key(version)
    try:
        ours = store.get(key) == body
    except ObjectNotFoundError:
        ours = False
    if not ours:
        raise ForkError(
            f"version {version} in store {store.url} is not this publisher's: another "
            "publisher wrote the same version at the same time (the store ignores "
            "conditional-write preconditions, and --unsafe-commits / unsafe_commits=True "
            "allows one publisher only). Stop the other publisher, check the store with "
            "`deltastore verify`, then publish a higher version as an anchor"
        )


def check_head(store: Store, version: int, parent: Parent | None) -> None:
    """Right before the commit: raise unless ``version`` would still extend the chain's head.

    Lists the manifests after ``parent`` (all of them for an anchor without a parent):
    :class:`VersionExistsError` when ``version`` is committed already,
    :class:`VersionOrderError` when a newer version is, :class:`ChainError` when another
    version was committed on ``parent`` (it is no longer the head). A version committed
    between this listing and the manifest create is not seen (docs/guide.md, Several
    publishers)."""
    newer = set(ChainReader(store).versions_after(parent.version if parent else None))
    if version in newer:
        raise VersionExistsError(
            f"version {version} was committed by another writer in store {store.url}"
        )
    if max(newer, default=-1) > version:
        raise VersionOrderError(
            f"version {max(newer)} was committed in store {store.url} while version {version} "
            "was being written; versions must increase strictly, nothing was committed"
        )
    if parent is not None and newer:
        raise ChainError(
            f"version {max(newer)} was committed on top of version {parent.version} while "
            f"version {version} was being written with it as parent; nothing was committed: "
            "attach() to the store again (CLI: --parent) or publish an anchor"
        )


class Unread(enum.Enum):
    """``LATEST`` was not read ahead (:func:`read_latest` failed, or nobody asked)."""

    UNREAD = 0


def read_latest(store: Store) -> tuple[bytes, str] | Unread | None:
    """``LATEST`` and its change token (None: there is none), read before the commit in
    parallel with :func:`check_head`, so that :func:`advance_latest` after the commit is one
    request; :attr:`Unread.UNREAD` when it cannot be read (advance_latest reads it again)."""
    try:
        return store.get_with_token(LATEST_KEY)
    except DeltastoreError as exc:
        log.debug("LATEST not read ahead (%s)", exc)
        return Unread.UNREAD


def advance_latest(
    store: Store,
    version: int,
    body: bytes,
    *,
    current: tuple[bytes, str] | Unread | None = Unread.UNREAD,
) -> None:
    """Move ``LATEST`` forward with compare-and-swap; never backwards. Best effort: the
    manifest is already committed and readers can always list ``manifests/``. ``current``:
    ``LATEST`` and its token as :func:`read_latest` read them (then the swap is one request
    when nobody moved it meanwhile)."""
    latest = Latest(
        format_version=1,
        version=version,
        manifest=manifest_key(version),
        sha256=hashlib.sha256(body).hexdigest(),
    )
    for _ in range(8):
        try:
            if isinstance(current, Unread):
                current = store.get_with_token(LATEST_KEY)
            if current is not None:
                try:
                    if parse_latest(current[0]).version >= version:
                        return
                except DeltastoreError:
                    pass  # a damaged hint is simply replaced
            store.put_if_match(
                LATEST_KEY, latest.model_dump_json().encode(), current[1] if current else None
            )
            return
        except DeltastoreError as exc:
            log.debug("LATEST update retry after %s", exc)
            current = Unread.UNREAD
    log.warning("version %d is committed but LATEST could not be advanced", version)


@dataclass(frozen=True)
class Committed:
    """What :func:`commit_version` committed: the manifest, its bytes (what ``LATEST``'s
    SHA-256 names) and the anchor copy written beside it (None: none asked for, or it could
    not be written)."""

    manifest: Manifest
    body: bytes
    copy: Manifest | None = None

    @property
    def stored_bytes(self) -> int:
        """:func:`stored_bytes` of the manifest, from the bytes committed (no serializing)."""
        return self.manifest.payload_bytes + len(self.body)


def commit_version(
    store: Store,
    *,
    version: int,
    kind: Literal["anchor", "delta"],
    parent: Parent | None,
    entries: dict[str, TensorEntry],
    token: str,
    signing_key: Signer | None,
    enforced: bool,
    check: Callable[[], object],
    copy_entries: dict[str, TensorEntry] | None = None,
    abort: Callable[[DeltastoreError], object] | None = None,
) -> Committed:
    """The commit sequence, run once every data object of ``version`` is stored (spec
    section 4.2; docs/design/architecture.md, Publish): the one implementation of the
    publisher and of the sharded writers' coordinator.

    1. One round trip: ``check()``, which raises unless ``version`` can still be committed
       (the publisher's :func:`check_head`; the coordinator's own check), and ``LATEST`` read
       ahead with its change token (:func:`read_latest`).
    2. The manifest, signed with ``signing_key`` when given, created with ``put_if_absent``
       (:func:`commit_manifest`): the commit point.
    3. On a store that does not enforce create-if-absent (``enforced`` False, see
       :func:`conditional_writes`): the manifest read back (:func:`confirm_commit`).
    4. One round trip: ``LATEST`` advanced by compare-and-swap (:func:`advance_latest`) and,
       given ``copy_entries``, the anchor copy (:func:`write_anchor_copy`); both best effort.
    5. Not ``enforced``: the manifest read back again.

    Errors of steps 1 and 2 mean nothing was committed: they are raised after ``abort(error)``
    (when given), except :class:`VersionExistsError` (the version is another writer's, there
    is nothing to give up); a manifest the model rejects raises :class:`ManifestError`.
    :class:`ForkError` from steps 3 and 5: the version was committed, but not only by this
    writer."""
    try:
        concurrent = concurrently([check, partial(read_latest, store)])
        current = cast("tuple[bytes, str] | Unread | None", concurrent[1])
        manifest, body = commit_manifest(
            store,
            version=version,
            kind=kind,
            parent=parent,
            entries=entries,
            token=token,
            signing_key=signing_key,
        )
    except VersionExistsError:
        raise
    except ValidationError as exc:
        error = ManifestError(f"version {version}: {validation_summary(exc)}")
        if abort is not None:
            abort(error)
        raise error from None
    except DeltastoreError as exc:
        if abort is not None:
            abort(exc)
        raise
    if not enforced:  # nothing stopped a second writer: read back, before and after
        confirm_commit(store, version, body)
    after: list[Callable[[], object]] = [
        partial(advance_latest, store, version, body, current=current)
    ]
    if copy_entries is not None:
        after.append(
            partial(
                write_anchor_copy,
                store,
                version=version,
                entries=copy_entries,
                token=token,
                signing_key=signing_key,
            )
        )
    done = concurrently(after)
    copy = cast("Manifest | None", done[1]) if len(done) > 1 else None
    if not enforced:
        confirm_commit(store, version, body)
    return Committed(manifest, body, copy)


def replicate_version(
    store: Store, version: int, body: bytes, copy_body: bytes | None, *, enforced: bool
) -> None:
    """Commit in ``store`` a version another store committed (a mirror), its data objects
    already written: the anchor copy (``copy_body``, when given), then the manifest ``body``,
    each created if absent with exactly those bytes, then ``LATEST``. An existing object with
    other bytes is a :class:`ForkError`; one with the same bytes (another mirror's, or a run
    stopped after its create) is this commit. ``enforced``: whether ``store`` enforces
    create-if-absent (:func:`conditional_writes`); if not, each create is read back."""
    if copy_body is not None:
        _replicate(store, anchor_key(version), copy_body, enforced)
    _replicate(store, manifest_key(version), body, enforced)
    advance_latest(store, version, body)


def _replicate(store: Store, key: str, body: bytes, enforced: bool) -> None:
    try:
        store.put_if_absent(key, body)
    except StoreError as exc:
        try:
            existing = store.get(key)
        except ObjectNotFoundError:
            raise exc from None
        if existing == body:
            return
        if not isinstance(exc, VersionExistsError):
            raise
        raise ForkError(
            f"{key} in store {store.url} holds other bytes than the source's: the store is "
            "written by someone else (a publisher, or a mirror of another source); mirror "
            "into a store of its own"
        ) from None
    if not enforced and store.get(key) != body:
        raise ForkError(f"{key} in store {store.url} was overwritten by another writer")


__all__ = [
    "Committed",
    "Unread",
    "advance_latest",
    "build_manifest",
    "chain_costs",
    "check_head",
    "check_version_number",
    "commit_manifest",
    "commit_version",
    "conditional_writes",
    "confirm_commit",
    "head_version",
    "read_latest",
    "replicate_version",
    "stored_bytes",
    "write_anchor_copy",
]
