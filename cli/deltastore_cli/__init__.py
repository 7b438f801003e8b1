"""The ``deltastore`` command: a thin typer layer over the library.

Every command calls one library function and formats its result; errors become one line on
stderr and the exit codes in ``docs/cli.md``.
"""

from __future__ import annotations

import dataclasses
import enum
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from deltastore._version import __version__
from deltastore_cli.common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_MISMATCH,
    RUN,
    Settings,
    err_console,
    handle_errors,
    human_bytes,
    out_console,
    parse_storage_options,
    print_json,
    progress_bar,
    report_interrupt,
    settings,
    settle,
    setup_logging,
)
from deltastore_cli.help import Command, Group

if TYPE_CHECKING:  # the library is imported inside each command: --help never imports torch
    from deltastore.publish.publisher import PublishReport
    from deltastore.sync.subscriber import SyncReport

app = typer.Typer(
    cls=Group,  # every command is declared with cls=Command (see deltastore/cli/_help.py)
    help="Move model weights through shared storage, sending only what changed.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

StoreArg = Annotated[str, typer.Argument(help="Store: a local folder, file:// or fsspec URL.")]
StorageOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--storage-option",
        "-o",
        metavar="KEY=VALUE",
        help="Passed to the store's filesystem (repeatable; VALUE is JSON if it parses).",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
TimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--timeout",
        min=0.001,
        metavar="SECONDS",
        help="Give up a store operation after this long, retries included (each retry is "
        "logged on stderr).",
        show_default="120 s",
    ),
]


class Size(str, enum.Enum):
    """Synthetic model sizes for the demo."""

    tiny = "tiny"
    small = "small"
    medium = "medium"


class BenchSize(str, enum.Enum):
    """Synthetic model sizes for the benchmark."""

    small = "small"
    medium = "medium"
    large = "large"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"deltastore {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
    verbose: Annotated[
        int,
        typer.Option("--verbose", "-v", count=True, help="More logging (-vv: debug); tracebacks."),
    ] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars.")] = False,
) -> None:
    """deltastore: publish and pull model versions through a store."""
    ctx.obj = Settings(verbose=verbose, quiet=quiet)
    setup_logging(verbose)


def _report_json(report: PublishReport | SyncReport) -> dict[str, Any]:
    return dataclasses.asdict(report)


