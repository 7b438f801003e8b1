"""``deltastore gc --orphans``: remove data objects no committed version references.

Named after what it collects (as :mod:`deltastore.maintenance.orphans`), not ``gc.py``: that
would shadow the standard library's ``gc`` module for scripts run from this folder.
"""

from __future__ import annotations

from typing import Annotated

import typer

from deltastore_cli.common import human_bytes, parse_storage_options, print_json, settle
from deltastore_cli.options import JsonOpt, StorageOpt, StoreArg, TimeoutOpt


def gc(
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
    from deltastore.maintenance import orphans as collector

    if not orphans:  # --orphans is a required flag; this is a guard for direct calls
        raise typer.BadParameter("nothing to collect: give --orphans")
    report = collector.gc(
        store,
        orphans=True,
        dry_run=dry_run,
        min_age_s=min_age,
        storage_options=parse_storage_options(storage_option, timeout=timeout),
    )
    settle()
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
