"""The signing runs' part of the performance page (``deltastore bench --mode signing``):
recognizing and loading their JSONs, the page's source line, regenerate command and summary
line of a run, and its short "Signing" section (per store, the on / off ratios by the medians
and the minimums, the extra time, the floor signing adds, each side's spread).

Every number is read from the :class:`~deltastore.bench.signing_schema.SigningResult` and
formatted as the run's own report (:func:`deltastore.bench.signing.signing_markdown`) does:
times in milliseconds (:func:`~deltastore.bench.signing.ms`), ratios ``on / off`` to three
decimals, spreads (:func:`~deltastore.bench.signing.spread`) to two. Pure functions;
thread-safe.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pydantic import ValidationError

from deltastore.bench.fmt import nbytes, table
from deltastore.bench.signing import DEFAULT_LR, ms, spread
from deltastore.bench.signing_schema import Comparison, Floors, SigningResult, StoreSigning

#: The defaults of ``deltastore bench --mode signing`` that a command line may leave out.
_DEFAULTS = {"lr": DEFAULT_LR, "seed": 0, "warmup": 1}


def is_signing_json(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file holding a signing run's JSON (``"mode": "signing"``)."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        return bool(json.loads(p.read_text()).get("mode") == "signing")
    except (ValueError, AttributeError):
        return False


def load_signing(path: str | os.PathLike[str]) -> SigningResult:
    """A signing results JSON; :class:`ValueError` when it does not validate."""
    try:
        return SigningResult.model_validate_json(Path(path).read_text())
    except ValidationError as exc:
        raise ValueError(
            f"{path} is not a signing results JSON of schema version 1: "
            f"{exc.error_count()} errors, first: {exc.errors()[0]['loc']}"
        ) from None


def _stores(result: SigningResult) -> str:
    """The ``--store`` argument of the run: its stores' labels, a shaped link's name cut."""
    return ",".join(s.store.split("+", 1)[0] for s in result.stores)


def signing_command(result: SigningResult, source: str | os.PathLike[str]) -> str:
    """The ``deltastore bench --mode signing`` command line of a run (``--lr``, ``--seed``
    and ``--warmup`` only where the run's differ from the defaults)."""
    extra = "".join(
        f" --{k} {getattr(result, k):g}" for k, v in _DEFAULTS.items() if getattr(result, k) != v
    )
    return (
        f".venv/bin/deltastore bench --mode signing --size {result.size} --store "
        f"{_stores(result)} --repeats {result.repeats}{extra} --json {Path(source).as_posix()}"
    )


def signing_source(result: SigningResult, source: str | os.PathLike[str], link: str) -> str:
    """The page's line naming the run and its JSON (``link``: the JSON, relative to the
    page)."""
    return (
        f"- signing cost, {result.size}: `deltastore bench --mode signing --size {result.size}`"
        f", {result.repeats} interleaved rounds, store{'s' if len(result.stores) > 1 else ''} "
        f"{', '.join(s.store for s in result.stores)}, [{Path(source).name}]({link}) "
        f"({result.created[:10]})."
    )


def signing_summary(result: SigningResult) -> str:
    """One line: per store, each operation's on / off ratio by the medians / the minimums."""
    parts = [
        f"**{s.store}** "
        + ", ".join(f"{c.name} {c.ratio_median:.3f}x / {c.ratio_min:.3f}x" for c in s.comparisons)
        for s in result.stores
    ]
    return (
        f"- signing cost ({result.size}; on / off, Ed25519 + per-frame BLAKE3 vs unsigned, by "
        f"the medians / the minimums): {'; '.join(parts)}."
    )


def _floor_parts(c: Comparison, floor: Floors) -> str:
    """``82.7 + 0.54 + 0.31 = 83.5 ms``: BLAKE3 of the payload, the canonical bytes and the
    signature (publish) or check (sync), medians each, and their sum (the comparison's
    ``floor_s``)."""
    last = floor.sign if c.op == "publish" else floor.verify
    parts = (floor.blake3, floor.canonical, last)
    return " + ".join(ms(t.median_s).removesuffix(" ms") for t in parts) + f" = {ms(c.floor_s)}"


def _store_table(s: StoreSigning) -> list[str]:
    """One row per comparison: payload, the unsigned median, the ratios, the extra time, the
    floor beside it and each side's spread."""
    floors = {f.version: f for f in s.floors}
    rows = [
        [
            c.name,
            nbytes(c.payload_bytes),
            f"{c.off.median_s:.4f}",
            f"{c.ratio_median:.3f}",
            f"{c.ratio_min:.3f}",
            ms(c.extra_median_s, signed=True),
            _floor_parts(c, floors[c.version]),
            f"{spread(c.off):.2f} / {spread(c.on):.2f}",
        ]
        for c in s.comparisons
    ]
    head = ["operation", "payload", "off median s", "on/off median", "on/off min", "on - off"]
    head += ["floor: BLAKE3 + canonical bytes + sign / verify", "spread off / on"]
    return table(head, rows)


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO"


def signing_section(result: SigningResult) -> list[str]:
    """The run's section of the page: a ``## Signing`` heading, the method in one sentence,
    what the columns mean, and per store (``###``) its table and what its manifests carry."""
    load = " and ".join(f"{x:.1f}" for x in result.load_average) or "not recorded"
    out = [
        f"## Signing: {result.size} ({result.created[:10]})",
        "",
        f"The same publishes and syncs of a {result.elements / 1e6:.0f}M-element bf16 model "
        "(its anchor, version 0, and one AdamW step later the delta, "
        f"{100 * result.density:.2f}% of the elements changed), each the whole "
        "`Publisher.publish` / `Subscriber.sync` call, ran unsigned (off) and signed (on: an "
        "Ed25519 signature over the manifest's canonical bytes and a BLAKE3 of every stored "
        "frame, written by the publisher and checked by the subscriber) in "
        f"{result.repeats} interleaved rounds, the side going first alternating. "
        "On / off of the medians and of the minimums (above 1: signing is slower); on - off "
        "of the medians; the floor is the least signing adds, medians in ms each; spread is "
        "each side's largest sample over its smallest, and a ratio nearer 1 than it is within "
        f"the run's noise. Load average {load} (start, end); machine: "
        f"{result.machine.cpu_model}, {result.machine.cores} cores.",
        "",
    ]
    for s in result.stores:
        out += [f"### {s.store}", "", *_store_table(s), ""]
        out += [
            f"Signed manifests carry an Ed25519 signature and per-frame BLAKE3: {_yes(s.signed)}"
            f"; unsigned ones neither: {_yes(s.unsigned)}; every sync bit-exact: "
            f"{_yes(s.exact)}.",
            "",
        ]
    out += [f"- skipped store {line}" for line in result.skipped]
    return out[:-1] if out[-1] == "" else out


__all__ = [
    "is_signing_json",
    "load_signing",
    "signing_command",
    "signing_section",
    "signing_source",
    "signing_summary",
]
