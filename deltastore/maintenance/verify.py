"""Check a store, or a pulled checkpoint folder, for damage (``deltastore verify``).

:func:`verify_store` reads every manifest under ``manifests/`` and checks, without decoding:

- each manifest parses and validates (format v1, section 6) and names its own version;
- with ``keys`` (trusted keys: by default those of ``DELTASTORE_TRUSTED_KEYS`` and
  ``DELTASTORE_SIGNING_KEY``, :func:`~deltastore.format.signing.resolve_trust`), each manifest
  and each anchor copy is signed by one of them for its own version (format v1, section 6.7):
  an unsigned, unknown-key, forged, modified or replayed one is a ``signature`` problem, and
  left out like a damaged manifest;
- each frame's object exists, holds ``length`` bytes at ``offset``, and those bytes have the
  frame's XXH3-64 and, when the frame records one (Ed25519-signed manifests), its BLAKE3
  (frames are read with ``get_range``, one at a time per worker thread);
- each delta's parent manifest exists, with the ``state_digest``, tensor table and per-tensor
  Adler-32 the delta names; and each version's chain reaches an anchor;
- ``LATEST``, when present, names a committed version with the SHA-256 of its manifest.

Every anchor copy under ``anchors/`` (format v1 section 9.4) is read too: it must validate, be
of a committed version and hold its state, and its frames are read and checked like a
manifest's (existence, length, XXH3-64, BLAKE3).

With ``deep=True`` it also replays the chains in memory, one tensor at a time (memory: the
largest tensor plus one frame, whatever the model size), decoding every frame and checking
every frame's and every version's per-tensor Adler-32: this finds frames that are valid zstd
with a matching hash but the wrong content (a broken writer), which the fast pass cannot. Each
anchor copy is replayed as well, on its own after the chains (the same memory bound): its
frames' and tensors' Adler-32 must be its version's, even where the chain below it is intact
(a fresh reader starts from the copy). A damaged copy's problems name the copy's key.

:func:`verify_checkout` checks a folder written by ``deltastore pull`` against its sidecar's
version: the Adler-32 of every tensor, and with a store, the sidecar against that manifest.

Both return a :class:`VerifyReport` listing each :class:`Problem` (``kind``, ``version``,
``key``, ``message``); nothing is changed anywhere. Thread-safety: each call is independent
(its worker threads are its own).
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import xxhash

from deltastore.catalog.chain import Chain, ChainReader, Damaged
from deltastore.checkpoint.safetensors import CheckpointError, MappedCheckpoint, locate, table_of
from deltastore.errors import ObjectNotFoundError, SignatureError
from deltastore.format import chain as link
from deltastore.format.ed25519 import frame_digest
from deltastore.format.keys import DATA_PREFIX, anchor_key, manifest_key
from deltastore.format.manifest import Frame, Manifest
from deltastore.format.signing import FROM_ENV, TrustOption, Verifier, resolve_trust
from deltastore.maintenance.replay import ADLER32, FRAME, Replay, copy_hint
from deltastore.progress import ProgressFn, Ticker
from deltastore.store import Store, open_store

# --- problem kinds -------------------------------------------------------------------------
#: A manifest that does not parse or validate, or claims another version than its key.
MANIFEST: Final = "manifest"
#: A data object a frame names does not exist.
MISSING_OBJECT: Final = "missing-object"
#: A data object is shorter than a frame's ``offset + length``.
TRUNCATED: Final = "truncated"
#: A manifest or anchor copy is not signed by a trusted key for its own version (unsigned,
#: unknown key id, another algorithm than the key's, modified, or replayed).
SIGNATURE: Final = "signature"
#: A frame's stored bytes do not have its XXH3-64.
XXH3: Final = "xxh3"
#: A frame's stored bytes do not have the BLAKE3 its (Ed25519-signed) manifest records.
BLAKE3: Final = "blake3"
#: A delta's parent manifest is not in the store.
MISSING_PARENT: Final = "missing-parent"
#: A version's ``parent.state_digest`` is not its parent's ``state_digest``.
PARENT_DIGEST: Final = link.PARENT_DIGEST
#: A delta names other tensors (names, dtypes, shapes) than its parent.
PARENT_TABLE: Final = link.PARENT_TABLE
#: A tensor's ``parent_adler32`` is not the parent's ``adler32`` of that tensor.
PARENT_ADLER32: Final = link.PARENT_ADLER32
#: A version cannot be reached from an anchor: its chain breaks further up.
CHAIN: Final = "chain"
#: ``LATEST`` is damaged, or names a version that is missing or has other bytes.
LATEST: Final = "latest"
# FRAME (deep: a frame does not decode, or changes another number of elements than it says)
# and ADLER32 (deep, checkout: bytes whose Adler-32 is not the manifest's or the sidecar's)
# come from deltastore.maintenance.replay.
#: (checkout) The folder holds other tensors, dtypes or shapes than its version.
TABLE: Final = "table"
#: (checkout) The sidecar disagrees with its version's manifest.
SIDECAR_MISMATCH: Final = "sidecar"

Mode = Literal["store", "deep", "checkout"]


@dataclass(frozen=True)
class Problem:
    """One thing found wrong. ``key``: the store key (manifest or data object), or for a
    checkout the tensor's file; ``tensor``: the tensor concerned, if one is."""

    kind: str
    version: int | None
    key: str | None
    message: str
    tensor: str | None = None

    def line(self) -> str:
        where = " ".join(
            x for x in (f"v{self.version}" if self.version is not None else "", self.key or "") if x
        )
        return f"{self.kind}: {where + ': ' if where else ''}{self.message}"


