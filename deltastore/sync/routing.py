"""Routing decoded changes to the ranks that hold them, and the two-round exchange.

A :class:`Segment` carries the decoded changes of one frame piece for one rank. The exchange
packs each rank's segments into one int64 stream (a 4-word header per segment, then its
positions) and one uint8 stream (copy counts, then the words' bytes), sends the stream sizes
in round 1 and the streams in round 2 (``all_to_all_single``, every rank enters both). Pure
functions; thread-safe except for the collectives (one thread per rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deltastore.format.dtypes import itemsize, word_dtype
from deltastore.layout.boxes import flat_span, inside, is_contiguous_box
from deltastore.sync.group import Group

_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY_U8 = np.zeros(0, dtype=np.uint8)
Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]
Holders = list[tuple[int, Boxes]]


@dataclass(frozen=True)
class Segment:
    """Decoded changes of one frame (piece) for one rank: ``raw`` values are new words,
    otherwise XOR masks; ``copies`` is each element's number of copies in the group. Anchor
    frames, and delta frames that change many elements, travel as dense ranges (``start``; no
    positions, copies counted by the receiver; XOR masks of zero for unchanged elements)."""

    tensor: int
    raw: bool
    positions: np.ndarray
    copies: np.ndarray
    values: np.ndarray
    start: int = -1  # >= 0: raw values of the dense range [start, start + len(values))


def route(
    tensor: int,
    shape: Sequence[int],
    holders: Holders,
    raw: bool,
    pos: np.ndarray,
    values: np.ndarray,
    routed: list[list[Segment]],
) -> None:
    """Split sorted global ``pos`` among the ranks holding them, with copy counts."""
    if len(holders) == 1 and len(holders[0][1]) == 1:  # one box: no copies, maybe a slice
        r, ((o, n),) = holders[0]
        if is_contiguous_box(shape, o, n):
            a, b = np.searchsorted(pos, flat_span(shape, o, n))
            if a < b:
                ones = np.ones(b - a, dtype=np.uint8)
                routed[r].append(Segment(tensor, raw, pos[a:b], ones, values[a:b]))
            return
    held = [
        (
            r,
            sum(
                (inside(pos, shape, o, n).view(np.uint8) for o, n in boxes[1:]),
                inside(pos, shape, *boxes[0]).view(np.uint8),
            ),
        )
        for r, boxes in holders
    ]
    copies = sum((c for _, c in held[1:]), held[0][1].copy())
    for r, count in held:
        sel = np.flatnonzero(count)
        if sel.size:
            routed[r].append(Segment(tensor, raw, pos[sel], copies[sel], values[sel]))


def route_range(
    tensor: int,
    shape: Sequence[int],
    holders: Holders,
    start: int,
    words: np.ndarray,
    routed: list[list[Segment]],
    *,
    raw: bool = True,
    copy: bool = True,
) -> None:
    """Send each rank the part of the dense range ``[start, start + len(words))`` within the
    hull of its boxes: new words (``raw``) or XOR masks (zero: unchanged). ``copy``: copy the
    parts (``words`` is a decoder's reused buffer); else they are views of ``words``."""
    stop = start + words.size
    for r, boxes in holders:
        spans = [flat_span(shape, o, n) for o, n in boxes]
        a = max(start, min(lo for lo, _ in spans))
        b = min(stop, max(hi for _, hi in spans))
        if a < b:
            part = words[a - start : b - start]
            routed[r].append(
                Segment(tensor, raw, _EMPTY, _EMPTY_U8, part.copy() if copy else part, a)
            )


#: Fewest consecutive absolute entries (``xor-patch``) that :func:`route_new_words` sends as
#: one dense range of new words (no positions, no copy counts) instead of one by one.
ABSOLUTE_RUN = 64


def route_new_words(
    tensor: int,
    shape: Sequence[int],
    holders: Holders,
    start: int,
    pos: np.ndarray,
    values: np.ndarray,
    routed: list[list[Segment]],
) -> None:
    """Route new words (``values``) at sorted frame-local ``pos`` of a frame whose first
    element is the tensor's element ``start``: each run of at least :data:`ABSOLUTE_RUN`
    consecutive positions as a dense range (:func:`route_range`: a whole block sent as
    absolute words costs its words only), the others with their positions (:func:`route`).
    The receiver keeps only the words that differ from its own (new words, not masks)."""
    if pos.size >= ABSOLUTE_RUN:
        bounds = np.concatenate(([0], np.flatnonzero(np.diff(pos) != 1) + 1, [pos.size]))
        lengths = np.diff(bounds)
        for i in np.flatnonzero(lengths >= ABSOLUTE_RUN):  # one step per long run
            a, b = int(bounds[i]), int(bounds[i + 1])
            route_range(
                tensor, shape, holders, start + int(pos[a]), values[a:b], routed, copy=False
            )
        rest = np.repeat(lengths < ABSOLUTE_RUN, lengths)
        pos, values = pos[rest], values[rest]
    if pos.size:
        route(tensor, shape, holders, True, pos + start, values, routed)


def exchange(group: Group, out: list[list[Segment]], dtypes: Sequence[str]) -> list[Segment]:
    """Rounds 1 and 2 of the exchange: ``out[r]`` goes to rank r; returns what this rank got.
    ``dtypes[t]`` is the dtype name of tensor index t."""
    if group.world == 1:
        return out[0]
    ints, bytes_ = [], []
    for segs in out:
        ints.append(
            np.concatenate(
                [_EMPTY]
                + [
                    np.concatenate(([s.tensor, int(s.raw), s.values.size, s.start], s.positions))
                    for s in segs
                ]
            ).astype(np.int64)
        )
        bytes_.append(
            np.concatenate(
                [_EMPTY_U8]
                + [
                    np.concatenate((s.copies, np.ascontiguousarray(s.values).view(np.uint8)))
                    for s in segs
                ]
            )
        )
    counts = group.exchange_counts(
        np.array([[a.size, b.size] for a, b in zip(ints, bytes_, strict=True)], np.int64)
    )
    got_i = group.all_to_all(ints, np.dtype(np.int64), counts[:, 0])
    got_b = group.all_to_all(bytes_, np.dtype(np.uint8), counts[:, 1])
    received: list[Segment] = []
    for ia, ba in zip(got_i, got_b, strict=True):
        i = j = 0
        while i < ia.size:
            tensor, raw, count, start = (int(x) for x in ia[i : i + 4])
            size = itemsize(dtypes[tensor])
            k = count if start < 0 else 0  # positions and copies: sparse segments only
            pos, copies = ia[i + 4 : i + 4 + k], ba[j : j + k]
            vals = ba[j + k : j + k + count * size].copy().view(word_dtype(size))
            received.append(Segment(tensor, bool(raw), pos, copies, vals, start))
            i, j = i + 4 + k, j + k + count * size
    return received


__all__ = ["ABSOLUTE_RUN", "Segment", "exchange", "route", "route_new_words", "route_range"]
