"""Rendering a :class:`~deltastore.bench.schema.BenchResult`: a markdown report with the
strongest baselines, the floors and the bar checks; ``docs/performance.md`` generated from a
results JSON (:func:`performance_doc`); an optional PNG (:mod:`deltastore.bench.plot`, here
as :func:`plot`).

Command line::

    python -m deltastore.bench.report RESULTS.json                  # the report, to stdout
    python -m deltastore.bench.report A.json [B.json ...] --performance-doc docs/performance.md

Pure functions of the result (thread-safe), except :func:`plot` (matplotlib's global state).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from deltastore.bench.crossover_report import (
    crossover_section,
    crossover_summary,
    is_crossover_json,
    load_crossover,
)
from deltastore.bench.crossover_schema import CrossoverResult
from deltastore.bench.fmt import measured as _measured
from deltastore.bench.fmt import nbytes as _bytes
from deltastore.bench.fmt import pct as _pct
from deltastore.bench.fmt import secs as _s
from deltastore.bench.fmt import table as _table
from deltastore.bench.fmt import times as _x
from deltastore.bench.limits import LIMITS_AND_PITFALLS
from deltastore.bench.plot import PlotUnavailable as PlotUnavailable
from deltastore.bench.plot import check_plot as check_plot
from deltastore.bench.plot import plot as plot
from deltastore.bench.schema import BASELINES, BenchResult, StoreResult, load_result
from deltastore.bench.signing_report import (
    is_signing_json,
    load_signing,
    signing_command,
    signing_section,
    signing_source,
    signing_summary,
)
from deltastore.bench.signing_schema import SigningResult
from deltastore.bench.trainer_report import (
    is_trainer_file,
    load_trainer_result,
    trainer_command,
    trainer_left,
    trainer_markdown,
    trainer_summary,
)
from deltastore.bench.trainer_schema import TrainerResult

#: The systems table's columns.
_HEAD = [
    "system", "payload", "B/changed", "publish s", "detect", "encode", "upload", "sync s",
    "fetch", "decode", "verify", "pause", "pub RSS+", "sub RSS+", "exact",
]  # fmt: skip


def _systems_table(s: StoreResult) -> list[str]:
    rows = []
    for name, r in s.systems.items():
        m, p, y = r.median, r.median.publish, r.median.sync
        rows.append(
            [
                name,
                _bytes(p.payload_bytes),
                f"{m.bytes_per_changed:.3f}",
                f"{p.total_s:.3f}",
                f"{p.detect_s:.3f}",
                f"{p.encode_s:.3f}",
                f"{p.upload_s:.3f}",
                f"{y.total_s:.3f}",
                f"{y.fetch_s:.3f}",
                f"{y.decode_s:.3f}",
                f"{y.verify_s:.3f}",
                f"{y.pause_s:.3f}",
                f"{_bytes(m.publisher_rss_extra_bytes)} ({_pct(m.publisher_rss_extra_fraction)})",
                f"{_bytes(m.subscriber_rss_extra_bytes)} ({_pct(m.subscriber_rss_extra_fraction)})",
                "yes" if r.exact else "NO",
            ]
        )
    return _table(_HEAD, rows)


def _methods_table(s: StoreResult) -> list[str]:
    """How each system publishes and loads; every method of a receiver that times several,
    the one reported marked."""
    rows = []
    for name, r in s.systems.items():
        if r.methods:
            loads = ", ".join(
                f"{'**' if m == r.method else ''}{m}{'**' if m == r.method else ''} "
                f"{res.median.total_s:.3f} s" + ("" if res.exact else " (NOT EXACT)")
                for m, res in r.methods.items()
            )
        else:
            loads = r.method
        use = (
            "ratios, bar" if name in BASELINES else "reported only" if name != "deltastore" else "-"
        )
        rows.append([name, r.publish_method, loads, use])
    return _table(["system", "publish", "sync methods (median s)", "compared in"], rows)


def _floors_table(s: StoreResult) -> list[str]:
    ds = s.systems.get("deltastore")
    if ds is None:
        return []
    rows = []
    if s.detect_bound_median_s is not None:
        rows.append(
            [
                "publish: chunked not_equal + flatnonzero (exact detect)",
                _s(s.detect_bound_median_s),
                f"publish {ds.median.publish.total_s:.3f}",
                _x(s.publish_bound_ratio),
            ]
        )
    fl = s.floors
    if fl is not None:
        parts = [
            statistics.median(getattr(f, k) for f in fl.samples)
            for k in ("decompress_s", "gather_s", "checksum_s", "scatter_s")
        ]
        rows.append(
            [
                "receiver: zstd decompress + gather + Adler-32 update + scatter "
                f"({' + '.join(f'{p:.3f}' for p in parts)})",
                _s(fl.receiver_floor_median_s),
                f"sync {ds.median.sync.total_s:.3f}",
                _x(fl.sync_floor_ratio),
            ]
        )
        rows.append(
            [
                "pause: one bare scatter",
                _s(fl.scatter_floor_median_s),
                f"pause {ds.median.sync.pause_s:.3f}",
                _x(fl.pause_floor_ratio),
            ]
        )
        rows += _memory_row(s)
    return _table(
        ["floor (medians; parts: medians each)", "floor s", "deltastore s", "ratio"], rows
    )


def _memory_row(s: StoreResult) -> list[list[str]]:
    """The memory floor's row of the floors table (none in documents without it)."""
    fl, ds = s.floors, s.systems["deltastore"]
    if fl is None or fl.memory_floor_median_s is None:
        return []
    parts = [
        statistics.median(getattr(f, k) or 0.0 for f in fl.samples)
        for k in ("pool_decompress_s", "rmw_s")
    ]
    threads = fl.samples[0].threads
    return [
        [
            f"memory: zstd decompress + one native XOR pass over the changed words, on "
            f"{threads} threads ({' + '.join(f'{p:.3f}' for p in parts)})",
            _s(fl.memory_floor_median_s),
            f"sync {ds.median.sync.total_s:.3f}",
            _x(fl.memory_floor_ratio),
        ]
    ]


