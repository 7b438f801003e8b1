"""Rendering a :class:`~deltastore.bench.trainer_schema.TrainerResult`: the markdown report of a
trainer-in-the-loop run (``deltastore bench --mode trainer``) and its section of
``docs/performance.md`` (:func:`deltastore.bench.report.performance_doc` calls these).

Pure functions of the result; thread-safe.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from deltastore.bench.trainer_schema import PublisherRun, TrainerResult


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _opt(v: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if v is None else fmt.format(v)


def is_trainer_json(raw: str) -> bool:
    """Whether a results JSON is a trainer-in-the-loop run (``"mode": "trainer"``)."""
    try:
        data: Any = json.loads(raw)
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("mode") == "trainer"


def _row(key: str, run: PublisherRun, bf16: int) -> list[str]:
    m = run.median
    if m is None:
        return [key, run.method, f"not available: {run.error}"] + ["-"] * 10
    return [
        key,
        run.method + ("" if run.allocator == "glibc default" else f"; {run.allocator}"),
        f"{m.step_s:.3f} ({m.step_min_s:.3f})",
        f"{m.publish_s:.3f} ({m.publish_min_s:.3f})",
        f"{m.ratio:.2f} ({m.min_ratio:.2f})",
        f"{m.floor_s:.3f}",
        _opt(m.kernel_s),
        _mb(m.payload_bytes),
        f"{_mib(m.rss_extra_max_bytes)} ({100 * m.rss_extra_max_bytes / bf16:.1f}%)",
        _mib(m.step_rss_extra_max_bytes),
        _mib(run.code_rss_bytes),
        {True: "yes", False: "NO", None: "-"}[run.exact],
    ]


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _samples(run: PublisherRun) -> list[str]:
    rows = [
        [
            str(s.version),
            f"{s.step_s:.3f}",
            f"{s.publish_s:.3f}",
            f"{s.ratio:.2f}",
            _opt(s.cast_s),
            f"{s.floor_s:.3f}",
            _opt(s.kernel_s),
            str(s.changed_elements),
            str(s.payload_bytes),
            _mib(s.rss_extra_bytes),
            _opt(s.uncertain, "{}"),
            _opt(s.blocks_raw, "{}"),
        ]
        for s in run.samples
    ]
    head = ["version", "step s", "publish s", "ratio", "cast s", "floor s", "kernel s"]
    head += ["changed", "payload B", "RSS+", "uncertain", "blocks raw"]
    return _table(head, rows)


def _passes(result: TrainerResult, hh: str) -> list[str]:
    """The snapshot-free publish's passes over the model, medians over the versions."""
    run = result.runs.get("none")
    if run is None or not run.samples or not run.samples[0].passes_s:
        return []
    names = list(run.samples[0].passes_s)
    m = run.median
    rows = []
    for name in names:
        t = statistics.median(s.passes_s.get(name, 0.0) for s in run.samples)
        rows.append([name, f"{t:.3f}", f"{1e9 * t / result.elements:.2f}"])
    lines = [
        f"{hh} Where the snapshot-free publish goes",
        "",
        "Each pass that publish makes over the model, timed on its own on one thread after the "
        "publish (medians over the versions); the publisher runs its frames on two threads.",
        "",
        *_table(["pass (one thread)", "s", "ns per element"], rows),
        "",
    ]
    bar = next((b.threshold for b in result.bars if "optimizer.step()" in b.name), None)
    if m is not None and bar is not None:
        lines += [
            f"Beside them: the whole publish {m.publish_min_s:.3f} s (fastest) on two threads, "
            f"the fastest step {m.step_min_s:.3f} s, the bar {bar * m.step_min_s:.3f} s "
            f"({bar:g}x the step).",
            "",
        ]
    return lines


