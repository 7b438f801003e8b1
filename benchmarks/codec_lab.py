"""Codec lab: payload bytes per changed element, anchor size and codec speed, old vs new.

Measures format v1's ``xor-sparse``/``raw`` (``deltastore.format.codecs``) against the 0.2.0
codecs ``xor-sparse2``/``raw-planes`` (``deltastore.format.codecs.v2``) on the versions of the
benchmark workload, cut into frames as the publisher cuts tensors (``max_frame_bytes``, default
16 MiB, per tensor), and prints the entropy floors beside them:

- ``floor xor``: per frame, the order-0 entropy of the gaps (geometric at the frame's density)
  plus the order-0 entropy of the XOR masks: what any codec that codes positions and XOR
  masks without looking at the old words can reach;
- ``floor step``: the same with the masks replaced by the signed step between old and new in
  the dtype's value order (``+-1`` ulp mostly): what a codec that derives masks from the old
  words could reach (not an XOR codec: for reference only).

Workload: the cached ``deltastore bench`` workload when present
(``<workdir>/<size>-lr<lr>-seed<seed>-w<warmup>-v<versions>-ss/``, written by
``deltastore bench --size medium``), else versions generated in memory with
``deltastore.testing.synthetic.AdamWTrajectory`` (``--size tiny`` or ``small`` then; 16 bytes
of memory per element). ``--thin F`` keeps a random fraction F of the changes of every frame
(the others revert to the old word): the positions stay i.i.d., at F times the density.

    .venv/bin/python benchmarks/codec_lab.py                       # medium, lr 1e-6, v0 -> v1
    .venv/bin/python benchmarks/codec_lab.py --thin 0.5 --no-anchor
    .venv/bin/python benchmarks/codec_lab.py --size small --lr 5e-7 --generate

Times are single-threaded wall times, the fastest of ``--repeat`` runs of each frame; on a
shared machine compare the rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from deltastore.format.codecs import XOR_DENSE, FrameDecoder, FrameEncoder
from deltastore.format.codecs.v2 import (
    RAW_PLANES,
    XOR_SPARSE2,
    FrameDecoder2,
    FrameEncoder2,
    choose_low_bits,
)

MiB = 1 << 20


# --- workload -----------------------------------------------------------------------------------


@dataclass
class Tensor:
    name: str
    offset: int
    numel: int


@dataclass
class Versions:
    """Two versions (flat uint16 bf16 words) and the tensor table over them."""

    source: str
    tensors: list[Tensor]
    old: np.ndarray
    new: np.ndarray


def default_workdir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deltastore" / "bench"


def cached(args: argparse.Namespace) -> Versions | None:
    """The cached bench workload's versions ``version - 1`` and ``version``, if present
    (read through ``index.json`` directly: flat little-endian bf16 words per version)."""
    key = f"{args.size}-lr{args.lr:g}-seed{args.seed}-w{args.warmup}-v{args.versions}-ss"
    folder = Path(args.workdir).expanduser() / key
    if not (folder / "COMPLETE").is_file():
        return None
    index = json.loads((folder / "index.json").read_text())
    numel = int(index["numel"])
    tensors = [Tensor(t["name"], int(t["offset"]), int(t["numel"])) for t in index["tensors"]]

    def words(i: int) -> np.ndarray:
        return np.memmap(folder / f"v{i:03d}.bin", dtype=np.uint16, mode="r", shape=(numel,))

    return Versions(str(folder), tensors, words(args.version - 1), words(args.version))


def generated(args: argparse.Namespace) -> Versions:
    """Versions ``version - 1`` and ``version`` of an in-memory AdamW trajectory."""
    import torch

    from deltastore.testing.synthetic import SIZES, AdamWTrajectory

    config = SIZES[args.size]
    traj = AdamWTrajectory(config, lr=args.lr, seed=args.seed, warmup=args.warmup)
    for _ in range(args.version - 1):
        traj.step()

    def flat(ts: dict[str, torch.Tensor]) -> np.ndarray:
        return np.concatenate([t.reshape(-1).view(torch.int16).numpy() for t in ts.values()])

    old = flat(traj.bf16()).view(np.uint16)
    new = flat(traj.step()).view(np.uint16)
    tensors, offset = [], 0
    for name, shape in config.shapes().items():
        n = math.prod(shape)
        tensors.append(Tensor(name, offset, n))
        offset += n
    return Versions(f"generated {args.size} lr {args.lr:g}", tensors, old, new)


@dataclass
class Frame:
    n: int
    old: np.ndarray
    new: np.ndarray
    positions: np.ndarray
    masks: np.ndarray


def frames(v: Versions, max_frame_bytes: int, thin: float, seed: int) -> Iterator[Frame]:
    """Changed frames on the publisher's grid: ``max_frame_bytes // 2`` elements per tensor."""
    step = max(1, max_frame_bytes // 2)
    rng = np.random.default_rng(seed)
    for t in v.tensors:
        for a in range(0, t.numel, step):
            b = min(a + step, t.numel)
            old = np.asarray(v.old[t.offset + a : t.offset + b])
            new = np.asarray(v.new[t.offset + a : t.offset + b])
            pos = np.flatnonzero(old != new)
            if thin < 1.0 and pos.size:
                drop = pos[rng.random(pos.size) >= thin]
                new = new.copy()
                new[drop] = old[drop]
                pos = np.flatnonzero(old != new)
            if pos.size:
                yield Frame(b - a, old, new, pos, old[pos] ^ new[pos])


def anchor_frames(v: Versions, max_frame_bytes: int) -> Iterator[np.ndarray]:
    step = max(1, max_frame_bytes // 2)
    for t in v.tensors:
        for a in range(0, t.numel, step):
            yield np.asarray(v.new[t.offset + a : t.offset + min(a + step, t.numel)])


# --- measurements -------------------------------------------------------------------------------


def best_time(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    best, out = math.inf, None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def entropy_bits(values: np.ndarray) -> float:
    """Order-0 empirical entropy of ``values``, in bits (total over all values)."""
    _, counts = np.unique(values, return_counts=True)
    p = counts / counts.sum()
    return float(-(counts * np.log2(p)).sum())


def geometric_bits(k: int, n: int) -> float:
    """Entropy (bits) of ``k`` i.i.d. changes among ``n`` elements, per the binary entropy."""
    p = k / n
    if p >= 1.0:
        return 0.0
    return float(n * -(p * math.log2(p) + (1 - p) * math.log2(1 - p)))


def ordered(words: np.ndarray) -> np.ndarray:
    """bf16 words (sign-magnitude) as integers in value order."""
    w = words.astype(np.int64)
    return np.where(w & 0x8000, -(w & 0x7FFF), w)


@dataclass
class Row:
    name: str
    payload: int = 0
    changes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    codecs: dict[str, int] = field(default_factory=dict)
    timed: bool = True

    def as_dict(self) -> dict[str, Any]:
        k = max(self.changes, 1)
        return {
            "name": self.name,
            "bytes_per_change": self.payload / k,
            "payload_bytes": self.payload,
            "changes": self.changes,
            "encode_ns_per_change": self.encode_s / k * 1e9 if self.timed else None,
            "decode_ns_per_change": self.decode_s / k * 1e9 if self.timed else None,
            "codecs": self.codecs,
        }


Encode = Callable[[Frame], tuple[str, bytes]]


class Decoders:
    """Decodes any delta codec of either module into (positions, masks)."""

    def __init__(self) -> None:
        self.v1, self.v2 = FrameDecoder(), FrameDecoder2()

    def __call__(self, codec: str, data: bytes, f: Frame) -> tuple[np.ndarray, np.ndarray]:
        k = int(f.positions.size)
        if codec == "xor-sparse":
            return self.v1.sparse(data, f.n, 2, k)
        if codec == XOR_SPARSE2:
            return self.v2.sparse2(data, f.n, 2, k)
        words = np.empty(f.n, dtype=np.uint16)
        if codec == RAW_PLANES:
            self.v2.planes_into(data, words)
            words ^= f.old
        else:
            self.v1.into(data, words)
        pos = np.flatnonzero(words)
        return pos, words[pos]


def _v1_sparse(enc: FrameEncoder, f: Frame) -> tuple[str, bytes]:
    return "xor-sparse", enc.xor_sparse(f.positions, f.masks)


def _v2_sparse(enc: FrameEncoder2, bias: int | None, f: Frame) -> tuple[str, bytes]:
    low = (
        None if bias is None else choose_low_bits(f.positions.size, int(f.positions[-1]) + 1, bias)
    )
    return XOR_SPARSE2, enc.xor_sparse2(f.positions, f.masks, low_bits=low)


def _v1_delta(enc: FrameEncoder, f: Frame) -> tuple[str, bytes]:
    return enc.encode_delta(f.old, f.new, f.positions, masks=f.masks)


def _v2_delta(enc: FrameEncoder, f: Frame) -> tuple[str, bytes]:
    return enc.encode_delta(f.old, f.new, f.positions, masks=f.masks)


def delta_candidates(variants: bool) -> list[tuple[str, Encode, bool]]:
    """(name, encoder, timed): the codec choice of each module, and with ``variants`` the
    sparse codecs alone at other zstd levels and ``L`` biases (sizes only)."""
    out: list[tuple[str, Encode, bool]] = [
        ("v1 encode_delta, zstd 1 (today)", partial(_v1_delta, FrameEncoder(1)), True),
        ("v2 encode_delta, DEFAULT_PARAMS", partial(_v2_delta, FrameEncoder(codecs="v2")), True),
    ]
    if variants:
        for level in (3, 9):
            out.append(
                (f"v1 xor-sparse, zstd {level}", partial(_v1_sparse, FrameEncoder(level)), False)
            )
        for level in (1, 3):
            enc = FrameEncoder2(level)
            out.append((f"v2 xor-sparse2, zstd {level}", partial(_v2_sparse, enc, None), False))
        enc = FrameEncoder2()
        for bias in (1, 3, 4):
            out.append((f"v2 xor-sparse2, L bias {bias}", partial(_v2_sparse, enc, bias), False))
    return out


def measure_deltas(
    fs: list[Frame], repeat: int, variants: bool
) -> tuple[list[Row], dict[str, float]]:
    cands = delta_candidates(variants)
    rows = [Row(name, timed=timed) for name, _, timed in cands]
    decode = Decoders()
    floor_xor = floor_step = 0.0
    k_total = n_total = 0
    for f in fs:
        k = int(f.positions.size)
        k_total += k
        n_total += f.n
        gaps = geometric_bits(k, f.n)
        floor_xor += gaps + entropy_bits(f.masks)
        steps = ordered(f.new[f.positions]) - ordered(f.old[f.positions])
        floor_step += gaps + entropy_bits(steps)
        for row, (_, enc, timed) in zip(rows, cands, strict=True):
            t_enc, (codec, data) = best_time(partial(enc, f), repeat if timed else 1)
            row.payload += len(data)
            row.changes += k
            row.codecs[codec] = row.codecs.get(codec, 0) + 1
            if not timed:
                continue
            row.encode_s += t_enc
            t_dec, (pos, masks) = best_time(partial(decode, codec, data, f), repeat)
            row.decode_s += t_dec
            if not (np.array_equal(pos, f.positions) and np.array_equal(masks, f.masks)):
                raise SystemExit(f"{row.name}: decoded changes differ (not bit-exact)")
    k = max(k_total, 1)
    stats = {
        "frames": len(fs),
        "changes": k_total,
        "elements": n_total,
        "density": k_total / max(n_total, 1),
        "floor_xor_bytes_per_change": floor_xor / 8 / k,
        "floor_step_bytes_per_change": floor_step / 8 / k,
    }
    return rows, stats


def measure_anchor(v: Versions, max_frame_bytes: int, repeat: int) -> list[dict[str, Any]]:
    enc1, dec1 = FrameEncoder(1), FrameDecoder()
    enc2, dec2 = FrameEncoder2(), FrameDecoder2()
    res = {
        "v1 raw, zstd 1 (today)": [0, 0.0, 0.0],
        "v2 raw-planes, DEFAULT_PARAMS": [0, 0.0, 0.0],
    }
    dense = 0
    for words in anchor_frames(v, max_frame_bytes):
        dense += words.nbytes
        out = np.empty_like(words)
        for name, encode, decode in (
            ("v1 raw, zstd 1 (today)", enc1.raw, dec1.into),
            ("v2 raw-planes, DEFAULT_PARAMS", enc2.raw_planes, dec2.planes_into),
        ):
            t_enc, data = best_time(partial(encode, words), repeat)
            t_dec, _ = best_time(partial(decode, data, out), repeat)
            if not np.array_equal(out, words):
                raise SystemExit(f"{name}: anchor frame does not round-trip")
            acc = res[name]
            acc[0] += len(data)
            acc[1] += t_enc
            acc[2] += t_dec
    return [
        {
            "name": name,
            "ratio_to_dense": size / dense,
            "stored_bytes": size,
            "dense_bytes": dense,
            "encode_MBps": dense / t_enc / 1e6,
            "decode_MBps": dense / t_dec / 1e6,
        }
        for name, (size, t_enc, t_dec) in res.items()
    ]


# --- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workdir", default=str(default_workdir()))
    ap.add_argument("--size", default="medium", help="tiny, small, medium (cache key or model)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--versions", type=int, default=3, help="versions of the cached workload")
    ap.add_argument("--version", type=int, default=1, help="measure the delta to this version")
    ap.add_argument("--generate", action="store_true", help="ignore the cache, generate")
    ap.add_argument("--max-frame-bytes", type=int, default=16 * MiB)
    ap.add_argument("--thin", type=float, default=1.0, help="keep this fraction of changes")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variants", action="store_true", help="also zstd levels and L biases")
    ap.add_argument("--no-anchor", action="store_true")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if not 0 < args.thin <= 1:
        ap.error("--thin must be in (0, 1]")

    t0 = time.perf_counter()
    v = None if args.generate else cached(args)
    if v is None:
        if args.size == "medium" and not args.generate:
            print(f"no cached workload under {args.workdir}; generating {args.size} in memory")
        v = generated(args)
    fs = list(frames(v, args.max_frame_bytes, args.thin, args.seed))
    took = time.perf_counter() - t0
    print(f"workload: {v.source}, v{args.version - 1} -> v{args.version} ({took:.1f} s)")
    rows, stats = measure_deltas(fs, args.repeat, args.variants)
    print(
        f"{stats['changes']} changes in {stats['frames']} frames, density "
        f"{stats['density'] * 100:.3f}%, frames of {args.max_frame_bytes} bytes"
        + (f", thinned to {args.thin:g}" if args.thin < 1 else "")
    )
    print(f"{'delta codec':40} {'B/change':>9} {'enc ns/chg':>11} {'dec ns/chg':>11}  codecs")
    for row in rows:
        d = row.as_dict()
        enc = f"{d['encode_ns_per_change']:11.1f}" if row.timed else f"{'-':>11}"
        dec = f"{d['decode_ns_per_change']:11.1f}" if row.timed else f"{'-':>11}"
        print(f"{row.name:40} {d['bytes_per_change']:9.4f} {enc} {dec}  {row.codecs}")
    print(f"{'floor xor (order-0 gaps + XOR masks)':40} {stats['floor_xor_bytes_per_change']:9.4f}")
    print(
        f"{'floor step (gaps + old->new ulp step)':40} {stats['floor_step_bytes_per_change']:9.4f}"
    )
    anchors: list[dict[str, Any]] = []
    if not args.no_anchor:
        anchors = measure_anchor(v, args.max_frame_bytes, args.repeat)
        print(f"{'anchor codec':40} {'/dense':>9} {'enc MB/s':>11} {'dec MB/s':>11}")
        for a in anchors:
            print(
                f"{a['name']:40} {a['ratio_to_dense']:9.4f} {a['encode_MBps']:11.0f} "
                f"{a['decode_MBps']:11.0f}"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "workload": v.source,
                    "version": args.version,
                    "thin": args.thin,
                    "max_frame_bytes": args.max_frame_bytes,
                    "stats": stats,
                    "deltas": [r.as_dict() for r in rows],
                    "anchors": anchors,
                    "codecs": [XOR_SPARSE2, RAW_PLANES, XOR_DENSE],
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