def _beside_floors(s: StoreResult) -> list[str]:
    """Sentences on the payload against the XOR entropy floor, the CPU per change and the
    serving thread (each where the document has it)."""
    out = []
    fl, ds = s.floors, s.systems.get("deltastore")
    if ds is not None and fl is not None and fl.xor_entropy_floor_median is not None:
        gaps = statistics.median(
            (f.gap_entropy_bytes or 0) / f.changed_elements for f in fl.samples
        )
        masks = statistics.median(
            (f.mask_entropy_bytes or 0) / f.changed_elements for f in fl.samples
        )
        out.append(
            f"Payload: deltastore {ds.median.bytes_per_changed:.3f} B per changed element; the "
            f"XOR entropy floor (order-0 entropy of the gaps {gaps:.3f} + of the XOR masks "
            f"{masks:.3f}) {fl.xor_entropy_floor_median:.3f}; payload / floor "
            f"{_x(fl.payload_entropy_ratio)}."
        )
    if s.cpu_per_change_s is not None:
        rmw = fl.rmw_per_change_median_s if fl is not None else None
        out.append(
            f"CPU per change: deltastore's subscriber process {s.cpu_per_change_s * 1e9:.2f} ns "
            "(user + system, every thread)"
            + (f"; the memory floor's XOR pass {rmw * 1e9:.2f} ns (wall)." if rmw else ".")
        )
    sv = s.serving
    if sv is not None:
        progress = "-" if sv.progress_median is None else f"{sv.progress_median:.2f}"
        out.append(
            f"Serving thread (pure Python, in the subscriber's process) during a sync / idle: "
            f"{progress} (median); those syncs took {sv.sync_median_s:.3f} s, "
            f"{_x(sv.sync_slowdown)} the measured syncs (which run without it)."
        )
    return [" ".join(out), ""] if out else []


def _requests_table(s: StoreResult) -> list[str]:
    """Store requests per operation (medians) and how many ran one after the other."""
    rows = []
    for name, r in s.systems.items():
        y, p = r.median.sync, r.median.publish
        if y.requests is None:
            continue
        rows.append(
            [
                name,
                f"{y.requests} / {y.round_trips}",
                "-" if p.requests is None else f"{p.requests} / {p.round_trips}",
                "-" if p.commit_round_trips is None else str(p.commit_round_trips),
                "-" if r.poll_requests is None else f"{r.poll_requests} / {r.poll_round_trips}",
            ]
        )
    if not rows:
        return []
    head = ["system", "sync: requests / round trips", "publish", "after the data", "poll"]
    return _table(head, rows)


