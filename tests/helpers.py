"""Helpers shared by several test modules: the console script, an environment without torch,
a checkpoint folder's tensor bytes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from deltastore.checkpoint.safetensors import locate

#: What the fake ``torch`` package of :func:`no_torch_env` raises on import.
FORBIDDEN = "torch was imported: this test forbids it"


def console_script() -> str:
    """Path of the installed ``deltastore`` script (skips the test where it is not installed)."""
    exe = Path(sys.executable).parent / "deltastore"
    found = str(exe) if exe.is_file() else shutil.which("deltastore")
    if found is None:
        pytest.skip("the deltastore console script is not installed")
    return found


def no_torch_env(fake: Path, cache: Path) -> dict[str, str]:
    """Environment whose ``import torch`` raises ImportError (a ``torch`` package written into
    ``fake`` comes first on PYTHONPATH), with the publisher state cache in ``cache`` and no
    signing key from the shell. Checks that the fake works."""
    (fake / "torch").mkdir()
    (fake / "torch" / "__init__.py").write_text(f"raise ImportError({FORBIDDEN!r})\n")
    env = {k: v for k, v in os.environ.items() if k != "DELTASTORE_SIGNING_KEY"}
    env["PYTHONPATH"] = os.pathsep.join([str(fake), *filter(None, [env.get("PYTHONPATH")])])
    env["XDG_CACHE_HOME"] = str(cache)
    check = subprocess.run(
        [sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True
    )
    assert check.returncode != 0 and FORBIDDEN in check.stderr  # the fake works
    return env


def folder_bytes(dest: Path) -> dict[str, bytes]:
    """Each tensor's bytes as the checkpoint folder's files hold them."""
    out = {}
    for name, loc in locate(dest).items():
        with open(loc.path, "rb") as fh:
            fh.seek(loc.start)
            out[name] = fh.read(loc.stop - loc.start)
    return out


class ThreadRanks:
    """``world`` ranks, a thread each, whose ``all_gather_bytes`` is real (the ranks wait for
    each other, at most 30 s): the collective of ``worker_errors.agree`` without torch."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.slots = [b""] * world
        self.gather = threading.Barrier(world, timeout=30)

    def view(self, rank: int) -> Any:
        """Rank ``rank``'s group: ``rank`` and ``all_gather_bytes(data) -> [data of each rank]``."""
        ranks = self

        class View:
            def __init__(self) -> None:
                self.rank = rank

            def all_gather_bytes(self, data: bytes) -> list[bytes]:
                ranks.slots[rank] = data
                ranks.gather.wait()
                out = list(ranks.slots)
                ranks.gather.wait()
                return out

        return View()