@app.command(cls=Command)
def publish(
    ctx: typer.Context,
    store: StoreArg,
    src: Annotated[Path, typer.Argument(help="A .safetensors file or an HF checkpoint folder.")],
    version: Annotated[int, typer.Option("--version", min=0, help="Version number to publish.")],
    parent: Annotated[
        Path | None,
        typer.Option(help="Checkpoint of the store's newest version: publish a delta against it."),
    ] = None,
    anchor: Annotated[bool, typer.Option("--anchor", help="Publish a full version.")] = False,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            help="Publisher state folder.",
            show_default="$XDG_CACHE_HOME or ~/.cache, /deltastore/publisher/<store hash>",
        ),
    ] = None,
    max_frame_bytes: Annotated[int, typer.Option(help="Dense bytes per frame.")] = 16 << 20,
    zstd_level: Annotated[int, typer.Option(help="zstd compression level.")] = 1,
    unsafe_commits: Annotated[
        bool,
        typer.Option(
            "--unsafe-commits",
            help="Publish even if the store ignores conditional writes (some S3-compatible "
            "servers, emulators). RISK: only one publisher may ever write to the store; two "
            "could both commit a version. Each commit is read back and a fork reported.",
        ),
    ] = False,
    storage_option: StorageOpt = None,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Publish checkpoint SRC as version N (a delta when a parent is known, else an anchor)."""
    from deltastore.checkpoint.folders import publish_checkpoint

    with handle_errors(ctx), progress_bar(ctx, f"publish v{version}") as progress:
        report = publish_checkpoint(
            store,
            src,
            version=version,
            parent=parent,
            anchor=anchor,
            state_dir=state_dir,
            storage_options=parse_storage_options(storage_option, timeout=timeout),
            progress=progress,
            max_frame_bytes=max_frame_bytes,
            zstd_level=zstd_level,
            unsafe_commits=unsafe_commits,
        )
    if json_out:
        print_json(_report_json(report))
        return
    out_console.print(
        f"published v{report.version} ({report.kind}"
        + (f" on v{report.parent}" if report.parent is not None else "")
        + f"): {100 * report.changed_fraction:.3f}% changed, "
        f"{human_bytes(report.payload_bytes)} ({100 * report.payload_ratio:.2f}% of dense) "
        f"in {report.total_s:.2f} s",
        highlight=False,
    )


def _print_pull(report: SyncReport, json_out: bool) -> None:
    if json_out:
        print_json(_report_json(report))
        return
    if report.kind == "none":
        out_console.print(f"already at v{report.version}", highlight=False)
        return
    n, k = report.changed_elements, len(report.applied)
    # applied over several versions, the counts add up (an element may change in each)
    changes = f"{n} elements changed" if k == 1 else f"{n} element changes over {k} versions"
    out_console.print(
        f"pulled v{report.version} ({report.kind}, applied {', '.join(map(str, report.applied))}): "
        f"{human_bytes(report.payload_bytes)} fetched, {changes} in {report.total_s:.2f} s "
        f"(pause {report.pause_s * 1000:.1f} ms)",
        highlight=False,
    )


@app.command(cls=Command)
def pull(
    ctx: typer.Context,
    store: StoreArg,
    dest: Annotated[Path, typer.Argument(help="Checkpoint folder to create or update in place.")],
    version: Annotated[
        int | None,
        typer.Option("--version", min=0, help="Version.", show_default="newest"),
    ] = None,
    watch: Annotated[
        bool, typer.Option("--watch", help="Keep polling and apply each new version.")
    ] = False,
    interval: Annotated[
        float, typer.Option(min=0.05, help="Seconds between polls with --watch (±20% jitter).")
    ] = 5.0,
    storage_option: StorageOpt = None,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Bring folder DEST to a version: created from the newest anchor when empty, else
    updated in place. With --watch, follow the store until interrupted."""
    from deltastore.checkpoint.folders import pull_checkpoint, watch_checkpoint

    options = parse_storage_options(storage_option, timeout=timeout)
    if watch:
        if version is not None:
            raise typer.BadParameter("--watch follows the newest version; drop --version")
        stop = threading.Event()  # Ctrl-C / SIGTERM: finish the version in flight, then stop
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            # set from another thread: the handler may interrupt code holding the Event's lock
            signal.signal(sig, lambda *_: threading.Thread(target=stop.set).start())
        with handle_errors(ctx):
            try:
                watch_checkpoint(
                    store,
                    dest,
                    interval=interval,
                    stop=stop,
                    on_report=lambda r: _print_pull(r, json_out),
                    storage_options=options,
                )
            finally:  # before handle_errors settles the outcome
                for sig, handler in previous.items():
                    if handler is not None:
                        signal.signal(sig, handler)
        err_console.print("stopped watching")
        return
    with handle_errors(ctx), progress_bar(ctx, "pull") as progress:
        report = pull_checkpoint(
            store, dest, version=version, storage_options=options, progress=progress
        )
    _print_pull(report, json_out)


