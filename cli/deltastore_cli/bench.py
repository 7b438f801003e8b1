"""``deltastore bench``: deltastore against dense, COO and xor-dense baselines; with
``--mode trainer``, real AdamW steps each followed by a publish, snapshot-free beside the
memory snapshot; with ``--mode sharded``, the memory of a sharded publish per rank and
density of changes; with ``--mode crossover``, the density of changes below which deltastore's
sync beats the strongest dense load, per store; with ``--mode signing``, publish and sync
unsigned vs Ed25519-signed, with the floors of the work signing adds; with ``--mode fleet``,
what N followers cost the origin store, read directly or through one mirror."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer
from rich.text import Text

from deltastore_cli.common import (
    EXIT_ERROR,
    EXIT_MISMATCH,
    err_console,
    out_console,
    parse_storage_options,
    print_error,
    settings,
    settle,
)
from deltastore_cli.options import SizeName, StorageOpt

if TYPE_CHECKING:
    from deltastore.bench.crossover import CrossoverOptions
    from deltastore.bench.crossover_schema import CrossoverResult
    from deltastore.bench.fleet import FleetOptions
    from deltastore.bench.fleet_schema import FleetResult
    from deltastore.bench.schema import BenchResult
    from deltastore.bench.sharded_schema import ShardedResult
    from deltastore.bench.signing import SigningOptions
    from deltastore.bench.signing_schema import SigningResult
    from deltastore.bench.trainer import TrainerOptions
    from deltastore.bench.trainer_schema import TrainerResult

BenchSizeOpt = Annotated[
    SizeName | None,
    typer.Option(
        case_sensitive=False,
        help="Synthetic model size.",
        show_default="large; --mode trainer: the largest whose trainer fits in memory; "
        "--mode sharded: a 2.56M-element model (fsdp-2.5m); --mode crossover, signing: medium; "
        "--mode fleet: tiny",
    ),
]


def bench(
    ctx: typer.Context,
    size: BenchSizeOpt = None,
    mode: Annotated[
        Literal["transfer", "trainer", "sharded", "crossover", "signing", "fleet"],
        typer.Option(
            help="transfer: every system through every store; trainer: real AdamW steps on "
            "fp32 masters, each followed by a publish, the snapshot-free publisher beside the "
            "memory snapshot, each in a process of its own (local stores; publish time vs "
            "optimizer.step(), extra RSS, payload); sharded: two ShardWriters, a process "
            "each, publish bf16 row shards at each --densities (local store; peak memory over "
            "the snapshot per rank, by RSS and tracemalloc, vs the shard's bf16 bytes); "
            "crossover: one density of changes per --lrs, deltastore's sync vs the strongest "
            "dense load through each --store, and the density where they cross; signing: "
            "Publisher.publish (anchor, delta) and Subscriber.sync (fresh reader, follower) "
            "unsigned vs Ed25519-signed through each --store, --repeats interleaved rounds, "
            "on/off ratios beside the floors (BLAKE3 of the frames, canonical bytes, one "
            "sign / verify); fleet: one publisher commits to a moto origin, N followers per "
            "--followers poll it every --poll-interval through the --link (direct) or a "
            "mirror of it (--store: local or moto) fed by one Mirror through that link: "
            "origin requests and bytes per version and per poll interval, commit-to-sync "
            "p50/p99.",
        ),
    ] = "transfer",
    densities: Annotated[
        str,
        typer.Option(
            help="--mode sharded: comma-separated shares of the elements changed per version."
        ),
    ] = "0.01,0.03,0.65",
    lrs: Annotated[
        str | None,
        typer.Option(
            help="--mode crossover: comma-separated AdamW learning rates, one density point "
            "each (--versions versions per point).",
            show_default="5e-8,1.5e-7,4e-7,1e-6,2.5e-6,6e-6,1.5e-5,5e-5: ~0.05% to ~19% changed",
        ),
    ] = None,
    followers: Annotated[
        str, typer.Option(help="--mode fleet: comma-separated follower counts, one run each.")
    ] = "1,8,64",
    poll_interval: Annotated[
        float,
        typer.Option(min=0.05, help="--mode fleet: every follower's and the mirror's poll, s."),
    ] = 1.0,
    optimizer: Annotated[
        Literal["foreach", "fused", "single-tensor"],
        typer.Option(help="--mode trainer: the torch.optim.AdamW implementation."),
    ] = "foreach",
    weight_decay: Annotated[
        float, typer.Option(min=0.0, help="--mode trainer: AdamW weight decay.")
    ] = 0.1,
    store: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated stores: local, moto (S3 over HTTP), or store URLs. --mode "
            "fleet: the mirror's store, local (a folder) or moto (a second moto, lan link).",
            show_default="local,moto; --mode signing, fleet: local",
        ),
    ] = None,
    versions: Annotated[int, typer.Option(min=1, help="Measured versions (deltas).")] = 3,
    repeats: Annotated[
        int,
        typer.Option(
            min=1, help="--mode signing: interleaved rounds (each operation once per side)."
        ),
    ] = 5,
    lr: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="AdamW learning rate.",
            show_default="1e-6; --mode signing: 2.5e-6 (~1.7% of the elements changed)",
        ),
    ] = None,
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
    link: Annotated[
        str | None,
        typer.Option(
            help="Reach the moto store through a shaped link: lan (1 ms, 10 Gbit/s), region "
            "(20 ms, 2 Gbit/s) or cross-region (60 ms, 1 Gbit/s); latency per request, "
            "bandwidth per connection and in total.",
            show_default="loopback; --mode fleet: cross-region",
        ),
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
    log = (lambda _: None) if quiet else (lambda m: err_console.print(Text(m), highlight=False))
    if mode == "sharded":
        _sharded(size, densities, versions, seed, workdir, log, json_path, markdown_path)
        return
    if mode == "trainer":
        from deltastore.bench.trainer import TrainerOptions

        options = TrainerOptions(
            size=size or "auto",
            versions=versions,
            warmup=warmup,
            lr=1e-6 if lr is None else lr,
            weight_decay=weight_decay,
            seed=seed,
            optimizer=optimizer,
            workdir=workdir,
            log=log,
        )
        _trainer(options, json_path, markdown_path)
        return
    if mode == "fleet":
        from deltastore.bench.fleet import FleetOptions

        if store not in (None, "local", "moto"):
            raise typer.BadParameter("--mode fleet: the mirror's store, local or moto")
        fleet = FleetOptions(
            size=size or "tiny",
            followers=_counts(followers),
            versions=versions,
            poll_interval_s=poll_interval,
            link=link or "cross-region",
            mirror_store=store or "local",
            lr=1e-6 if lr is None else lr,
            seed=seed,
            warmup=warmup,
            workdir=workdir,
            log=log,
        )
        _fleet(fleet, json_path, markdown_path)
        return
    if store is None:
        store = "local" if mode == "signing" else "local,moto"
    stores = [s.strip() for s in store.split(",") if s.strip()]
    if not stores:
        raise typer.BadParameter("--store names no store")
    from deltastore.testing.link import LINKS

    if link is not None and link not in LINKS:
        raise typer.BadParameter(f"choose one of {', '.join(LINKS)}", param_hint="--link")
    if link is not None and "moto" not in stores:
        raise typer.BadParameter("the shaped link is in front of moto: add it to --store")
    if mode == "crossover":
        from deltastore.bench.crossover import CrossoverOptions

        crossover = CrossoverOptions(
            size=size or "medium",
            stores=stores,
            versions=versions,
            seed=seed,
            workdir=workdir,
            storage_options=parse_storage_options(storage_option),
            link=link,
            log=log,
        )
        if lrs is not None:
            crossover.lrs = _numbers(lrs, "--lrs")
        _crossover(crossover, json_path, markdown_path)
        return
    if mode == "signing":
        if link is not None:
            raise typer.BadParameter(
                "--mode signing runs without a shaped link", param_hint="--link"
            )
        from deltastore.bench.signing import DEFAULT_LR, SigningOptions

        signing = SigningOptions(
            size=size or "medium",
            stores=stores,
            repeats=repeats,
            lr=DEFAULT_LR if lr is None else lr,
            seed=seed,
            warmup=warmup,
            workdir=workdir,
            storage_options=parse_storage_options(storage_option),
            log=log,
        )
        _signing(signing, json_path, markdown_path)
        return
    if plot_path is not None:
        try:
            check_plot()  # before the run, not after it
        except PlotUnavailable as exc:  # an ImportError: not an error the app handles
            print_error(str(exc))
            raise typer.Exit(EXIT_ERROR) from None
    result = run_bench(
        BenchOptions(
            size=size or "large",
            stores=stores,
            versions=versions,
            lr=1e-6 if lr is None else lr,
            seed=seed,
            warmup=warmup,
            workdir=workdir,
            storage_options=parse_storage_options(storage_option),
            link=link,
            log=log,
        )
    )
    if plot_path is not None:
        plot(result, plot_path)
    _finish(result, markdown(result), json_path, markdown_path)


def _trainer(
    options: TrainerOptions,
    json_path: Path | None,
    markdown_path: Path | None,
) -> None:
    """``--mode trainer``: run, write the JSON and markdown, print the report."""
    from deltastore.bench.trainer import run_trainer
    from deltastore.bench.trainer_report import trainer_markdown

    result = run_trainer(options)
    _finish(result, trainer_markdown(result), json_path, markdown_path)


def _sharded(
    size: str | None,
    densities: str,
    versions: int,
    seed: int,
    workdir: Path | None,
    log: Callable[[str], None],
    json_path: Path | None,
    markdown_path: Path | None,
) -> None:
    """``--mode sharded``: run (``--versions`` versions per density and measure), write the
    JSON and markdown, print the report."""
    from deltastore.bench.sharded import ShardedOptions, run_sharded, sharded_markdown

    shares = _numbers(densities, "--densities")
    if not all(0 < d <= 1 for d in shares):
        raise typer.BadParameter("each density must be in (0, 1]", param_hint="--densities")
    result = run_sharded(
        ShardedOptions(
            size=size or "fsdp-2.5m",
            densities=shares,
            repeats=versions,
            seed=seed,
            workdir=workdir,
            log=log,
        )
    )
    _finish(result, sharded_markdown(result), json_path, markdown_path)


def _numbers(text: str, hint: str) -> list[float]:
    """A comma-separated option's numbers, at least one, each above 0."""
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"not a list of numbers: {text!r}", param_hint=hint) from None
    if not out or not all(x > 0 for x in out):
        raise typer.BadParameter("give numbers above 0", param_hint=hint)
    return out


