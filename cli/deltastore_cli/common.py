"""CLI plumbing: exit codes, the one error handler, Ctrl-C, progress bars, logging, options."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
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
    DiskFullError,
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
from deltastore.store.fsspec_store import command_deadline

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_STORE = 4
EXIT_DAMAGED = 5
EXIT_MISMATCH = 6
EXIT_CONFLICT = 7
EXIT_NO_SPACE = 8
EXIT_INTERRUPTED = 130

#: First match wins: specific classes before their bases.
EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (ObjectNotFoundError, EXIT_NOT_FOUND),
    (VersionExistsError, EXIT_CONFLICT),
    (DiskFullError, EXIT_NO_SPACE),  # before StoreError: a full local store is both
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
    """Log to stderr: rich columns on a terminal; one unwrapped line per record otherwise
    (log files and pipes get whole messages, not text wrapped at 80 columns)."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    handler: logging.Handler
    if err_console.is_terminal:
        handler = RichHandler(console=err_console, show_path=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
        )
    logging.basicConfig(level=level, handlers=[handler], force=True)


def exit_code(exc: BaseException) -> int:
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return EXIT_ERROR


@dataclass
class Run:
    """Where the process stands (one command per process)."""

    #: Set by :func:`deltastore_cli.main`: the process ends with the command (not CliRunner).
    console_script: bool = False
    #: The command's outcome is decided: its work finished or failed (reset when a command
    #: starts: in-process runs such as tests run several commands in one process).
    settled: bool = False
    #: "interrupted" was printed.
    interrupt_reported: bool = False
    #: ``--json`` was given (before or after the command): errors are also a JSON object.
    json: bool = False
    #: When the command started (``time.monotonic()``): ``--timeout`` counts from here.
    started: float = 0.0
    #: Closed when the command ends: the deadline of ``--timeout``.
    cleanup: ExitStack = field(default_factory=ExitStack)


RUN = Run()


def settle() -> None:
    """The command's outcome is decided: from here on, in the console script, Ctrl-C is
    ignored, so a result that is printed is the result the process exits with.

    Every command calls it once its work is done, right before it prints the result; the
    error handler (:func:`command_failed`) calls it when the work fails. An error raised after
    it (while printing) is not the command's outcome and is not handled. Signals are changed
    only from the main thread."""
    RUN.settled = True
    if RUN.console_script and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def report_interrupt() -> None:
    """The one line printed for a Ctrl-C during a command's work (exit 130)."""
    if not RUN.interrupt_reported:
        RUN.interrupt_reported = True
        err_console.print("interrupted", highlight=False)


#: What ends a command with one line and an exit code (:func:`command_failed`): Ctrl-C and
#: these errors. Any other exception is a bug and keeps its traceback.
HANDLED: tuple[type[BaseException], ...] = (KeyboardInterrupt, DeltastoreError, OSError, ValueError)


def print_error(message: str) -> None:
    """The one error line on stderr: ``error: <message>``, the message printed verbatim (never
    read as rich markup)."""
    err_console.print(Text.assemble(("error:", "red"), " ", message), highlight=False)


def print_json_error(code: int, kind: str, message: str) -> None:
    """Under ``--json``, an error is also one JSON line on stdout, where the result would
    have been: ``{"error": {"code": <exit code>, "type": "<error class>", "message": "..."}}``
    (docs/cli.md, "Output")."""
    if RUN.json:
        print_json({"error": {"code": code, "type": kind, "message": message}})


def command_failed(exc: BaseException, *, verbose: int) -> typer.Exit:
    """The one error handler: settle the outcome, print the line for ``exc`` (a
    :data:`HANDLED` exception that ended a command's work) and return the :class:`typer.Exit`
    to raise: the code of :func:`exit_code`, or 130 and "interrupted" for Ctrl-C.

    Call it inside the ``except`` block: with ``verbose`` (``-v``) the traceback of the
    exception being handled comes first. The app's group calls it for every command
    (``deltastore_cli.app.App``); commands do not catch these errors themselves."""
    settle()
    if isinstance(exc, KeyboardInterrupt):
        print_json_error(EXIT_INTERRUPTED, "KeyboardInterrupt", "interrupted")
        report_interrupt()
        return typer.Exit(EXIT_INTERRUPTED)
    if verbose:
        err_console.print_exception()
    code = exit_code(exc)
    print_json_error(code, type(exc).__name__, str(exc))
    print_error(str(exc))
    return typer.Exit(code)


def parse_storage_options(
    items: list[str] | None, *, timeout: float | None = None, deadline: bool = True
) -> dict[str, Any] | None:
    """``KEY=VALUE`` pairs; VALUE is JSON when it parses (true, 3, "x"), else a string.

    ``timeout`` (``--timeout``) becomes the ``timeout`` storage option, over ``-o timeout=``,
    and, with ``deadline`` (every command but ``pull --watch``), the whole command's deadline:
    :func:`~deltastore.store.fsspec_store.command_deadline`, counted from the command's start
    and lifted when it ends."""
    if timeout is not None and deadline:
        RUN.cleanup.enter_context(command_deadline(timeout, start=RUN.started or None))
    if not items and timeout is None:
        return None
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"expected KEY=VALUE, got {item.split('=')[0]!r}...")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    if timeout is not None:
        out["timeout"] = timeout
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


def human_bytes(n: float | None) -> str:
    """``n`` bytes in decimal units (``12.29 kB``); "size unknown" for None (stores that do
    not report sizes). Never rounds a nonzero size to "0 B" or up to "1000 kB"."""
    if n is None:
        return "size unknown"
    if abs(n) < 1000:
        return f"{int(n)} B" if float(n).is_integer() else f"{n:.2f} B"
    for unit in ("kB", "MB", "GB", "TB"):
        n /= 1000
        if abs(n) < 999.995 or unit == "TB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover
