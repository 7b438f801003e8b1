"""The chain reader: the one place that lists ``manifests/`` and reads manifests and ``LATEST``.

:class:`ChainReader` serves every reader of a store's chain: the :class:`~deltastore.Subscriber`
(``latest``, ``manifest``, planning a sync), ``deltastore verify`` and ``gc`` (:meth:`read_all`),
``log`` and ``show`` (:meth:`versions`, :meth:`manifest`) and the publishers' head checks
(:meth:`newest`, :meth:`versions_after`). Only manifests are read, never tensor data: this
module imports no torch.

A committed version is one whose manifest ``manifests/<version:020d>.json`` exists; other keys
under ``manifests/`` are not versions (format v1, section 3.2). ``LATEST`` is only a hint: a
committed manifest may be newer than it, and one that names another SHA-256 than its
manifest's is ignored (with a possible-fork warning).

Planning (:meth:`ChainReader.plan`) goes back along parent links from the target to the
version the receiver holds, or to the first anchor met. When the held state does not fit that
chain (the delta after it applies to another state of that version, the chain skips it, or the
store's manifest of the held version has another state: e.g. after two publishers raced on a
store without enforced preconditions), the plan goes on back to the newest anchor at or below
the target instead, and says why. It fails only when no such anchor can be reached
(:class:`ChainError`, or :class:`WrongParentError` when a delta's parent is not the state the
store holds for that version); the error then describes the store's chain. Whether a delta
fits a state is :mod:`deltastore.format.chain`'s rule.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, cast

from deltastore.errors import (
    ChainError,
    DeltastoreError,
    ManifestError,
    ManifestNotFoundError,
    ObjectNotFoundError,
    WrongParentError,
)
from deltastore.format.chain import State
from deltastore.format.keys import (
    ANCHOR_PREFIX,
    LATEST_KEY,
    MANIFEST_PREFIX,
    anchor_key,
    manifest_key,
    version_of_anchor_key,
    version_of_key,
)
from deltastore.format.manifest import Manifest, parse_latest, parse_manifest
from deltastore.format.signing import SignatureError, Verifier, verify_manifest
from deltastore.store import Store
from deltastore.store.counting import concurrently

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Damaged:
    """A listed manifest (or ``LATEST``) that cannot be used. ``version``: the version its key
    names (None for a damaged ``LATEST``); ``message``: what is wrong, without the key;
    ``error``: the error a strict reader raises for it."""

    version: int | None
    key: str
    message: str
    error: DeltastoreError


@dataclass(frozen=True)
class Chain:
    """What :meth:`ChainReader.read_all` read: every ``listed`` version, the ``manifests``
    that parse, validate, pass the signature check and name their own version, and the
    SHA-256 (hex) of each one's bytes. The containers belong to the caller."""

    listed: set[int]
    manifests: dict[int, Manifest]
    sha256: dict[int, str]
    #: The anchor copies that parse, validate, pass the signature check, name their own
    #: version and are anchors (``anchors/``; spec section 9.4), by version.
    copies: dict[int, Manifest] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """The versions to apply to reach a target, oldest first (``steps``; empty: the held
    state is the target's), and why the held state did not fit the chain (``why``; None: it
    did, or there is none).

    ``path``: ``"deltas"`` (from the held version), ``"anchor"`` (from an anchor: the first
    step; an anchor copy or an anchor version), ``"none"`` (nothing to apply). ``path_bytes``:
    the stored bytes of the steps; ``other_bytes``: those of the path not taken (from the held
    version when an anchor was taken, or from the newest anchor when deltas were), None when
    there was no other path or it was not priced."""

    steps: tuple[Manifest, ...]
    why: str | None
    path: Literal["none", "deltas", "anchor"] = "none"
    path_bytes: int = 0
    other_bytes: int | None = None
    #: The version whose anchor copy (``anchors/``) is the first step; None: the first step
    #: is no copy. When the copy's frames fail, the reader plans again without it
    #: (:meth:`ChainReader.reject_copy`; spec section 9.4).
    copy: int | None = None


