"""Options and arguments several commands share (typer ``Annotated`` types).

A command declares ``store: StoreArg`` or ``timeout: TimeoutOpt = None`` and gets the same
name, help and checks as every other command. Kept apart from :mod:`deltastore_cli.app`, which
imports the command modules, so that those modules can import these types. Imports no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

import typer

from deltastore.testing.sizes import SIZES

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
        help="The command's deadline for an object store: no request starts after it, one "
        "in flight is abandoned, and the command fails (exit 4); with pull --watch, the bound "
        "of each store operation. Retries are logged on stderr.",
        show_default="none: each store operation gives up after 120 s of retries",
    ),
]

TrustedKeysOpt = Annotated[
    str | None,
    typer.Option(
        "--trusted-keys",
        metavar="KEYS",
        help="Public keys of the writers (<key_id>:ed25519:<base64>, comma-separated) or "
        "@FILE (one per line): every manifest must be signed by one of them. HMAC keys of "
        "old stores come from DELTASTORE_SIGNING_KEY.",
        show_default="DELTASTORE_TRUSTED_KEYS; none: signatures are not checked",
    ),
]

if TYPE_CHECKING:
    SizeName = str
else:  # typer reads annotations when the app runs: a choice of the table's names
    SizeName = Literal[tuple(SIZES)]
#: ``--size`` of ``demo`` and ``bench``: a name in :data:`deltastore.testing.sizes.SIZES`, the
#: one table of synthetic model sizes (case-insensitive).
SizeOpt = Annotated[SizeName, typer.Option(case_sensitive=False, help="Synthetic model size.")]

#: ``--codecs`` of ``publish``: which frame codecs the writer may use.
CodecsOpt = Annotated[
    Literal["v1", "v2"],
    typer.Option(
        "--codecs",
        help="Frame codecs to write: v2 (smallest payloads: xor-sparse2, raw-planes anchors; "
        "read from deltastore 0.2.0) or v1 (only the codecs deltastore 0.1.0 reads).",
    ),
]