def _link_line(s: StoreResult) -> list[str]:
    """The shaped link and the floors it sets, beside the measured medians."""
    if s.link is None:
        return []
    k = s.link
    dense, ds = s.systems.get("dense"), s.systems.get("deltastore")
    parts = [
        f"Through the shaped link `{k.name}`: {k.latency_s * 1e3:g} ms per request, "
        f"{k.conn_bits_per_s / 1e9:g} Gbit/s per connection and {k.total_bits_per_s / 1e9:g} "
        "Gbit/s in total, each way."
    ]
    if dense is not None:
        t = dense.median.sync.total_s
        parts.append(
            f"Its floor for dense (one request, the model's bytes): {k.dense_floor_s:.2f} s; "
            f"dense took {t:.2f} s ({t / k.dense_floor_s:.2f}x its floor)."
        )
    if ds is not None and k.deltastore_floor_s is not None:
        t = ds.median.sync.total_s
        parts.append(
            "Its floor for deltastore (two requests one after the other, the payload): "
            f"{k.deltastore_floor_s:.3f} s; deltastore took {t:.3f} s "
            f"({t / k.deltastore_floor_s:.2f}x its floor, the receiver's own work included)."
        )
    return [" ".join(parts), ""]


def _store_section(s: StoreResult) -> list[str]:
    out = [f"### Store: {s.store}", "", *_link_line(s), *_systems_table(s), ""]
    out += [*_methods_table(s), ""]
    requests = _requests_table(s)
    if requests:
        out += [*requests, ""]
    dense = s.systems.get("dense")
    if dense is not None:
        out += [
            f"Strongest dense: `{dense.method}` (the fastest by median sync of the methods "
            f"timed), published by `{dense.publish_method}`. Every ratio and bar point uses it"
            + ("; `dense-naive` is reported only." if "dense-naive" in s.systems else ".")
            + "",
            "",
        ]
    floors = _floors_table(s)
    if floors:
        out += [*floors, ""]
    out += _beside_floors(s)
    notes = []
    if s.pause_fraction is not None:
        notes.append(f"deltastore pause / sync {_pct(s.pause_fraction)}")
    if s.anchor_bytes is not None:
        notes.append(
            f"anchor {_bytes(s.anchor_bytes)} stored = {_pct(s.anchor_fraction)} of dense bf16"
        )
    if notes:
        line = "; ".join(notes)
        out += [line[0].upper() + line[1:] + ".", ""]
    if s.ratios:
        rows = [
            [
                f"{b} / deltastore",
                _x(r.payload),
                _x(r.publish),
                _x(r.sync),
                _x(r.publisher_rss),
                _x(r.subscriber_rss),
            ]
            for b, r in s.ratios.items()
        ]
        out += _table(["ratio", "payload", "publish", "sync", "pub RSS+", "sub RSS+"], rows)
        out.append("")
    return out


def _machine(result: BenchResult) -> str:
    m = result.machine
    return (
        f"{m.cpu_model}, {m.cores} cores, {_bytes(m.memory_bytes)} RAM, {m.platform}; "
        f"python {m.python}, torch {m.torch}, numpy {m.numpy}, zstandard {m.zstandard}, "
        f"safetensors {m.safetensors}, deltastore {m.deltastore}"
    )


def _bar_table(result: BenchResult) -> list[str]:
    rows = [
        [
            b.name,
            b.store or "-",
            _measured(b.measured, b.op, b.threshold),
            "-" if b.op == "report" else f"{b.op} {b.threshold:g}",
            {"pass": "pass", "fail": "FAIL"}.get(b.status, b.status),
        ]
        for b in result.bars
    ]
    return _table(["check", "store", "measured", "bar", "result"], rows)