class _Found(list[Problem]):
    """Problems found so far."""

    def add(
        self, kind: str, version: int | None, key: str | None, msg: str, tensor: str | None = None
    ) -> bool:
        """Append one; False (for ``return found.add(...)`` where a check fails)."""
        self.append(Problem(kind, version, key, msg, tensor))
        return False


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_store` or :func:`verify_checkout` checked and found.

    ``tensors_checked``: (version, tensor) pairs whose Adler-32 was recomputed (deep; an
    anchor copy's tensors count too, as pairs of their own) or tensors checked (checkout).
    ``unverified``: (version or copy, tensor) pairs the deep replay could not reach because of
    a problem already listed. ``orphans``: data objects no manifest
    names (left by failed publishes; not damage: see ``deltastore gc --orphans``).
    ``trusted_keys``: the ids of the keys every manifest and copy had to be signed by (empty:
    signatures were not checked); ``unchecked_signatures``: signed manifests and copies whose
    signature was not checked because no key was held.
    """

    target: str
    mode: Mode
    versions: tuple[int, ...]
    frames: int = 0
    bytes_read: int = 0
    tensors_checked: int = 0
    unverified: int = 0
    orphans: int = 0
    trusted_keys: tuple[str, ...] = ()
    unchecked_signatures: int = 0
    problems: tuple[Problem, ...] = ()
    elapsed_s: float = 0.0
    kinds: dict[str, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        """A store check that found no version at all: nothing was verified."""
        return self.mode != "checkout" and not self.versions and not self.problems

    @property
    def ok(self) -> bool:
        """No problem found, and (for a store) at least one version checked."""
        return not self.problems and not self.empty

    def summary(self) -> str:
        what = "folder" if self.mode == "checkout" else "store"
        if self.mode == "checkout":
            parts = [
                f"v{self.versions[0]}" if self.versions else "no version",
                f"{self.tensors_checked} tensors",
            ]
        else:
            parts = [f"{len(self.versions)} versions", f"{self.frames} frames"]
            parts.append(f"{self.bytes_read} bytes read")
            if self.mode == "deep":
                parts.append(f"{self.tensors_checked} tensor checksums replayed")
            if self.unverified:
                parts.append(f"{self.unverified} not reached")
            if self.orphans:
                parts.append(f"{self.orphans} orphan objects")
        if self.trusted_keys:
            parts.append(f"signatures checked (key id {', '.join(self.trusted_keys)})")
        elif self.unchecked_signatures:
            parts.append(f"{self.unchecked_signatures} signatures not checked (no trusted key)")
        count = f"{len(self.problems)} problem{'s' if len(self.problems) > 1 else ''}"
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.kinds.items()))
        verdict = "ok" if self.ok else f"{count} ({kinds})"
        if self.empty:
            verdict = (
                "holds no committed version, nothing verified (check the store URL; "
                "publish a version first)"
            )
        return f"{what} {self.target}: {', '.join(parts)}: {verdict}"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["versions"] = list(self.versions)
        out["trusted_keys"] = list(self.trusted_keys)
        out["ok"] = self.ok
        out["empty"] = self.empty
        return out


def _report(
    target: str, mode: Mode, versions: Iterable[int], problems: _Found, t0: float, **kw: Any
) -> VerifyReport:
    return VerifyReport(
        target=target,
        mode=mode,
        versions=tuple(sorted(versions)),
        problems=tuple(problems),
        elapsed_s=time.perf_counter() - t0,
        kinds=dict(Counter(p.kind for p in problems)),
        **kw,
    )


# --- store ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ref:
    """One frame as a manifest names it."""

    version: int
    tensor: str
    frame: Frame
    copy: bool = False  # a frame of the version's anchor copy, not of its manifest
    start: bool = False  # (copy) the copy starts its version's chain: the versions below are gone

    @property
    def where(self) -> str:
        frame = f"{self.tensor}[{self.frame.start}:{self.frame.stop}]"
        return f"{frame} of anchor copy {anchor_key(self.version)}" if self.copy else frame

    @property
    def hint(self) -> str:
        """What to do when this frame is damaged ("" for a manifest's frame)."""
        return copy_hint(self.version, start=self.start) if self.copy else ""


def verify_store(
    url: str | os.PathLike[str] | Store,
    *,
    deep: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: ProgressFn | None = None,
    max_workers: int = 4,
    keys: TrustOption = FROM_ENV,
) -> VerifyReport:
    """Check every committed version of the store at ``url`` (see the module docstring).

    ``keys``: the keys every manifest and anchor copy must be signed by (a sequence of
    :class:`~deltastore.format.signing.Verifier`, a key, key text, or None / ``()`` for no
    signature check); :data:`~deltastore.format.signing.FROM_ENV` (default): those of
    ``DELTASTORE_TRUSTED_KEYS`` and ``DELTASTORE_SIGNING_KEY`` (ValueError when invalid).

    ``progress`` is called after each frame read (from worker threads, serialized), in stored
    bytes. Store I/O errors other than a missing object are raised (:class:`StoreError`;
    :class:`BucketNotFoundError` for a bucket that does not exist). A store without any
    version gives a report that is not ``ok`` (``empty``): nothing could be verified.
    """
    t0 = time.perf_counter()
    store = open_store(url, storage_options)
    problems = _Found()
    trusted = _trusted(keys)
    reader = ChainReader(store, keys=trusted)

    def damaged(d: Damaged) -> None:  # a failed signature check is a problem of its own
        sig = isinstance(d.error, SignatureError)  # its message starts with the key: drop it
        msg = d.message.removeprefix(f"{d.key}: ").removeprefix(f"{d.key} ") if sig else d.message
        problems.add(SIGNATURE if sig else MANIFEST, d.version, d.key, msg)

    chain = reader.read_all(damaged)
    latest = reader.check_latest(chain)
    if latest is not None:
        problems.add(LATEST, latest.version, latest.key, latest.message)
    manifests = chain.manifests
    signed = [m.signature is not None for m in [*manifests.values(), *chain.copies.values()]]
    copies = _usable_copies(chain, problems)
    _check_chains(chain.listed, manifests, problems, set(copies))
    # deep: a version whose parent is gone (retention) is replayed from its anchor copy (a
    # start); every other copy is replayed on its own after the chains
    starts = {
        v: c
        for v, c in copies.items()
        if (p := manifests[v].parent) is None or p.version not in manifests
    }
    refs = [
        _Ref(v, name, f, copy, copy and v in starts)
        for copy, found in ((False, manifests), (True, copies))
        for v, m in sorted(found.items())
        for name, e in m.tensors.items()
        for f in e.frames
    ]
    again = [r for r in refs if r.copy or r.version not in starts]  # what deep reads again
    ticker = Ticker(
        progress,
        len(refs) + (len(again) if deep else 0),
        sum(r.frame.length for r in refs + (again if deep else [])),
    )
    bad, nbytes = _check_objects(store, refs, problems, ticker, max_workers)
    named = {r.frame.object for r in refs}
    orphans = sum(k not in named for k in store.list(DATA_PREFIX))
    checked = unverified = 0
    if deep:
        replay = Replay(store, manifests | starts, bad, problems.add, ticker, frozenset(starts))
        checked, unverified = replay.run()
        n, u = replay.run_copies({v: c for v, c in copies.items() if v not in starts})
        checked, unverified = checked + n, unverified + u
        nbytes += replay.nbytes
    return _report(
        store.url,
        "deep" if deep else "store",
        manifests,
        problems,
        t0,
        frames=len(refs),
        bytes_read=nbytes,
        tensors_checked=checked,
        unverified=unverified,
        orphans=orphans,
        trusted_keys=tuple(k.key_id for k in trusted),
        unchecked_signatures=0 if trusted else sum(signed),
    )


def _trusted(keys: TrustOption) -> tuple[Verifier, ...]:
    """``keys`` as a tuple of verifiers (:data:`FROM_ENV`: both environment variables)."""
    return resolve_trust() if keys is FROM_ENV else resolve_trust(keys, None)


def _check_link(m: Manifest, parent: Manifest, problems: _Found) -> bool:
    """Check ``m`` against its parent's manifest (the rule of :mod:`deltastore.format.chain`:
    every misfit is a problem of the same kind); False when a delta cannot apply to it."""
    if m.parent is None:  # pragma: no cover - callers pass versions with a parent
        return True
    misfits = link.State.of(parent).misfits(m)
    for x in misfits:
        tensor = x.tensors[0] if x.kind == PARENT_ADLER32 else None
        problems.add(x.kind, m.version, manifest_key(m.version), x.message, tensor)
    return not misfits or m.kind == "anchor"


def _usable_copies(chain: Chain, problems: _Found) -> dict[int, Manifest]:
    """The usable anchor copies (spec section 9.4): of committed versions whose manifest is
    good, holding their version's state, without a parent; each other one is a problem (a
    copy of no committed version, of another state, or with a parent). The copy of a version
    whose manifest is damaged is not usable, and not a problem of its own."""
    usable = {}
    for v, c in sorted(chain.copies.items()):
        m = chain.manifests.get(v)
        if m is not None and m.state_digest == c.state_digest and c.parent is not None:
            msg = f"anchor copy has a parent (version {c.parent.version}); a copy has none"
            problems.add(MANIFEST, v, anchor_key(v), msg)
        elif m is not None and m.state_digest == c.state_digest:
            usable[v] = c
        elif m is not None or v not in chain.listed:
            what = "no committed version" if m is None else "another state than its version"
            problems.add(MANIFEST, v, anchor_key(v), f"anchor copy of {what}")
    return usable


def _check_chains(
    listed: set[int], manifests: dict[int, Manifest], problems: _Found, copies: set[int]
) -> None:
    """Every delta's link to its parent, and whether each version reaches an anchor (an
    anchor version, or a version with a usable anchor copy: its parent may be gone)."""
    reach: dict[int, bool] = {}
    breaks: dict[int, int] = {}  # unreachable version -> where its chain breaks
    for v in sorted(listed):
        m = manifests.get(v)
        if m is None:  # damaged manifest: already listed
            reach[v], breaks[v] = False, v
            continue
        if m.parent is None:
            reach[v] = True
            continue
        p = m.parent.version
        parent = manifests.get(p)
        if parent is None and v in copies and p not in listed:  # deleted by retention
            reach[v] = True
            continue
        if parent is None:
            link = m.kind == "anchor"  # an anchor does not need its parent
            if not link and p not in listed:
                problems.add(MISSING_PARENT, v, manifest_key(v), f"parent version {p} is missing")
            elif not link:
                problems.add(CHAIN, v, manifest_key(v), f"its parent version {p} is damaged")
        else:
            link = _check_link(m, parent, problems)
        if m.kind == "anchor" or v in copies:
            reach[v] = True
        elif not link:
            reach[v], breaks[v] = False, v
        elif reach.get(p, False):
            reach[v] = True
        else:
            reach[v], breaks[v] = False, breaks.get(p, p)
            problems.add(
                CHAIN,
                v,
                manifest_key(v),
                f"cannot be reached from an anchor: its chain breaks at version {breaks[v]}",
            )


def _check_objects(
    store: Store, refs: list[_Ref], problems: _Found, ticker: Ticker, workers: int
) -> tuple[set[tuple[str, int]], int]:
    """Read every frame; return the ``(object, offset)`` of those that are missing or bad,
    and the bytes read."""
    by_object: dict[str, list[_Ref]] = {}
    for r in refs:
        by_object.setdefault(r.frame.object, []).append(r)

    def check(key: str) -> tuple[list[Problem], set[tuple[str, int]], int]:
        found = _Found()
        bad: set[tuple[str, int]] = set()
        nbytes = 0
        frames = sorted(by_object[key], key=lambda r: r.frame.offset)
        versions = sorted({r.version for r in frames})
        short: list[tuple[_Ref, int]] = []
        for r in frames:
            f = r.frame
            try:
                data = store.get_range(key, f.offset, f.length)
            except ObjectNotFoundError:
                tensors = sorted({r.tensor for r in frames})
                of = f" of anchor copy {anchor_key(versions[0])}" if frames[0].copy else ""
                found.add(
                    MISSING_OBJECT,
                    versions[0],
                    key,
                    f"missing; {len(frames)} frames{of} of {len(tensors)} tensors "
                    f"({', '.join(tensors[:3])}{', …' if len(tensors) > 3 else ''}) are in it"
                    f"{frames[0].hint}",
                )
                ticker.tick(sum(r.frame.length for r in frames), len(frames))
                return found, {(key, r.frame.offset) for r in frames}, nbytes
            nbytes += len(data)
            ticker.tick(f.length)
            if len(data) < f.length:
                short.append((r, len(data)))
                bad.add((key, f.offset))
            elif xxhash.xxh3_64_hexdigest(data) != f.xxh3:
                found.add(
                    XXH3,
                    r.version,
                    key,
                    f"frame {r.where} at offset {f.offset} has another XXH3-64 than "
                    f"{f.xxh3}: its bytes are damaged{r.hint}",
                    r.tensor,
                )
                bad.add((key, f.offset))
            elif f.blake3 is not None and frame_digest(data) != f.blake3:
                found.add(
                    BLAKE3,
                    r.version,
                    key,
                    f"frame {r.where} at offset {f.offset} does not have the BLAKE3 its signed "
                    f"manifest records: the data object was replaced or damaged after it was "
                    f"published{r.hint}",
                    r.tensor,
                )
                bad.add((key, f.offset))
        if short:
            r, got = short[0]
            found.add(
                TRUNCATED,
                r.version,
                key,
                f"ends at byte {r.frame.offset + got}: frame {r.where} needs "
                f"{r.frame.length} bytes at offset {r.frame.offset}; {len(short)} frames "
                f"are cut short or missing{r.hint}",
                r.tensor,
            )
        return found, bad, nbytes

    out: set[tuple[str, int]] = set()
    total = 0
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="deltastore-verify") as pool:
        for found, bad, nbytes in pool.map(check, sorted(by_object)):
            problems += found
            out |= bad
            total += nbytes
    return out, total


# --- checkout ------------------------------------------------------------------------------


def verify_checkout(
    dest: str | os.PathLike[str],
    url: str | os.PathLike[str] | Store | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    keys: TrustOption = FROM_ENV,
) -> VerifyReport:
    """Check the folder ``dest`` (written by ``deltastore pull``) against its sidecar's
    version: every tensor's Adler-32 (one read of the folder). With ``url``, the expected
    table and checksums come from that version's manifest in the store, and the sidecar is
    checked against it; that manifest must be signed by one of ``keys`` (as for
    :func:`verify_store`; :class:`SignatureError` otherwise). Raises :class:`CheckpointError`
    when ``dest`` has no (readable) sidecar or its files are not a checkpoint."""
    from deltastore.checkpoint.folders import (  # publisher and subscriber: loaded on use
        PENDING,
        SIDECAR,
        checksums,
        read_state,
    )

    t0 = time.perf_counter()
    folder = Path(dest)
    state = read_state(folder)
    if state is None:
        raise CheckpointError(f"{folder} holds no {SIDECAR}: it is not a folder deltastore pulled")
    files = locate(folder)
    tensors = MappedCheckpoint(files).host  # numpy words over the files: no torch
    problems = _Found()
    expected = dict(state.adler32)
    trusted: tuple[Verifier, ...] = ()
    if url is not None:
        key = manifest_key(state.version)
        trusted = _trusted(keys)
        reader = ChainReader(open_store(url, storage_options), keys=trusted)
        m = reader.manifest(state.version)
        expected = {n: e.adler32 for n, e in m.tensors.items()}
        if state.state_digest != m.state_digest or state.adler32 != expected:
            problems.add(
                SIDECAR_MISMATCH,
                state.version,
                SIDECAR,
                f"the sidecar's state digest or checksums are not those of {key}",
            )
        have = table_of(tensors)
        for name, e in m.tensors.items():
            if name in have and have[name] != (e.dtype, tuple(e.shape)):
                problems.add(
                    TABLE,
                    state.version,
                    None,
                    f"is {have[name][0]}{list(have[name][1])} in the folder, "
                    f"{e.dtype}{e.shape} in the manifest",
                    name,
                )
    interrupted = (folder / PENDING).exists()
    hint = "; a pull was interrupted here: `deltastore pull` repairs it" if interrupted else ""
    for name in sorted(set(expected) ^ set(tensors)):
        where = "missing from the folder" if name in expected else "not in that version"
        problems.add(TABLE, state.version, None, f"tensor {name} is {where}", name)
    found = checksums({n: t for n, t in tensors.items() if n in expected})
    for name, value in sorted(found.items()):
        if value != expected[name]:
            problems.add(
                ADLER32,
                state.version,
                files[name].path.name,
                f"tensor {name} has Adler-32 {value:08x}, version {state.version} has "
                f"{expected[name]:08x}{hint}",
                name,
            )
    return _report(
        str(folder),
        "checkout",
        [state.version],
        problems,
        t0,
        tensors_checked=len(found),
        bytes_read=sum(math.prod(t.shape) * t.element_size() for t in tensors.values()),
        trusted_keys=tuple(k.key_id for k in trusted),
    )


__all__ = [
    "ADLER32",
    "BLAKE3",
    "CHAIN",
    "FRAME",
    "LATEST",
    "MANIFEST",
    "MISSING_OBJECT",
    "MISSING_PARENT",
    "PARENT_ADLER32",
    "PARENT_DIGEST",
    "PARENT_TABLE",
    "SIDECAR_MISMATCH",
    "SIGNATURE",
    "TABLE",
    "TRUNCATED",
    "XXH3",
    "Problem",
    "VerifyReport",
    "verify_checkout",
    "verify_store",
]
