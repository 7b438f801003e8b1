"""Checking a shard writer's slices against the frames that stored them (``attach``).

A slice that covers a whole tensor is checked against the tensor's Adler-32; any other against
the frames inside it, newest version first, then its parents' frames for the rows the newer
ones did not store, back to an anchor. Functions are stateless; one manifest read per parent.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from deltastore.errors import ObjectNotFoundError, TensorMismatchError
from deltastore.format.checksum import adler32
from deltastore.format.keys import manifest_key
from deltastore.format.manifest import Frame, Manifest, parse_manifest
from deltastore.store import Store

Rows = tuple[int, int]


def words_adler(words: np.ndarray, start: int, stop: int) -> int:
    """Adler-32 of ``words[start:stop]``."""
    return adler32(words[start:stop])


def check_slices(
    store: Store,
    manifest: Manifest,
    host: Mapping[str, Callable[[int, int], int]],
    ranges: Mapping[str, Rows],
    totals: Mapping[str, int],
) -> None:
    """:class:`TensorMismatchError` unless every slice (``host[n](a, b)``: the Adler-32 of
    its words ``[a, b)``, slice-local; elements ``ranges[n]``; Adler-32 ``totals[n]``) is at
    ``manifest``'s version."""
    bad: list[str] = []
    todo: dict[str, list[Rows]] = {}  # element ranges not checked yet
    for name, (a, b) in ranges.items():
        if (a, b) == (0, manifest.tensors[name].numel):
            if totals[name] != manifest.tensors[name].adler32:
                bad.append(name)
        elif a < b:
            todo[name] = [(a, b)]
    m = manifest
    while todo:
        for name, gaps in list(todo.items()):
            entry = m.tensors.get(name)
            left = (
                match_frames(entry.frames, gaps, host[name], ranges[name][0])
                if entry is not None
                else None
            )
            if left is None:
                bad.append(name)
            if not left:
                del todo[name]
            else:
                todo[name] = left
        if not todo or m.kind == "anchor" or m.parent is None:
            break
        try:
            m = parse_manifest(store.get(manifest_key(m.parent.version)))
        except ObjectNotFoundError:
            break
    bad.extend(todo)  # rows that no frame down the chain stored
    if bad:
        raise TensorMismatchError(
            f"{len(bad)} slices are not at version {manifest.version} ({', '.join(bad[:5])}): "
            "their bytes differ from the frames that stored them, or those frames do not align "
            "with the slices (after a change of sharding: publish an anchor from every writer)"
        )


def match_frames(
    frames: Sequence[Frame], gaps: list[Rows], words: Callable[[int, int], int], offset: int
) -> list[Rows] | None:
    """Check ``words`` (the Adler-32 of a range of the slice's words, whose element 0 is
    ``offset``) against the ``frames`` that fall in
    ``gaps`` (sorted element ranges not checked yet); return the ranges still unchecked, or
    None on a mismatch or a frame that straddles a gap's edge."""
    left: list[Rows] = []
    i = 0
    for lo, hi in gaps:
        while i < len(frames) and frames[i].stop <= lo:
            i += 1
        pos = lo
        while i < len(frames) and frames[i].start < hi:
            f = frames[i]
            if f.start < lo or f.stop > hi:
                return None
            if words(f.start - offset, f.stop - offset) != f.adler32:
                return None
            if f.start > pos:
                left.append((pos, f.start))
            pos, i = f.stop, i + 1
        if pos < hi:
            left.append((pos, hi))
    return left


__all__ = ["check_slices", "match_frames", "words_adler"]