def markdown(result: BenchResult, level: int = 2) -> str:
    """The report: workload, per store the systems, methods, floors and ratios, scaling and
    the bar checks. ``level``: the heading level of its title (sections one deeper)."""
    w = result.workload
    h, hh = "#" * level, "#" * (level + 1)
    changed = ", ".join(_pct(f) for f in w.changed_fraction)
    out = [
        f"{h} deltastore bench: {w.size}, {w.elements / 1e6:.0f}M bf16 elements "
        f"({_bytes(w.dense_bytes)}), lr {w.lr:g}, {w.versions} measured versions",
        "",
        f"Changed per version: {changed}. Machine: {_machine(result)}. {result.created}, "
        f"wall {result.wall_s:.0f} s. Medians over the measured versions; times in seconds; "
        "RSS+ is peak extra resident memory (share of the model's bytes).",
        "",
    ]
    for s in result.stores:
        out += [line.replace("### ", hh + " ", 1) for line in _store_section(s)]
    for line in result.skipped:
        out += [f"Skipped store {line}", ""]
    sc = result.scaling
    if sc is not None:
        line = (
            f"deltastore sync of {sc.changed_elements} changed elements (store {sc.store}): "
            f"{sc.small.size} {sc.small.median_s:.3f} s"
        )
        if sc.target.size == sc.small.size:
            line += " (the benchmarked size is small: nothing to compare, the check is n/a)."
        else:
            line += f", {sc.target.size} {sc.target.median_s:.3f} s, ratio {sc.ratio:.2f}."
        out += [f"{hh} Scaling", "", line, ""]
    out += [f"{hh} The bar", "", *_bar_table(result)]
    out += ["", "All receivers bit-exact." if result.exact else "MISMATCH: some receiver differs."]
    return "\n".join(out) + "\n"


def _link(target: str | os.PathLike[str], doc: str | os.PathLike[str]) -> str:
    """``target`` as a relative link from the folder of ``doc``."""
    return Path(os.path.relpath(Path(target).resolve(), Path(doc).resolve().parent)).as_posix()


def _summary(result: BenchResult) -> list[str]:
    """One line per store: the headline numbers against the strongest baselines and floors."""
    out = []
    for s in result.stores:
        ds, dense = s.systems.get("deltastore"), s.systems.get("dense")
        if ds is None:
            continue
        parts = [f"sync {ds.median.sync.total_s:.3f} s"]
        if dense is not None and "dense" in s.ratios:
            parts.append(
                f"strongest dense (`{dense.method}`) {dense.median.sync.total_s:.3f} s, "
                f"dense / deltastore {_x(s.ratios['dense'].sync)}"
            )
        if s.link is not None and s.link.deltastore_floor_s:
            t = ds.median.sync.total_s
            parts.append(
                f"sync / the link's floor ({s.link.deltastore_floor_s:.3f} s) "
                f"{_x(t / s.link.deltastore_floor_s)}"
            )
        if ds.median.sync.round_trips is not None:
            parts.append(
                f"{ds.median.sync.round_trips} round trips per sync, "
                f"{ds.poll_requests} request{'' if ds.poll_requests == 1 else 's'} per poll"
            )
        if s.floors is not None:
            parts.append(f"sync / receiver floor {_x(s.floors.sync_floor_ratio)}")
            if s.floors.memory_floor_ratio is not None:
                parts.append(f"sync / memory floor {_x(s.floors.memory_floor_ratio)}")
            parts.append(f"pause / scatter floor {_x(s.floors.pause_floor_ratio)}")
            if s.floors.payload_entropy_ratio is not None:
                parts.append(f"payload / XOR entropy floor {_x(s.floors.payload_entropy_ratio)}")
        if s.serving is not None and s.serving.progress_median is not None:
            parts.append(f"serving thread progress {s.serving.progress_median:.2f}")
        parts.append(f"publish / detect floor {_x(s.publish_bound_ratio)}")
        out.append(f"- **{s.store}**: " + "; ".join(parts) + ".")
    passed = sum(b.status == "pass" for b in result.bars)
    na = sum(b.status == "n/a" for b in result.bars)
    reported = sum(b.status == "reported" for b in result.bars)
    counted = len(result.bars) - na - reported
    na_text = f"; {na} not applicable to this run" if na else ""
    na_text += f"; {reported} reported without a bar" if reported else ""
    out.append(f"- The bar: {passed} of {counted} checks pass ({_failing(result)}{na_text}).")
    return out


