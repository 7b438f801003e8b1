"""The deep check of a store (``deltastore verify --deep``, :mod:`deltastore.maintenance.verify`).

Each tensor is replayed through every version in memory, one tensor at a time: an anchor's
frames are decoded into a buffer of the tensor's words, each delta's frames applied to the
buffer at its parent. Every frame's Adler-32 (and, for a delta, its parent's and its count of
changed elements) and every version's per-tensor Adler-32 are checked. Memory: one tensor's
words and one stored frame (plus the decoder's buffers), whatever the model size. Where a
version's parent is not the version last replayed (a branch), the parent is replayed again
from its anchor. Frames the fast pass found missing or damaged are skipped: that tensor is not
replayed again until the next anchor. Each frame read is checked again (length, XXH3-64, and
BLAKE3 when its manifest records one) before it is decoded.

Anchor copies (format v1 section 9.4): a copy that starts a version's chain (its parent is gone)
stands in for that version in :meth:`Replay.run`; every other copy is replayed on its own by
:meth:`Replay.run_copies`, after the chains, one tensor at a time into a fresh buffer (the
chain's buffer is dropped first: memory stays one tensor and one frame). A copy holds its
version's state (same ``state_digest``, so the same per-tensor Adler-32), so replaying it
checks it against its version. Its problems name the copy's key and say what to do.

One thread: a :class:`Replay` is used by one caller, :meth:`~Replay.run` then
:meth:`~Replay.run_copies`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import numpy as np
import xxhash

from deltastore.errors import FrameError, ObjectNotFoundError
from deltastore.format.checksum import adler32
from deltastore.format.codecs import FrameDecoder
from deltastore.format.dtypes import itemsize, word_dtype
from deltastore.format.ed25519 import frame_digest
from deltastore.format.keys import anchor_key, manifest_key
from deltastore.format.manifest import Frame, Manifest, TensorEntry
from deltastore.progress import Ticker
from deltastore.store import Store

#: A frame does not decode, or changes another number of elements than it says.
FRAME: Final = "frame"
#: Bytes whose Adler-32 is not the manifest's.
ADLER32: Final = "adler32"
#: Called for each problem: kind, version, key, message, tensor.
Report = Callable[[str, int, str, str, str], object]


def copy_hint(version: int, *, start: bool = False) -> str:
    """What to do about a damaged anchor copy of ``version`` (appended to its problems).
    ``start``: the copy starts its version's chain (the versions below are gone)."""
    key = anchor_key(version)
    if start:
        return (
            f"; the chain below version {version} is gone, so version {version} and those "
            "after it cannot be pulled from scratch: publish an anchor"
        )
    return (
        f"; a pull skips the copy and falls back to the chain below it; delete {key}, then "
        "`deltastore gc --orphans` removes its data objects"
    )


class Replay:
    """Deep check: replay each tensor's chain in memory, one tensor at a time."""

    def __init__(
        self,
        store: Store,
        manifests: dict[int, Manifest],
        bad: set[tuple[str, int]],
        report: Report,
        ticker: Ticker,
        starts: frozenset[int] = frozenset(),
    ) -> None:
        """``manifests``: what to replay, by version; for the versions in ``starts`` it holds
        the version's anchor copy (its chain starts there). ``bad``: ``(object, offset)`` of
        the frames the fast pass found missing or damaged (skipped, already reported)."""
        self.store, self.manifests, self.bad = store, manifests, bad
        self.report, self.ticker, self.starts = report, ticker, starts
        self.found = 0
        self.dec = FrameDecoder()
        self.nbytes = 0

    def run(self) -> tuple[int, int]:
        """(tensor checksums checked, (version, tensor) pairs not reached)."""
        checked = unverified = 0
        names = dict.fromkeys(n for v in sorted(self.manifests) for n in self.manifests[v].tensors)
        for name in names:
            state: tuple[int, np.ndarray] | None = None  # (version, words) of this tensor
            failed: set[int] = set()  # versions whose replay of this tensor failed
            for v, m in sorted(self.manifests.items()):
                entry = m.tensors.get(name)
                if entry is None:
                    continue
                parent = m.parent.version if m.parent is not None else None
                if m.kind == "delta" and (state is None or state[0] != parent):
                    state = None  # drop it before another copy is rebuilt
                buf = self._base(name, m, entry, state[1] if state else None, failed)
                before = self.found
                copy = v in self.starts
                if buf is not None and self._apply(name, m, entry, buf, report=True, copy=copy):
                    state = (v, buf)
                    checked += 1
                    continue
                state = None
                failed.add(v)
                unverified += self.found == before  # not reached: a problem upstream
        return checked, unverified

    def run_copies(self, copies: dict[int, Manifest]) -> tuple[int, int]:
        """Replay each anchor copy (by version; not those in ``starts``, replayed by
        :meth:`run`) on its own, one tensor at a time: (tensor checksums checked, (copy,
        tensor) pairs not reached because of a frame the fast pass reported)."""
        checked = unverified = 0
        for _, c in sorted(copies.items()):
            for name, entry in c.tensors.items():
                buf = np.zeros(entry.numel, dtype=word_dtype(itemsize(entry.dtype)))
                before = self.found
                if self._apply(name, c, entry, buf, report=True, copy=True):
                    checked += 1
                else:
                    unverified += self.found == before
                del buf
        return checked, unverified

    def _base(
        self,
        name: str,
        m: Manifest,
        entry: TensorEntry,
        held: np.ndarray | None,
        failed: set[int],
    ) -> np.ndarray | None:
        """The buffer to apply ``m`` to: for a delta, ``held`` (the tensor at the parent) or
        the parent rebuilt from its anchor; for an anchor, any buffer of the right size."""
        words = word_dtype(itemsize(entry.dtype))
        if m.kind == "anchor":
            if held is not None and held.size == entry.numel and held.dtype == words:
                return held
            return np.zeros(entry.numel, dtype=words)
        if held is not None:
            return held
        chain: list[Manifest] = []
        v = m.parent.version if m.parent is not None else None
        while v is not None:
            parent = self.manifests.get(v)
            if parent is None or v in failed or name not in parent.tensors:
                return None
            chain.append(parent)
            v = None if parent.kind == "anchor" or parent.parent is None else parent.parent.version
        if not chain or chain[-1].kind != "anchor":
            return None
        buf = np.zeros(entry.numel, dtype=words)
        for step in reversed(chain):  # already checked (and reported) on their own turn
            copy = step.version in self.starts
            if not self._apply(name, step, step.tensors[name], buf, report=False, copy=copy):
                return None
        return buf

    def _problem(self, report: bool, kind: str, m: Manifest, key: str, msg: str, name: str) -> bool:
        if report:
            self.report(kind, m.version, key, msg, name)
            self.found += 1
        return False

    def _apply(
        self,
        name: str,
        m: Manifest,
        entry: TensorEntry,
        buf: np.ndarray,
        *,
        report: bool,
        copy: bool = False,
    ) -> bool:
        """Apply one version of one tensor to ``buf``, checking its frames' and the tensor's
        Adler-32; False (and a problem when ``report``) if anything does not match. ``copy``:
        ``m`` is the version's anchor copy (its problems name the copy and say what to do)."""
        size = itemsize(entry.dtype)
        delta = m.kind == "delta"
        of = f" of anchor copy {anchor_key(m.version)}" if copy else ""
        hint = copy_hint(m.version, start=m.version in self.starts) if copy else ""
        for f in entry.frames:
            where = f"frame {name}[{f.start}:{f.stop}]{of}"
            if (f.object, f.offset) in self.bad:
                return False  # missing or damaged: listed by the fast pass
            try:
                data = self.store.get_range(f.object, f.offset, f.length)
            except ObjectNotFoundError:
                return False
            self.nbytes += len(data)
            if report:
                self.ticker.tick(f.length)
            if len(data) != f.length or xxhash.xxh3_64_hexdigest(data) != f.xxh3:
                return False  # changed since the fast pass read it
            if f.blake3 is not None and frame_digest(data) != f.blake3:
                return False  # likewise: never decoded
            seg = buf[f.start : f.stop]
            if delta and f.parent_adler32 is not None and adler32(seg) != f.parent_adler32:
                msg = f"{where}: the parent's bytes there do not have its parent_adler32"
                return self._problem(report, ADLER32, m, f.object, msg, name)
            try:
                changed = self._decode(f, data, seg, size)
            except FrameError as exc:
                msg = f"{where}: {exc}{hint}"
                return self._problem(report, FRAME, m, f.object, msg, name)
            if delta and changed != f.changed:
                msg = f"{where} changes {changed} elements, the manifest says {f.changed}"
                return self._problem(report, FRAME, m, f.object, msg, name)
            got = adler32(seg)
            if got != f.adler32:
                msg = (
                    f"{where} decodes to Adler-32 {got:08x}, the manifest says "
                    f"{f.adler32:08x}: the frame holds other values than it should{hint}"
                )
                return self._problem(report, ADLER32, m, f.object, msg, name)
        if delta and not entry.frames:  # unchanged: the parent's checksum, checked already
            got = entry.parent_adler32 if entry.parent_adler32 is not None else adler32(buf)
        else:
            got = adler32(buf)
        if got != entry.adler32:
            key = anchor_key(m.version) if copy else manifest_key(m.version)
            msg = (
                f"tensor {name} replays to Adler-32 {got:08x}, the manifest says "
                f"{entry.adler32:08x}{hint}"
            )
            return self._problem(report, ADLER32, m, key, msg, name)
        return True

    def _decode(self, f: Frame, data: bytes, seg: np.ndarray, size: int) -> int:
        """Apply one stored frame to ``seg`` (the frame's elements, unsigned words, in place);
        return how many elements changed, or for sparse changes how many entries the frame
        holds (``xor-patch``: its absolute entries count, even one equal to the old word).
        Decoded by the one codec dispatch
        (:meth:`~deltastore.format.codecs.FrameDecoder.changes`)."""
        changed = 0
        for ch in self.dec.changes(f.codec, data, f.stop - f.start, size, f.changed):
            if ch.positions is not None:  # entries: XOR masks (never zero) or new words
                if ch.xor:
                    seg[ch.positions] ^= ch.words
                else:
                    seg[ch.positions] = ch.words
                changed += int(ch.positions.size)
                continue
            part = seg[ch.first : ch.first + ch.words.size]
            if ch.xor:
                changed += int(np.count_nonzero(ch.words))
                part ^= ch.words
            else:
                changed += int(np.count_nonzero(part != ch.words))
                part[:] = ch.words
        return changed


__all__ = ["ADLER32", "FRAME", "Replay", "copy_hint"]
