"""``deltastore keygen``: a new Ed25519 key pair for signing manifests (spec section 6.7)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from deltastore_cli.common import err_console, out_console, print_json
from deltastore_cli.options import JsonOpt


def keygen(
    key_id: Annotated[
        str, typer.Argument(help="The key's public name (1-64 of A-Z a-z 0-9 . _ -).")
    ],
    out: Annotated[
        Path,
        typer.Option("--out", file_okay=False, help="Folder to write the two files into."),
    ] = Path("."),
    json_out: JsonOpt = False,
) -> None:
    """Write a new Ed25519 key pair: OUT/KEY_ID.key (private, mode 0600: the trainer's
    DELTASTORE_SIGNING_KEY=@OUT/KEY_ID.key) and OUT/KEY_ID.pub (public: the readers'
    DELTASTORE_TRUSTED_KEYS=@OUT/KEY_ID.pub). Never overwrites a file."""
    from deltastore.format.ed25519 import Ed25519Key

    try:
        key = Ed25519Key.generate(key_id)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="KEY_ID") from None
    out.mkdir(parents=True, exist_ok=True)
    private, public = out / f"{key_id}.key", out / f"{key_id}.pub"
    for path in (private, public):
        if path.exists():
            raise FileExistsError(f"{path} exists: keygen never overwrites a key; remove it first")
    _write(private, key.to_text() + "\n", 0o600)
    _write(public, key.public_key().to_text() + "\n", 0o644)
    if json_out:
        print_json({"key_id": key_id, "private": str(private), "public": str(public),
                    "public_key": key.public_key().to_text()})  # fmt: skip
        return
    out_console.print(key.public_key().to_text(), highlight=False, soft_wrap=True)
    err_console.print(
        f"wrote {private} (private: keep it on the trainer, DELTASTORE_SIGNING_KEY=@{private}) "
        f"and {public} (give it to readers: DELTASTORE_TRUSTED_KEYS=@{public})",
        highlight=False,
    )


def _write(path: Path, text: str, mode: int) -> None:
    """Create ``path`` with ``mode`` (never an existing file), holding ``text``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