def _failing(result: BenchResult) -> str:
    failed = [
        f"{b.name}" + (f" ({b.store})" if b.store else "")
        for b in result.bars
        if b.status == "fail"
    ]
    return "failing: " + ", ".join(failed) if failed else "none fails"


def _left(result: BenchResult) -> list[str]:
    """One line per failing check: what was measured against which bar."""
    out = [
        f"- **{b.name}**{f' ({b.store})' if b.store else ''}: "
        f"{_measured(b.measured, b.op, b.threshold)}, bar {b.op} {b.threshold:g} ({b.what})."
        for b in result.bars
        if b.status == "fail"
    ]
    if not result.exact:
        out.append("- **bit-exactness**: some receiver differs from the workload.")
    return out or ["Every check of the bar passes."]


def _command(result: BenchResult, source: str | os.PathLike[str]) -> str:
    """The ``deltastore bench`` command line of a run."""
    stores = ",".join(s.store.split("+", 1)[0] for s in result.stores)
    links = {s.link.name for s in result.stores if s.link is not None}
    link = f" --link {links.pop()}" if links else ""
    return (
        f".venv/bin/deltastore bench --size {result.workload.size} --store {stores}{link} "
        f"--json {Path(source).as_posix()}"
    )


def _label(result: BenchResult) -> str:
    """A run's name on the page: its size and how its object stores were reached."""
    links = sorted({s.link.name for s in result.stores if s.link is not None})
    how = f"through the `{', '.join(links)}` link" if links else "loopback"
    return f"{result.workload.size}, {how}"


