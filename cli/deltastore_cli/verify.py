"""``deltastore verify``: check a store for damage (fsck), or a folder ``pull`` wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from deltastore_cli.common import (
    EXIT_DAMAGED,
    EXIT_MISMATCH,
    EXIT_NOT_FOUND,
    out_console,
    parse_storage_options,
    print_json,
    progress_bar,
    settings,
    settle,
)
from deltastore_cli.options import JsonOpt, StorageOpt, TimeoutOpt, TrustedKeysOpt

#: Problems listed without ``-v`` (the summary line counts them all, by kind).
MAX_LINES = 10


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
            "--checkout",
            metavar="DEST",
            help="Check a pulled folder against its version instead.",
            resolve_path=True,
        ),
    ] = None,
    trusted_keys: TrustedKeysOpt = None,
    storage_option: StorageOpt = None,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Check a store for damage (fsck), or with --checkout a folder `pull` wrote."""
    from deltastore.format.signing import FROM_ENV, resolve_trust
    from deltastore.maintenance.verify import verify_checkout, verify_store

    try:  # the union of --trusted-keys (or DELTASTORE_TRUSTED_KEYS) and DELTASTORE_SIGNING_KEY
        keys = resolve_trust(FROM_ENV if trusted_keys is None else trusted_keys, FROM_ENV)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--trusted-keys") from None
    if checkout is None and store is None:
        raise typer.BadParameter("give STORE, or --checkout DEST")
    if checkout is not None and deep:
        raise typer.BadParameter("--deep checks a store; drop it with --checkout")
    options = parse_storage_options(storage_option, timeout=timeout)
    with progress_bar(ctx, "verify") as progress:
        if checkout is not None:
            report = verify_checkout(checkout, store, storage_options=options, keys=keys)
        elif store is not None:
            report = verify_store(
                store, deep=deep, storage_options=options, progress=progress, keys=keys
            )
    settle()
    if json_out:
        print_json(report.to_json())
    else:
        shown = report.problems if settings(ctx).verbose else report.problems[:MAX_LINES]
        for problem in shown:
            out_console.print(Text(problem.line()), highlight=False)
        if len(shown) < len(report.problems):
            out_console.print(
                f"... and {len(report.problems) - len(shown)} more problems (-v lists them all)",
                highlight=False,
            )
        out_console.print(Text(report.summary()), highlight=False)
    if report.empty:  # a store without any version: nothing was verified
        raise typer.Exit(EXIT_NOT_FOUND)
    if not report.ok:
        raise typer.Exit(EXIT_MISMATCH if checkout is not None else EXIT_DAMAGED)
