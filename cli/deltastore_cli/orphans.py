"""``deltastore gc``: retention (``--keep N``, honouring reader leases) and orphans
(``--orphans``: data objects no committed version references).

Named after what it collects (as :mod:`deltastore.maintenance.orphans`), not ``gc.py``: that
would shadow the standard library's ``gc`` module for scripts run from this folder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from deltastore_cli.common import human_bytes, parse_storage_options, print_json, settle
from deltastore_cli.options import JsonOpt, StorageOpt, StoreArg, TimeoutOpt

if TYPE_CHECKING:  # the library is imported when the command runs: --help imports no torch
    from deltastore.maintenance.retention import RetentionReport


def print_retention(r: RetentionReport, dry_run: bool) -> None:
    """What ``--keep`` deleted (or would), the leases it honoured, what it kept."""
    verb = "would delete" if dry_run else "deleted"
    for d in r.deleted:
        if d.kind == "anchor copy":  # of a kept version no reader starts from
            typer.echo(f"{verb} the anchor copy of v{d.version} ({human_bytes(d.bytes)})")
            continue
        copy = " + anchor copy" if d.copy else ""
        typer.echo(f"{verb} v{d.version} ({d.kind}{copy}, {human_bytes(d.bytes)})")
    for lease in r.leases:
        state = "live" if lease.live else lease.problem or "expired"
        typer.echo(f"lease {lease.reader}: v{lease.version}, expires {lease.expires} ({state})")
    for key in r.expired_removed:
        typer.echo(f"{'would remove' if dry_run else 'removed'} expired lease {key}")
    kept = f"v{r.kept[0]}-v{r.kept[-1]}" if r.kept else "nothing"
    n = sum(d.kind != "anchor copy" for d in r.deleted)
    typer.echo(
        f"{verb} {n} version{'' if n == 1 else 's'} ({human_bytes(r.deleted_bytes)}); kept "
        f"{len(r.kept)} ({kept}, {human_bytes(r.kept_bytes)}"
        + (f"; the oldest: {r.oldest_kept_because})" if r.oldest_kept_because else ")")
    )


def gc(
    store: StoreArg,
    keep: Annotated[
        int | None,
        typer.Option(
            "--keep",
            min=1,
            metavar="N",
            help="Delete committed versions that neither the newest N versions (with the "
            "anchor and deltas they need) nor a live reader lease need.",
        ),
    ] = None,
    orphans: Annotated[
        bool,
        typer.Option(
            "--orphans",
            help="Remove data objects no committed manifest references.",
        ),
    ] = False,
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
    lease_grace: Annotated[
        float,
        typer.Option(
            "--lease-grace",
            min=0.0,
            metavar="SECONDS",
            help="A reader lease still counts this long after it expired (clock skew).",
        ),
    ] = 60.0,
    storage_option: StorageOpt = None,
    timeout: TimeoutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Delete versions no reader needs (--keep N) and/or orphans (--orphans): data objects of
    failed or lost publishes. At least one of the two."""
    from deltastore.maintenance import orphans as collector

    if not orphans and keep is None:
        raise typer.BadParameter("nothing to collect: give --keep N and/or --orphans")
    report = collector.gc(
        store,
        orphans=orphans,
        keep=keep,
        dry_run=dry_run,
        min_age_s=min_age,
        lease_grace_s=lease_grace,
        storage_options=parse_storage_options(storage_option, timeout=timeout),
    )
    settle()
    removed = [o for o in report.orphans if o.kept is None]
    unknown = sum(o.size is None for o in removed)  # object stores may not report sizes
    if json_out:
        print_json(report.to_json() | {"removed_unknown_size": unknown})
        return
    if report.retention is not None:
        print_retention(report.retention, dry_run)
    if not orphans:
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
