"""How ``--help`` and usage lines show parameters (the command and group classes of the CLI).

- Arguments are shown by an upper-case metavar everywhere (``STORE DEST``), required ones
  bare and optional ones in brackets, as click does: typer would write ``{store} {dest}``.
- Flags (``--json``, ``--help``, ``-v``...) take no value, so no value type is shown for them
  (typer's rich help writes ``<bool>`` and ``<int>`` as if they took one).
- A command's line in ``deltastore --help`` is its docstring's first paragraph on one line
  (typer's rich help keeps the docstring's line breaks there, mid-sentence).
"""

from __future__ import annotations

from typing import Any

import typer.core


def _tidy(params: list[Any]) -> None:
    """Give arguments an upper-case metavar and flags an empty one (idempotent)."""
    for p in params:
        if p.metavar is not None:
            continue
        if p.param_type_name == "argument" and p.name:
            p.metavar = p.name.upper()
        elif p.param_type_name == "option" and (
            getattr(p, "is_flag", False) or getattr(p, "count", False)
        ):
            p.metavar = ""


class Command(typer.core.TyperCommand):
    """A subcommand: ``deltastore pull [OPTIONS] STORE DEST``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.short_help is None and self.help:
            first = self.help.strip().split("\n\n")[0]
            self.short_help = " ".join(first.split())

    def get_params(self, ctx: Any) -> list[Any]:
        params: list[Any] = super().get_params(ctx)
        _tidy(params)
        return params

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for p in self.get_params(ctx):
            if p.param_type_name == "argument":
                name = p.metavar or ""
                name = name if p.required else f"[{name}]"
                pieces.append(name + ("..." if p.nargs != 1 else ""))
            else:
                pieces.extend(p.get_usage_pieces(ctx))
        return pieces


class Group(typer.core.TyperGroup):
    """The ``deltastore`` group: its own flags (``--version``, ``-q``, ``-v``) as above."""

    def get_params(self, ctx: Any) -> list[Any]:
        params: list[Any] = super().get_params(ctx)
        _tidy(params)
        return params
