"""``deltastore publish``: publish a checkpoint as a version (a delta or an anchor)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from deltastore_cli.common import (
    human_bytes,
    out_console,
    parse_storage_options,
    print_json,
    progress_bar,
    settle,
)
from deltastore_cli.options import CodecsOpt, JsonOpt, StorageOpt, StoreArg, TimeoutOpt


def publish(
    ctx: typer.Context,
    store: StoreArg,
    src: Annotated[
        Path,
        typer.Argument(help="A .safetensors file or an HF checkpoint folder.", resolve_path=True),
    ],
    version: Annotated[int, typer.Option("--version", min=0, help="Version number to publish.")],
    parent: Annotated[
        Path | None,
        typer.Option(
            help="Checkpoint of the store's newest version: publish a delta against it.",
            resolve_path=True,
        ),
    ] = None,
    anchor: Annotated[bool, typer.Option("--anchor", help="Publish a full version.")] = False,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            help="Publisher state folder.",
            resolve_path=True,
            show_default="$XDG_CACHE_HOME or ~/.cache, /deltastore/publisher/<store hash>",
        ),
    ] = None,
    max_frame_bytes: Annotated[int, typer.Option(help="Dense bytes per frame.")] = 16 << 20,
    zstd_level: Annotated[
        int | None,
        typer.Option(
            help="zstd compression level.",
            show_default="1 for the v1 codecs, tuned fast parameters for the v2 ones",
        ),
    ] = None,
    codecs: CodecsOpt = "v2",
    anchor_policy: Annotated[
        str,
        typer.Option(
            help="When a delta also gets an anchor copy (a full copy for fresh replicas): "
            "'cost' (when the deltas since the newest anchor exceed its size), 'cost:K' (K "
            "times its size), 'every:N' (every N versions) or 'never'.",
        ),
    ] = "cost",
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
    from deltastore.publish.policy import AnchorPolicy

    try:
        policy = AnchorPolicy.parse(anchor_policy)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--anchor-policy") from None

    with progress_bar(ctx, f"publish v{version}") as progress:
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
            codecs=codecs,
            anchor_policy=policy,
            unsafe_commits=unsafe_commits,
        )
    settle()
    if json_out:
        print_json(dataclasses.asdict(report))
        return
    out_console.print(
        f"published v{report.version} ({report.kind}"
        + (f" on v{report.parent}" if report.parent is not None else "")
        + f"): {100 * report.changed_fraction:.3f}% changed, "
        f"{human_bytes(report.payload_bytes)} ({100 * report.payload_ratio:.2f}% of dense) "
        f"in {report.total_s:.2f} s"
        + (
            f"; anchor copy {human_bytes(report.anchor_copy_bytes)} ({report.anchor_reason})"
            if report.anchor_copy_bytes is not None
            else f"; anchor: {report.anchor_reason}"
            if report.kind == "anchor"
            else ""
        ),
        highlight=False,
    )