class ChainReader:
    """Reads the chain of the store ``store``: versions, ``LATEST``, manifests, plans.

    Every manifest read is parsed and validated (format v1), checked against ``keys`` (when
    any: it must be signed with one of them for its own version, :class:`SignatureError`)
    and checked to name the version of its key (:class:`ManifestError`). :meth:`manifest`
    keeps the ``cache`` most recently read manifests (manifests are immutable; a stale one,
    after a publisher race, is dropped by :meth:`forget`). :meth:`latest` remembers the
    newest version seen and the last ``LATEST`` read (by its bytes).

    Requests, and which of them overlap (docs/stores.md, Requests per operation):
    :meth:`latest` is one listing of the manifest keys after the newest version seen;
    :meth:`discover` adds the listing of anchor copies in parallel; :meth:`plan` reads the
    manifests it needs (the listed versions up to the target, and the newest copy) in parallel
    before it walks, so a plan over k listed versions costs one round trip, not k.

    Not thread-safe: one thread uses a reader at a time (its parallel requests run on threads
    of its own, for the length of the call; nothing runs in the background). Constructing one
    costs no store request.
    """

    def __init__(self, store: Store, *, keys: Sequence[Verifier] = (), cache: int = 32) -> None:
        if cache < 0:
            raise ValueError(f"cache must be 0 or more, got {cache!r}")
        self.store = store
        self._keys = tuple(keys)
        self._size = cache
        self._cache: OrderedDict[int, Manifest] = OrderedDict()
        self._copies: dict[int, Manifest] = {}  # anchor copies read, oldest first
        self._rejected: dict[int, str] = {}  # copies whose frames failed: never used again
        self._seen: int | None = None  # newest committed version seen (listed or noted)
        self._known: set[int] = set()  # committed versions listed (above the first floor)
        self._floor = -1  # plan(): versions at or below it are not read ahead
        self._hint: tuple[bytes, int | None] = (b"", None)  # LATEST's bytes, the version used

    # --- listing ------------------------------------------------------------------------

    def versions(self) -> list[int]:
        """Every committed version, ascending (one listing of ``manifests/``)."""
        return self.versions_after(None)

    def versions_after(self, version: int | None) -> list[int]:
        """The committed versions above ``version`` (None: all), ascending (one listing of
        the manifest keys after ``version``'s)."""
        keys = (
            self.store.list(MANIFEST_PREFIX)
            if version is None
            else self.store.list_after(MANIFEST_PREFIX, manifest_key(version))
        )
        return sorted(v for k in keys if (v := version_of_key(k)) is not None)

    def anchor_versions(self) -> list[int]:
        """The versions that have an anchor copy (``anchors/``), ascending (one listing)."""
        keys = self.store.list(ANCHOR_PREFIX)
        return sorted(v for k in keys if (v := version_of_anchor_key(k)) is not None)

    def anchor_copy(self, version: int) -> Manifest:
        """The checked anchor copy of ``version`` (cached): parsed, validated, signed as
        required, naming ``version`` and of kind ``anchor``. :class:`ManifestNotFoundError`
        when there is none; :class:`ManifestError` / :class:`SignatureError` when damaged."""
        cached = self._copies.get(version)
        if cached is not None:
            return cached
        key = anchor_key(version)
        try:
            data = self.store.get(key)
        except ObjectNotFoundError:
            raise ManifestNotFoundError(
                f"version {version} has no anchor copy in store {self.store.url}"
            ) from None
        return self._keep_copy(version, self.check_copy(version, data))

    def _keep_copy(self, version: int, m: Manifest) -> Manifest:
        self._copies[version] = m
        while len(self._copies) > self._size:
            self._copies.pop(next(iter(self._copies)))
        return m

    def check_copy(self, version: int, data: bytes) -> Manifest:
        """The anchor copy of ``version`` from its bytes: parsed, validated, signed as
        required, naming ``version`` and of kind ``anchor`` (:class:`ManifestError` /
        :class:`SignatureError` otherwise). Not cached."""
        key = anchor_key(version)
        m = parse_manifest(data, key=key)
        verify_manifest(m, self._keys, version=version, name=key)
        if m.version != version:
            raise ManifestError(f"{key} claims version {m.version}; the store is damaged")
        if m.kind != "anchor":
            raise ManifestError(f"{key} is a {m.kind}, not an anchor; the store is damaged")
        return m

    def newest(self) -> int | None:
        """The store's newest committed version by listing every manifest (``LATEST`` is not
        read), or None when it has none: what a publisher's head check needs."""
        return max(self.versions(), default=None)

    def note(self, version: int) -> None:
        """Take ``version`` as committed (e.g. the version a receiver was handed tensors
        at): :meth:`latest` then lists only after it."""
        self._seen = max(version, self._seen if self._seen is not None else version)

    def latest(self) -> int | None:
        """Newest committed version, or None when the store has none.

        A poll is one request: a listing of the manifest keys after the newest version seen
        (committed manifests, not ``LATEST``, decide). A reader that has seen none reads
        ``LATEST`` first, as a hint (its manifest must exist with the SHA-256 it names,
        else it is ignored), and lists after it instead of listing every manifest. On a
        store whose listings may lag (:attr:`Store.consistent_listing` False: a local folder,
        maybe on NFS) every poll reads ``LATEST`` too (its manifest only when it changed).
        """
        floor = self._seen
        if floor is None or not self.store.consistent_listing:
            hint = self._latest_hint()
            floor = max((v for v in (hint, floor) if v is not None), default=None)
        listed = self.versions_after(floor)
        self._known.update(listed)
        if len(self._known) > 4 * max(self._size, 1024):  # a reader that never plans
            self._known = set(sorted(self._known)[-max(self._size, 1024) :])
        self._seen = max(listed, default=floor)
        return self._seen

    def discover(self, held: int | None) -> tuple[int | None, set[int]]:
        """For a sync to the newest version: :meth:`latest` and the versions above ``held``
        (None: all) that have an anchor copy, listed in parallel (one round trip)."""
        newest, copies = concurrently([self.latest, partial(self.copies_after, held)])
        return cast("int | None", newest), cast("set[int]", copies)

    def copies_after(self, held: int | None) -> set[int]:
        """The versions above ``held`` (all when None) that have an anchor copy (one
        listing)."""
        if held is None:
            return set(self.anchor_versions())
        keys = self.store.list_after(ANCHOR_PREFIX, anchor_key(held))
        return {v for k in keys if (v := version_of_anchor_key(k)) is not None}

    def _latest_hint(self) -> int | None:
        """The version ``LATEST`` names, when it is usable (two requests: ``LATEST`` and
        the manifest it names, kept in the cache); warns when it names another SHA-256
        than its manifest's (a possible fork)."""
        try:
            data = self.store.get(LATEST_KEY)
            if data == self._hint[0]:  # as read last time: checked then
                return self._hint[1]
            hint = parse_latest(data)
            body = self.store.get(manifest_key(hint.version))
        except ObjectNotFoundError:
            return None
        except DeltastoreError as exc:
            log.info("LATEST hint unusable (%s); listing manifests", exc)
            return None
        self._hint = (data, None)  # warned (or kept) once for these bytes
        if hashlib.sha256(body).hexdigest() != hint.sha256:
            log.warning(
                "possible fork: two publishers may have committed version %d of store %s "
                "(LATEST names another SHA-256 than its manifest's); LATEST ignored: stop all "
                "publishers but one and run `deltastore verify`",
                hint.version,
                self.store.url,
            )
            return None
        try:
            self.take_manifest(hint.version, body)
        except DeltastoreError as exc:
            log.warning("LATEST names a damaged manifest (%s); ignored", exc)
            return None
        self._hint = (data, hint.version)
        return hint.version

    # --- manifests ----------------------------------------------------------------------

    def manifest(self, version: int) -> Manifest:
        """The checked manifest of ``version`` (cached). :class:`ManifestNotFoundError` when
        it is not committed; :class:`ManifestError` / :class:`SignatureError` when it is
        damaged, not signed as required, or names another version."""
        cached = self._cache.get(version)
        if cached is not None:
            return cached
        key = manifest_key(version)
        try:
            data = self.store.get(key)
        except ObjectNotFoundError:
            raise ManifestNotFoundError(
                f"version {version} is not committed in store {self.store.url}"
            ) from None
        return self.take_manifest(version, data)

    def forget(self, version: int | None) -> None:
        """Drop the cached manifest of ``version`` (it is not the store's any more: a
        publisher race), or every cached one (None: the store changed under the reader)."""
        if version is None:
            self._cache.clear()
            self._copies.clear()
        else:
            self._cache.pop(version, None)
            self._copies.pop(version, None)

    def take_manifest(self, version: int, data: bytes) -> Manifest:
        """Check the manifest bytes of ``version`` (parse, validate, signature, the version it
        names: as :meth:`manifest` does with what it reads) and keep the result in the cache;
        for bytes read elsewhere (a mirror copies them as they are)."""
        m = self._parse(version, data)
        if m.version != version:
            raise _claims(version, m)
        self._cache[version] = m
        while len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return m

    def _parse(self, version: int, data: bytes) -> Manifest:
        """Parse, validate and check the signature (before any frame is fetched)."""
        key = manifest_key(version)
        m = parse_manifest(data, key=key)
        verify_manifest(m, self._keys, version=version, name=key)
        return m

    def read_all(
        self, on_damaged: Callable[[Damaged], object], *, skip: Collection[int] = ()
    ) -> Chain:
        """Read every listed manifest (not cached), in version order, except those of the
        versions in ``skip`` (listed, not read). Each one that is gone when read, does not
        parse or validate, fails the signature check or names another version is reported
        to ``on_damaged`` (which may raise to stop the reading) and left out. Store errors
        other than a missing object are raised."""
        listed = set(self.versions())
        manifests: dict[int, Manifest] = {}
        sha256: dict[int, str] = {}
        for v in sorted(listed.difference(skip)):
            key = manifest_key(v)
            try:
                data = self.store.get(key)
            except ObjectNotFoundError as exc:
                on_damaged(Damaged(v, key, "listed, but gone when read", exc))
                continue
            try:
                m = self._parse(v, data)
            except (ManifestError, SignatureError) as exc:
                on_damaged(Damaged(v, key, str(exc), exc))
                continue
            if m.version != v:
                on_damaged(Damaged(v, key, f"claims version {m.version}", _claims(v, m)))
                continue
            manifests[v], sha256[v] = m, hashlib.sha256(data).hexdigest()
        copies: dict[int, Manifest] = {}
        for v in self.anchor_versions():
            key = anchor_key(v)
            try:
                copies[v] = self.check_copy(v, self.store.get(key))
            except ObjectNotFoundError as exc:
                on_damaged(Damaged(v, key, "listed, but gone when read", exc))
            except (ManifestError, SignatureError) as exc:
                on_damaged(Damaged(v, key, str(exc), exc))
        return Chain(listed, manifests, sha256, copies)

    def check_latest(self, chain: Chain) -> Damaged | None:
        """What is wrong with ``LATEST`` given the manifests ``chain`` read (None: nothing,
        or there is no ``LATEST``, which is only a hint): it does not parse, names a version
        that is missing or damaged, or names another SHA-256 than its manifest's (a possible
        fork: two publishers may have committed that version)."""
        try:
            data = self.store.get(LATEST_KEY)
        except ObjectNotFoundError:
            return None
        try:
            hint = parse_latest(data)
        except ManifestError as exc:
            return Damaged(None, LATEST_KEY, str(exc), exc)
        if hint.version not in chain.manifests or hint.manifest != manifest_key(hint.version):
            message = f"names {hint.manifest}, not a good manifest"
        elif chain.sha256[hint.version] != hint.sha256:
            message = (
                f"names version {hint.version} with another SHA-256 than its manifest's "
                "(possible fork: two publishers may have committed this version)"
            )
        else:
            return None
        return Damaged(hint.version, LATEST_KEY, message, ManifestError(f"LATEST {message}"))

    # --- planning -----------------------------------------------------------------------

    def plan(self, target: int, held: State | None, *, copies: set[int] | None = None) -> Plan:
        """The cheapest versions to apply to go from the ``held`` state (None: none, start
        from an anchor) to ``target`` (see the module docstring), by stored bytes: the deltas
        from the held version, or the newest anchor on the target's chain (an anchor copy,
        ``anchors/``, or an anchor version) and the deltas after it, whichever is smaller. A
        one-version step from the held version is taken as is (no anchor is looked for).

        Reads manifests through the cache; when the held state turns out not to fit the
        chain, the cache is dropped (the store changed under the reader) and the plan goes
        back to the newest anchor at or below ``target``; likewise when versions between the
        held one and the target were deleted (retention), or a manifest there is damaged, and
        a usable copy above them was met (spec section 10.1: the copy, never the damaged
        version's own copy). Copies dropped by :meth:`reject_copy` are not used.
        :class:`ManifestNotFoundError` when ``target`` is not committed.

        ``copies``: the versions with an anchor copy as :meth:`discover` listed them (those
        above the held version; all of them without one); None: listed here when needed.
        What the walk will read is read in parallel first (:meth:`_read_ahead`)."""
        self._floor = -1 if held is None else held.version
        if copies is not None and self._rejected:
            copies = copies.difference(self._rejected)
        copies = self._read_ahead(target, held, copies)
        if copies is not None and self._rejected:
            copies = copies.difference(self._rejected)
        m = self.manifest(target)
        why: str | None = None
        if held is not None and target == held.version:
            if m.state_digest == held.digest:
                return Plan((), None)
            why = f"version {target} in the store is another state than the held version {target}"
            held = None
            self.forget(None)
        if held is not None and m.kind == "delta" and held.fits(m):
            return Plan((m,), None, "deltas", m.payload_bytes)
        if copies is None:
            copies = set(self.anchor_versions()).difference(self._rejected)
        walked: list[Manifest] = []  # from the target down
        copy: tuple[int, Manifest] | None = None  # (index in walked, the newest copy on the chain)
        reached = False  # the walk reached the held version
        while True:
            walked.append(m)
            if m.kind == "anchor":
                break
            if copy is None and m.version in copies and (held is None or m.version > held.version):
                found = self.usable_copy(m)
                if found is not None:
                    copy = (len(walked) - 1, found)
                    if held is None:
                        break
            if m.parent is None:  # pragma: no cover - a delta always has a parent (validated)
                raise ManifestError(f"delta {m.version} has no parent")
            if held is not None and m.parent.version <= held.version:
                if held.fits(m):
                    reached = True
                    break
                why = (
                    f"version {m.version} is a delta on another state of version {held.version} "
                    f"than the held version {held.version}"
                    if m.parent.version == held.version
                    else f"version {m.version} descends from {m.parent.version}, not from the "
                    f"held version {held.version}"
                )
                held = None
                self.forget(None)
                if copy is not None:
                    break
            if copy is not None and held is not None:
                i, c = copy
                if _bytes(walked) > c.payload_bytes + _bytes(walked[:i]):
                    break  # the deltas below cost more than the copy already
            try:
                m = self._parent(target, m, why)
            except (ChainError, WrongParentError, ManifestError, SignatureError) as exc:
                # below a usable copy the chain is gone (retention) or damaged: the target
                # is reached from the copy, not through the damage (spec section 10.1)
                if copy is None:
                    raise
                gone = m.parent.version if m.parent is not None else m.version
                if isinstance(exc, (ManifestError, SignatureError)):
                    log.warning(
                        "store %s: the manifest of version %d is damaged (%s); starting from "
                        "the anchor copy of version %d above it",
                        self.store.url,
                        gone,
                        exc,
                        copy[1].version,
                    )
                why = why or (
                    f"version {gone} on the way from the held version to {target} is "
                    + (
                        "damaged"
                        if isinstance(exc, (ManifestError, SignatureError))
                        else "not in the store any more (deleted by retention?)"
                    )
                )
                held = None
                break
        deltas = _bytes(walked) if reached else None
        via_copy = None if copy is None else copy[1].payload_bytes + _bytes(walked[: copy[0]])
        if copy is not None and via_copy is not None and (deltas is None or via_copy < deltas):
            i, c = copy
            other = deltas if reached else _bytes(walked) if walked[-1].kind == "anchor" else None
            return Plan((c, *reversed(walked[:i])), why, "anchor", via_copy, other, c.version)
        walked.reverse()
        return Plan(tuple(walked), why, "deltas" if reached else "anchor", _bytes(walked), via_copy)

    def _read_ahead(
        self, target: int, held: State | None, copies: set[int] | None
    ) -> set[int] | None:
        """Read in parallel, in one round trip, what a plan from ``held`` to ``target`` asks
        for: the manifests of ``target`` and of the listed versions below it down to the held
        one (newest first, at most the cache's size, those not cached; a reader without
        state: down to the newest copy) and, with more than one version to go, the list of
        anchor copies (when ``copies`` is None) or the newest copy among them. Returns the
        copies (listed here, or ``copies``). A read that fails is left to the plan, which
        reads again and reports it."""
        low = self._floor
        if held is None and copies:
            low = max((c for c in copies if c <= target), default=low + 1) - 1
        span = sorted({target} | {v for v in self._known if low < v <= target})
        many = len(span) > 1 or held is None
        extra: Callable[[], object] | None = None
        copy: int | None = None
        if many and copies is None:
            extra = partial(self.copies_after, None if held is None else held.version)
        elif many and copies:
            copy = max((c for c in copies if low < c <= target), default=None)
            if copy is not None and copy not in self._copies:
                extra = partial(self._read_quietly, anchor_key(copy))
        got = self._read_manifests(span, extra)
        if many and copies is None:
            return got if isinstance(got, set) else None
        if copy is not None and isinstance(got, bytes):
            with contextlib.suppress(DeltastoreError):
                self._keep_copy(copy, self.check_copy(copy, got))
        return copies

    def _read_manifests(
        self, versions: Sequence[int], extra: Callable[[], object] | None = None
    ) -> object:
        """Read the manifests of the newest ``versions`` (ascending) that are not cached, at
        most the cache's size, together with ``extra`` (another request), in parallel; keep
        those that check out in the cache. Returns what ``extra`` returned. Nothing is read
        when only one request would be made (the caller reads it when it needs it)."""
        want = [v for v in reversed(versions) if v not in self._cache][: self._size]
        reads: list[Callable[[], object]] = [
            partial(self._read_quietly, manifest_key(v)) for v in want
        ]
        if extra is not None:
            reads.append(extra)
        if len(reads) < 2:
            return None
        got = concurrently(reads)
        for v, data in zip(reversed(want), reversed(got[: len(want)]), strict=True):
            if isinstance(data, bytes):  # oldest first: the newest stay longest in the cache
                with contextlib.suppress(DeltastoreError):
                    self.take_manifest(v, data)
        return got[-1] if extra is not None else None

    def _read_quietly(self, key: str) -> bytes | None:
        """The object ``key``, or None when it cannot be read (a read ahead)."""
        try:
            return self.store.get(key)
        except DeltastoreError as exc:
            log.debug("read ahead of %s failed (%s)", key, exc)
            return None

    def usable_copy(self, m: Manifest) -> Manifest | None:
        """The anchor copy of ``m``'s version when it is usable (spec section 9.4): ``m`` is
        the version's committed manifest, read and checked (a damaged manifest has no usable
        copy), and the copy holds ``m``'s state, has no ``parent`` and was not rejected by
        :meth:`reject_copy`. None otherwise (absent, damaged, of another state, with a parent,
        or rejected; logged); other store errors are raised."""
        if m.version in self._rejected:
            log.debug("anchor copy of version %d rejected before; ignored", m.version)
            return None
        try:
            c = self.anchor_copy(m.version)
        except (ObjectNotFoundError, ManifestError, SignatureError) as exc:
            log.warning("anchor copy of version %d unusable (%s); ignored", m.version, exc)
            return None
        if c.state_digest != m.state_digest:
            log.warning(
                "anchor copy of version %d holds another state than its manifest; ignored",
                m.version,
            )
            return None
        if c.parent is not None:
            log.warning(
                "anchor copy of version %d has a parent (version %d; a copy has none); ignored",
                m.version,
                c.parent.version,
            )
            return None
        return c

    def reject_copy(self, version: int, reason: BaseException | str) -> None:
        """Never use the anchor copy of ``version`` again: its frames failed (a data object
        missing, an XXH3-64 or Adler-32 mismatch, a frame that does not decode). Logs a
        warning naming the copy; the next :meth:`plan` goes without it (spec section 9.4)."""
        self._rejected[version] = str(reason)
        self._copies.pop(version, None)
        log.warning(
            "store %s: anchor copy %s failed (%s); not used again, falling back to the chain",
            self.store.url,
            anchor_key(version),
            reason,
        )

    def _parent(self, target: int, child: Manifest, why: str | None) -> Manifest:
        """The manifest ``child`` is a delta on, checked to be the state ``child`` names."""
        if child.parent is None:  # pragma: no cover - checked by the caller
            raise ManifestError(f"delta {child.version} has no parent")
        version, digest = child.parent.version, child.parent.state_digest
        url = self.store.url
        because = f"store {url}: {why}, and" if why else f"store {url}:"
        if version not in self._cache:  # past the read ahead: the next listed ones at once
            self._read_manifests(sorted(v for v in self._known if self._floor < v <= version))
        try:
            parent = self.manifest(version)
            if parent.state_digest != digest:  # a cached manifest may be stale: read it again
                self.forget(version)
                parent = self.manifest(version)
        except ManifestNotFoundError:
            raise ChainError(
                f"{because} no anchor at or below {target} can be reached (version {version}, "
                f"parent of {child.version}, is missing): publish an anchor"
            ) from None
        if parent.state_digest != digest:
            raise WrongParentError(
                f"{because} no anchor at or below {target} can be reached (version "
                f"{child.version} is a delta on a state of version {version} that the store "
                "does not hold: two publishers raced?): publish an anchor"
            )
        return parent


def _bytes(manifests: Sequence[Manifest]) -> int:
    """Stored bytes of the frames of ``manifests``."""
    return sum(m.payload_bytes for m in manifests)


def _claims(version: int, m: Manifest) -> ManifestError:
    return ManifestError(
        f"{manifest_key(version)} claims version {m.version}; the store is damaged"
    )


__all__ = ["Chain", "ChainReader", "Damaged", "Plan"]