def _counts(text: str) -> list[int]:
    """``--followers``: comma-separated whole numbers, at least one, each 1 or more."""
    out = _numbers(text, "--followers")
    if not all(x == int(x) for x in out):
        raise typer.BadParameter("give whole numbers", param_hint="--followers")
    return [int(x) for x in out]


def _crossover(
    options: CrossoverOptions, json_path: Path | None, markdown_path: Path | None
) -> None:
    """``--mode crossover``: run, write the JSON and markdown, print the report."""
    from deltastore.bench.crossover import crossover_markdown, run_crossover

    result = run_crossover(options)
    _finish(result, crossover_markdown(result), json_path, markdown_path)


def _signing(options: SigningOptions, json_path: Path | None, markdown_path: Path | None) -> None:
    """``--mode signing``: run, write the JSON and markdown, print the report."""
    from deltastore.bench.signing import run_signing, signing_markdown

    result = run_signing(options)
    _finish(result, signing_markdown(result), json_path, markdown_path)


def _fleet(options: FleetOptions, json_path: Path | None, markdown_path: Path | None) -> None:
    """``--mode fleet``: run, write the JSON and markdown, print the report."""
    from deltastore.bench.fleet import fleet_markdown, run_fleet
    from deltastore.testing.link import LINKS

    if options.link not in LINKS:
        raise typer.BadParameter(f"choose one of {', '.join(LINKS)}", param_hint="--link")
    result = run_fleet(options)
    _finish(result, fleet_markdown(result), json_path, markdown_path)


def _finish(
    result: BenchResult
    | TrainerResult
    | ShardedResult
    | CrossoverResult
    | SigningResult
    | FleetResult,
    report: str,
    json_path: Path | None,
    markdown_path: Path | None,
) -> None:
    """Write a run's JSON and markdown where asked, print the report; exit with
    ``EXIT_MISMATCH`` when a receiver was not bit-exact."""
    if json_path is not None:
        json_path.write_text(result.model_dump_json(indent=1) + "\n")
    if markdown_path is not None:
        markdown_path.write_text(report)
    settle()
    out_console.print(Text(report), highlight=False, end="")
    if not result.exact:
        raise typer.Exit(EXIT_MISMATCH)