def performance_doc(
    runs: Sequence[tuple[BenchResult, str | os.PathLike[str]]],
    doc: str | os.PathLike[str] = "docs/performance.md",
    trainers: Sequence[tuple[TrainerResult, str | os.PathLike[str]]] = (),
    crossovers: Sequence[tuple[CrossoverResult, str | os.PathLike[str]]] = (),
    signings: Sequence[tuple[SigningResult, str | os.PathLike[str]]] = (),
) -> str:
    """``docs/performance.md`` from results JSONs, each a ``(result, path)``: where the numbers
    come from, a summary, what is left, each run's full report (every system, the strongest
    baselines named, the floors, ratios, each check; a run through a shaped link beside the
    loopback one), the machines, and the measured limits the code rests on. ``trainers``:
    trainer-in-the-loop runs (``--mode trainer``), each with its summary, what is left and its
    report; ``crossovers``: crossover runs (``--mode crossover``); ``signings``: signing runs
    (``--mode signing``), each with its summary line and its "Signing" section. Links are
    relative to ``doc``, the path the page is written to."""
    if not runs:
        raise ValueError("performance_doc needs at least one run")
    readme = _link(Path(__file__).resolve().parents[2] / "benchmarks" / "README.md", doc)
    every = [*runs, *trainers, *crossovers, *signings]
    sources = " ".join(Path(src).as_posix() for _, src in every)
    listed = (
        [
            f"- {_label(r)}: `deltastore bench --size {r.workload.size}`, {r.workload.versions} "
            f"AdamW versions of a {r.workload.elements / 1e6:.0f}M-element bf16 model, "
            f"[{Path(src).name}]({_link(src, doc)}) (schema version {r.schema_version}, "
            f"{r.created[:10]}); machine: {_machine(r)}."
            for r, src in runs
        ]
        + [
            f"- trainer in the loop, {t.size}, AdamW {t.optimizer}: `deltastore bench --mode "
            f"trainer --optimizer {t.optimizer}`, {t.versions} "
            f"AdamW {t.optimizer} steps of a {t.elements / 1e6:.0f}M-parameter fp32 trainer, each "
            f"followed by a publish, [{Path(src).name}]({_link(src, doc)}) ({t.created[:10]})."
            for t, src in trainers
        ]
        + [
            f"- crossover density, {c.size}: `deltastore bench --mode crossover --size {c.size}`, "
            f"[{Path(src).name}]({_link(src, doc)}) ({c.created[:10]})."
            for c, src in crossovers
        ]
        + [signing_source(g, src, _link(src, doc)) for g, src in signings]
    )
    out = [
        "# Performance",
        "",
        "<!-- Generated by `python -m deltastore.bench.report "
        f"{sources} --performance-doc {Path(doc).as_posix()}`; do not edit by hand. -->",
        "",
        "Every number on this page comes from the committed results JSONs of these runs of "
        "`deltastore bench`, and nothing else: method, workload, systems, floors, the shaped "
        f"link and every field are described in [benchmarks/README.md]({readme}). Within a run, "
        "all systems ran on the same versions through the same stores, each publisher and "
        "subscriber in a process of its own; every ratio is from one run.",
        "",
        *listed,
        "",
        "Regenerate after new runs:",
        "",
        "```sh",
        *[_command(r, src) for r, src in runs],
        *[trainer_command(t, src) for t, src in trainers],
        *[signing_command(g, src) for g, src in signings],
        f".venv/bin/python -m deltastore.bench.report {sources} "
        f"--performance-doc {Path(doc).as_posix()}",
        "```",
        "",
        "## Summary",
        "",
    ]
    for r, _ in runs:
        out += [f"### {_label(r)}", "", *_summary(r), ""]
    for t, _ in trainers:
        out += [f"### trainer in the loop, {t.size}, AdamW {t.optimizer}", ""]
        out += [*trainer_summary(t), ""]
    out += [crossover_summary(c) for c, _ in crossovers] + ([""] if crossovers else [])
    out += [signing_summary(g) for g, _ in signings] + ([""] if signings else [])
    out += ["## What is left", ""]
    for r, _ in runs:
        out += [f"### {_label(r)}", "", *_left(r), ""]
    for t, _ in trainers:
        left = trainer_left(t) or ["Every check of the trainer bar passes."]
        out += [f"### trainer in the loop, {t.size}, AdamW {t.optimizer}", "", *left, ""]
    for r, _ in runs:
        out += [f"## Results: {_label(r)} ({r.created[:10]})", ""]
        out += [markdown(r, level=3).rstrip("\n"), ""]
    for t, _ in trainers:
        out += [
            f"## Results: trainer in the loop, {t.size}, AdamW {t.optimizer} ({t.created[:10]})",
            "",
        ]
        out += [trainer_markdown(t, level=3).rstrip("\n"), ""]
    for c, _ in crossovers:
        out += [*crossover_section(c), ""]
    for g, _ in signings:
        out += [*signing_section(g), ""]
    out += ["## Measured limits and pitfalls", "", LIMITS_AND_PITFALLS.strip(), ""]
    return "\n".join(out)


# --- command line --------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m deltastore.bench.report RESULTS.json [...] [--performance-doc PATH]``."""
    parser = argparse.ArgumentParser(
        prog="python -m deltastore.bench.report",
        description="Render a deltastore bench results JSON: the markdown report to stdout, "
        "or docs/performance.md generated from it.",
    )
    parser.add_argument(
        "results", type=Path, nargs="+", help="results JSONs (deltastore bench --json)"
    )
    parser.add_argument(
        "--performance-doc",
        type=Path,
        metavar="PATH",
        help="write the performance page (e.g. docs/performance.md) from every results JSON "
        "given, in order, instead of printing the reports",
    )
    args = parser.parse_args(argv)
    try:
        trainers = [(load_trainer_result(p), p) for p in args.results if is_trainer_file(p)]
        crossovers = [(load_crossover(p), p) for p in args.results if is_crossover_json(p)]
        signings = [(load_signing(p), p) for p in args.results if is_signing_json(p)]
        other = (is_trainer_file, is_crossover_json, is_signing_json)
        runs = [(load_result(p), p) for p in args.results if not any(f(p) for f in other)]
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.performance_doc is None:
        texts = [markdown(r) for r, _ in runs] + [trainer_markdown(t) for t, _ in trainers]
        sys.stdout.write("\n".join(texts))
    else:
        args.performance_doc.write_text(
            performance_doc(runs, args.performance_doc, trainers, crossovers, signings)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