@app.command("log", cls=Command)
def log_cmd(
    ctx: typer.Context,
    store: StoreArg,
    limit: Annotated[int | None, typer.Option(min=1, help="Show only the newest N.")] = None,
    storage_option: StorageOpt = None,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """List committed versions, newest first."""
    from deltastore.maintenance.history import version_log

    with handle_errors(ctx):
        entries = version_log(
            store,
            storage_options=parse_storage_options(storage_option, timeout=timeout),
            limit=limit,
        )
    if json_out:
        print_json([e.to_json() for e in entries])
        return
    table = Table(box=None)
    for col in ("version", "kind", "parent", "changed", "payload", "of dense", "created"):
        table.add_column(col, justify="left" if col in ("kind", "created") else "right")
    for e in entries:
        table.add_row(
            str(e.version),
            e.kind,
            "-" if e.parent is None else str(e.parent),
            f"{100 * e.changed_fraction:.3f}%",
            human_bytes(e.payload_bytes),
            f"{100 * e.payload_ratio:.2f}%",
            e.created,
        )
    out_console.print(table)


@app.command(cls=Command)
def show(
    ctx: typer.Context,
    store: StoreArg,
    version: Annotated[int, typer.Argument(min=0, help="Version to show.")],
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor.")] = False,
    storage_option: StorageOpt = None,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Show one version's manifest (--json: the manifest itself)."""
    from deltastore.maintenance.history import show_manifest

    with handle_errors(ctx):
        options = parse_storage_options(storage_option, timeout=timeout)
        m = show_manifest(store, version, storage_options=options)
    if json_out:
        print_json(m.model_dump(mode="json"))
        return
    lines = [
        f"version       {m.version}",
        f"kind          {m.kind}",
        f"parent        {m.parent.version if m.parent else '-'}",
        f"created       {m.created}",
        f"writer        {m.writer.library} ({m.writer.token[:12]})",
        f"state digest  {m.state_digest}",
        f"tensors       {len(m.tensors)} "
        f"({m.total_elements} elements, {human_bytes(m.dense_bytes)})",
        f"changed       {m.changed_elements} ({100 * m.changed_fraction:.3f}%)",
        f"payload       {human_bytes(m.payload_bytes)} ({100 * m.payload_ratio:.2f}% of dense)",
    ]
    out_console.print("\n".join(lines), highlight=False)
    if tensors:
        table = Table(box=None)
        for col in ("tensor", "dtype", "shape", "changed", "frames", "payload", "codecs"):
            table.add_column(
                col, justify="left" if col in ("tensor", "dtype", "codecs") else "right"
            )
        for name, e in m.tensors.items():
            codecs = sorted({f.codec for f in e.frames})
            table.add_row(
                Text(name),
                e.dtype,
                "x".join(map(str, e.shape)) or "scalar",
                str(e.changed),
                str(len(e.frames)),
                human_bytes(sum(f.length for f in e.frames)),
                ",".join(codecs) or "-",
            )
        out_console.print(table)


@app.command("gc", cls=Command, options_metavar="--orphans [OPTIONS]")
def gc_cmd(
    ctx: typer.Context,
    store: StoreArg,
    orphans: Annotated[
        bool,
        typer.Option(
            "--orphans",
            help="Remove data objects no committed manifest references. Required: orphans are "
            "the only garbage gc collects in this release.",
        ),
    ],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would be removed; remove nothing.")
    ] = False,
    min_age: Annotated[
        float,
        typer.Option(
            "--min-age",
            min=0.0,
            metavar="SECONDS",
            help="Keep orphans younger than this: a publish may be writing them.",
        ),
    ] = 3600.0,
    storage_option: StorageOpt = None,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Remove orphans (--orphans, required): data objects of failed or lost publishes (never
    a committed version's)."""
    from deltastore.maintenance.orphans import gc

    if not orphans:  # --orphans is a required flag; this is a guard for direct calls
        raise typer.BadParameter("nothing to collect: give --orphans")
    with handle_errors(ctx):
        report = gc(
            store,
            orphans=True,
            dry_run=dry_run,
            min_age_s=min_age,
            storage_options=parse_storage_options(storage_option, timeout=timeout),
        )
    removed = [o for o in report.orphans if o.kept is None]
    unknown = sum(o.size is None for o in removed)  # object stores may not report sizes
    if json_out:
        print_json(report.to_json() | {"removed_unknown_size": unknown})
        return
    verb = "would remove" if dry_run else "removed"
    for o in report.orphans:
        size = human_bytes(o.size)
        typer.echo(f"{verb} {o.key} ({size})" if o.kept is None else f"kept {o.key}: {o.kept}")
    n = len(report.removed)
    if not unknown:
        total = human_bytes(report.removed_bytes)
    elif unknown == n:
        total = "size unknown: the store does not report sizes"
    else:
        total = f"{human_bytes(report.removed_bytes)} and {unknown} of unknown size"
    typer.echo(
        f"{verb} {n} orphan{'' if n == 1 else 's'} ({total}), kept "
        f"{len(report.kept)}; {report.referenced} objects referenced by {report.manifests} "
        "committed versions"
    )


@app.command(cls=Command)
def verify(
    ctx: typer.Context,
    store: Annotated[
        str | None,
        typer.Argument(
            metavar="STORE",
            help="The store (with --checkout: optional, to check the sidecar against it).",
            show_default=False,
        ),
    ] = None,
    deep: Annotated[
        bool,
        typer.Option("--deep", help="Also replay every version and check each tensor's Adler-32."),
    ] = False,
    checkout: Annotated[
        Path | None,
        typer.Option(
            "--checkout", metavar="DEST", help="Check a pulled folder against its version instead."
        ),
    ] = None,
    storage_option: StorageOpt = None,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Check a store for damage (fsck), or with --checkout a folder `pull` wrote."""
    from deltastore.maintenance.verify import verify_checkout, verify_store
    from deltastore_cli.common import EXIT_DAMAGED, EXIT_NOT_FOUND

    if checkout is None and store is None:
        raise typer.BadParameter("give STORE, or --checkout DEST")
    if checkout is not None and deep:
        raise typer.BadParameter("--deep checks a store; drop it with --checkout")
    options = parse_storage_options(storage_option, timeout=timeout)
    with handle_errors(ctx), progress_bar(ctx, "verify") as progress:
        if checkout is not None:
            report = verify_checkout(checkout, store, storage_options=options)
        elif store is not None:
            report = verify_store(store, deep=deep, storage_options=options, progress=progress)
    if json_out:
        print_json(report.to_json())
    else:
        for problem in report.problems:
            out_console.print(Text(problem.line()), highlight=False)
        out_console.print(Text(report.summary()), highlight=False)
    if report.empty:  # a store without any version: nothing was verified
        raise typer.Exit(EXIT_NOT_FOUND)
    if not report.ok:
        raise typer.Exit(EXIT_MISMATCH if checkout is not None else EXIT_DAMAGED)


@app.command(cls=Command)
def demo(
    ctx: typer.Context,
    store: Annotated[
        str | None,
        typer.Option(help="Store.", show_default="./deltastore-demo, emptied first"),
    ] = None,
    size: Annotated[
        Size, typer.Option(case_sensitive=False, help="Synthetic model size.")
    ] = Size.small,
    versions: Annotated[int, typer.Option(min=2, help="Versions to publish.")] = 5,
    receivers: Annotated[int, typer.Option(min=1, help="Subscribers following the trainer.")] = 2,
    json_out: JsonOpt = False,
) -> None:
    """Run the main job: publish AdamW versions, K receivers follow, all checked bit-exact."""
    from deltastore.bench.demo import run_demo
    from deltastore.testing.synthetic import SIZES

    config = SIZES[size.value]
    table = Table()
    for col in (
        "version",
        "kind",
        "changed",
        "payload",
        "of dense",
        "publish s",
        "sync s",
        "exact",
    ):
        table.add_column(col, justify="right")
    quiet = settings(ctx).quiet or json_out
    if not quiet:
        err_console.print(
            f"deltastore demo: {config.numel() / 1e6:.1f}M bf16 elements, {versions} versions, "
            f"{receivers} receivers"
        )

    def on_row(row: Any) -> None:
        if not quiet:
            err_console.print(f"  v{row.version} {row.kind}: published and synced", highlight=False)

    with handle_errors(ctx):
        result = run_demo(
            store, config=config, versions=versions, receivers=receivers, on_row=on_row
        )
    if json_out:
        print_json(
            {
                "store": result.store,
                "elements": result.elements,
                "rows": [dataclasses.asdict(r) for r in result.rows],
                "exact_by_receiver": result.exact_by_receiver,
                "ok": result.ok,
            }
        )
    else:
        for r in result.rows:
            table.add_row(
                str(r.version),
                r.kind,
                f"{100 * r.changed_fraction:.2f}%",
                human_bytes(r.payload_bytes),
                f"{100 * r.payload_bytes / r.dense_bytes:.2f}%",
                f"{r.publish_s:.2f}",
                f"{r.sync_s:.2f}",
                "yes" if all(r.exact) else "NO",
            )
        out_console.print(Text(f"store: {result.store}"), highlight=False)
        out_console.print(table)
        for i, ok in enumerate(result.exact_by_receiver):
            verdict = "bit-exact at every version" if ok else "MISMATCH"
            out_console.print(f"receiver {i + 1}: {verdict}", highlight=False)
        out_console.print(
            "all receivers bit-exact" if result.ok else "MISMATCH: some receiver differs",
            highlight=False,
        )
    if not result.ok:
        raise typer.Exit(EXIT_MISMATCH)


@app.command(cls=Command)
def bench(
    ctx: typer.Context,
    size: Annotated[
        BenchSize, typer.Option(case_sensitive=False, help="Synthetic model size.")
    ] = BenchSize.large,
    store: Annotated[
        str,
        typer.Option(help="Comma-separated stores: local, moto (S3 over HTTP), or store URLs."),
    ] = "local,moto",
    versions: Annotated[int, typer.Option(min=1, help="Measured versions (deltas).")] = 3,
    lr: Annotated[float, typer.Option(min=0.0, help="AdamW learning rate.")] = 1e-6,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    warmup: Annotated[int, typer.Option(min=0, help="AdamW steps before the base version.")] = 1,
    workdir: Annotated[
        Path | None,
        typer.Option(
            help="Workload cache folder.",
            show_default="$XDG_CACHE_HOME or ~/.cache, /deltastore/bench",
        ),
    ] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the results as JSON to this file.")
    ] = None,
    markdown_path: Annotated[
        Path | None, typer.Option("--markdown", help="Write the markdown report to this file.")
    ] = None,
    plot_path: Annotated[
        Path | None, typer.Option("--plot", help="Write a PNG chart (needs matplotlib).")
    ] = None,
    storage_option: StorageOpt = None,
) -> None:
    """Benchmark deltastore against dense, COO and xor-dense baselines; print the report."""
    from deltastore.bench import (
        BenchOptions,
        PlotUnavailable,
        check_plot,
        markdown,
        plot,
        run_bench,
    )

    quiet = settings(ctx).quiet
    stores = [s.strip() for s in store.split(",") if s.strip()]
    if not stores:
        raise typer.BadParameter("--store names no store")
    if plot_path is not None:
        try:
            check_plot()  # before the run, not after it
        except PlotUnavailable as exc:
            err_console.print(Text.assemble(("error:", "red"), " ", str(exc)), highlight=False)
            raise typer.Exit(EXIT_ERROR) from None
    with handle_errors(ctx):
        result = run_bench(
            BenchOptions(
                size=size.value,
                stores=stores,
                versions=versions,
                lr=lr,
                seed=seed,
                warmup=warmup,
                workdir=workdir,
                storage_options=parse_storage_options(storage_option),
                log=(lambda _: None)
                if quiet
                else (lambda m: err_console.print(Text(m), highlight=False)),
            )
        )
        report = markdown(result)
        if json_path is not None:
            json_path.write_text(result.model_dump_json(indent=1) + "\n")
        if markdown_path is not None:
            markdown_path.write_text(report)
        if plot_path is not None:
            plot(result, plot_path)
    out_console.print(Text(report), highlight=False, end="")
    if not result.exact:
        raise typer.Exit(EXIT_MISMATCH)


def main() -> None:
    """Console-script entry point: the process exits with the command's result.

    Once a command's outcome is settled (its work ended; the result is about to be printed),
    Ctrl-C is ignored, so a printed success is never followed by death by SIGINT. A Ctrl-C
    during the work exits 130 after one line, "interrupted" (no traceback)."""
    RUN.console_script = True
    try:
        app()
    except SystemExit as exc:
        settle()
        if exc.code == EXIT_INTERRUPTED:  # also a Ctrl-C outside handle_errors (typer: 130)
            report_interrupt()
        raise
    except KeyboardInterrupt:  # pragma: no cover - typer turns it into exit 130
        settle()
        report_interrupt()
        raise SystemExit(EXIT_INTERRUPTED) from None
