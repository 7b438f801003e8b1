"""CLI plumbing: exit codes, error messages, progress bars, logging, option parsing."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from deltastore.errors import (
    ChainError,
    DeltastoreError,
    FrameError,
    IntegrityError,
    InvalidKeyError,
    ManifestError,
    ObjectNotFoundError,
    StoreError,
    TensorMismatchError,
    VersionExistsError,
    VersionOrderError,
    WrongParentError,
)
from deltastore.progress import Progress as ProgressEvent
from deltastore.progress import ProgressFn

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_STORE = 4
EXIT_DAMAGED = 5
EXIT_MISMATCH = 6
EXIT_CONFLICT = 7
EXIT_INTERRUPTED = 130

#: First match wins: specific classes before their bases.
EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (ObjectNotFoundError, EXIT_NOT_FOUND),
    (VersionExistsError, EXIT_CONFLICT),
    (StoreError, EXIT_STORE),
    (IntegrityError, EXIT_DAMAGED),
    (FrameError, EXIT_DAMAGED),
    (ManifestError, EXIT_DAMAGED),
    (InvalidKeyError, EXIT_DAMAGED),
    (TensorMismatchError, EXIT_MISMATCH),
    (WrongParentError, EXIT_MISMATCH),
    (ChainError, EXIT_MISMATCH),
    (VersionOrderError, EXIT_CONFLICT),
]

err_console = Console(stderr=True, soft_wrap=True)
#: Tables keep their natural width when stdout is not a terminal (pipes, files, tests).
out_console = Console(width=None if sys.stdout.isatty() else 1000, soft_wrap=True)


@dataclass
class Settings:
    """Global options of one invocation."""

    verbose: int = 0
    quiet: bool = False


def settings(ctx: typer.Context) -> Settings:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, Settings) else Settings()


def setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(
        level=level,
        format="%(message)s",
        handlers=[RichHandler(console=err_console, show_path=False)],
        force=True,
    )


def exit_code(exc: BaseException) -> int:
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return EXIT_ERROR


@contextmanager
def handle_errors(ctx: typer.Context) -> Iterator[None]:
    """Turn library errors into one clear line and a stable exit code (traceback with -v)."""
    verbose = settings(ctx).verbose
    try:
        yield
    except KeyboardInterrupt:
        err_console.print("interrupted")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (DeltastoreError, OSError, ValueError) as exc:
        if verbose:
            err_console.print_exception()
        err_console.print(Text.assemble(("error:", "red"), " ", str(exc)), highlight=False)
        raise typer.Exit(exit_code(exc)) from None


def parse_storage_options(items: list[str] | None) -> dict[str, Any] | None:
    """``KEY=VALUE`` pairs; VALUE is JSON when it parses (true, 3, "x"), else a string."""
    if not items:
        return None
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item.split('=')[0]!r}...")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


@contextmanager
def progress_bar(ctx: typer.Context, description: str) -> Iterator[ProgressFn | None]:
    """A rich progress bar on stderr (bytes and frames), or None when quiet or not a TTY."""
    if settings(ctx).quiet or not err_console.is_terminal:
        yield None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TextColumn("{task.fields[frames]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task(description, total=None, frames="")

        def update(p: ProgressEvent) -> None:
            bar.update(
                task,
                completed=p.bytes_done,
                total=p.bytes_total,
                frames=f"{p.frames_done}/{p.frames_total} frames",
            )

        yield update


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, sort_keys=False) + "\n")
    sys.stdout.flush()


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"  # pragma: no cover
