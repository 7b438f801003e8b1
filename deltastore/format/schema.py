"""Regenerate or check the committed JSON Schema.

``python -m deltastore.format.schema --write PATH`` (``make schema``)."""

from __future__ import annotations

import argparse
import sys

from deltastore.format.manifest import json_schema


def main(argv: list[str] | None = None) -> int:
    """Write (``--write``) or check (``--check``) the committed JSON Schema file."""
    ap = argparse.ArgumentParser(prog="python -m deltastore.format.schema")
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", metavar="PATH")
    group.add_argument("--check", metavar="PATH")
    args = ap.parse_args(argv)
    text = json_schema()
    if args.write:
        with open(args.write, "w", encoding="utf-8") as fh:
            fh.write(text)
        return 0
    with open(args.check, encoding="utf-8") as fh:
        if fh.read() != text:
            print(f"{args.check} is out of date: run `make schema`", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