def trainer_markdown(result: TrainerResult, level: int = 2) -> str:
    """The report: the run, per publisher the medians and every version, the bar."""
    h, hh = "#" * level, "#" * (level + 1)
    m = result.machine
    out = [
        f"{h} deltastore bench --mode trainer: {result.size}, {result.elements / 1e6:.0f}M "
        f"fp32 parameters ({_mb(result.bf16_bytes)} as bf16), AdamW {result.optimizer}, "
        f"lr {result.lr:g}, weight decay {result.weight_decay:g}, {result.versions} versions",
        "",
        f"Size: {result.size_reason}. Machine: {m.cpu_model}, {m.cores} cores, "
        f"{m.memory_bytes / 1e9:.2f} GB RAM; torch {m.torch} on {result.threads} threads, "
        f"numpy {m.numpy}, deltastore {m.deltastore}. {result.created}, wall "
        f"{result.wall_s:.0f} s"
        + (
            f" (1-minute load average {result.load_average[0]:.1f} at the start, "
            f"{result.load_average[-1]:.1f} at the end)"
            if result.load_average
            else ""
        )
        + ". Each publisher ran in a process of its own with the same "
        f"seeded steps ({result.warmup} warm-up steps, then the anchor, then the measured "
        "versions); "
        + (
            "every run made the same versions (equal digests)."
            if result.same_versions
            else "THE RUNS MADE DIFFERENT VERSIONS."
        ),
        "",
        f"Memory: {result.rss_method}.",
        "",
        f"{hh} Medians",
        "",
    ]
    head = ["publisher", "method", "step s (fastest)", "publish s (fastest)"]
    head += ["publish / step (fastest / fastest)", "read floor s"]
    head += ["kernel s", "payload", "extra peak RSS (of bf16)", "step RSS+", "code RSS", "exact"]
    rows = [_row(k, r, result.bf16_bytes) for k, r in result.runs.items()]
    out += _table(head, rows)
    out += [
        "",
        "Medians over the versions, the fastest in parentheses (other load on the machine only "
        "adds time: the bar uses the fastest publish / the fastest step). "
        "Read floor: one read of every fp32 weight and both moments (a sum over each), timed "
        "after the publish. Kernel: the AdamW inverse alone over every parameter "
        "(`Inversion.chunks`). Step RSS+: the optimizer step's own peak over the same baseline. "
        "Code RSS: importing the publisher (and numba with the compiled kernel), before the "
        "baseline.",
        "",
    ]
    if result.payload_ratio is not None:
        out += [f"Payload snapshot-free / memory snapshot: {result.payload_ratio:.4f}.", ""]
    out += _passes(result, hh)
    for key, run in result.runs.items():
        if run.samples:
            out += [f"{hh} Every version: {key}", "", *_samples(run), ""]
    rows = [
        [
            b.name,
            "-" if b.measured is None else f"{b.measured:.4g}",
            f"{b.op} {b.threshold:g}",
            {"pass": "pass", "fail": "FAIL"}.get(b.status, b.status),
        ]
        for b in result.bars
    ]
    out += [f"{hh} The bar", "", *_table(["check", "measured", "bar", "result"], rows), ""]
    out.append("All receivers bit-exact." if result.exact else "MISMATCH: some receiver differs.")
    return "\n".join(out) + "\n"


def trainer_summary(result: TrainerResult) -> list[str]:
    """Summary lines for the performance page."""
    out = []
    for key, run in result.runs.items():
        m = run.median
        if m is None:
            out.append(f"- **{key}**: not available ({run.error}).")
            continue
        out.append(
            f"- **{key}**: publish {m.publish_s:.3f} s per version "
            f"(fastest {m.publish_min_s:.3f}), "
            f"{m.min_ratio:.2f}x the fastest `optimizer.step()` ({m.step_min_s:.3f} s; median "
            f"of the per-version ratios {m.ratio:.2f}); extra peak RSS "
            f"{_mib(m.rss_extra_max_bytes)} ({100 * m.rss_extra_max_bytes / result.bf16_bytes:.1f}"
            f"% of the bf16 model); payload {_mb(m.payload_bytes)}."
        )
    passed = sum(b.status == "pass" for b in result.bars)
    failing = [b.name for b in result.bars if b.status == "fail"]
    out.append(
        f"- The bar: {passed} of {len(result.bars)} checks pass"
        + (f" (failing: {', '.join(failing)})." if failing else ".")
    )
    return out


def trainer_left(result: TrainerResult) -> list[str]:
    """One line per failing check of the trainer bar."""
    return [
        f"- **{b.name}**: {_opt(b.measured, '{:.4g}')}, bar {b.op} {b.threshold:g} ({b.what})."
        for b in result.bars
        if b.status == "fail"
    ]


def trainer_command(result: TrainerResult, source: str | os.PathLike[str]) -> str:
    """The command line of a trainer run."""
    return (
        f".venv/bin/deltastore bench --mode trainer --size {result.size} --versions "
        f"{result.versions} --warmup {result.warmup} --optimizer {result.optimizer} "
        f"--json {Path(source).as_posix()}"
    )


def is_trainer_file(path: Path) -> bool:
    """Whether ``path`` is a file holding a trainer-in-the-loop results JSON."""
    return path.is_file() and is_trainer_json(path.read_text())


def load_trainer_result(path: str | os.PathLike[str]) -> TrainerResult:
    """A trainer-in-the-loop results JSON (``deltastore bench --mode trainer --json``)."""
    try:
        return TrainerResult.model_validate_json(Path(path).read_text())
    except ValidationError as exc:
        raise ValueError(
            f"{path} is not a trainer results JSON of schema version 1: "
            f"{exc.error_count()} errors, first: {exc.errors()[0]['loc']}: "
            f"{exc.errors()[0]['msg']}"
        ) from None
