"""Fixtures of the vLLM tests (``make test-vllm``, under ``.venv-vllm``): tiny models, the
chains a trainer published, checkpoint folders per version and reference outputs of fresh
engines, each made once per session."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tools

#: versions published: 0 (the initial weights), deltas 1-5, 6 an anchor (after a corrupted 5)
LAST = 6
ANCHORS = {LAST}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "full: longer engine runs, deselected by make test-vllm")


@dataclass(frozen=True)
class Chain:
    """A model, the store its trainer published to, and a checkpoint folder per version."""

    arch: str
    model: Path
    store: Path
    folders: dict[int, Path]

    def store_copy(self, dest: Path) -> Path:
        """A copy of the store (for tests that damage or lease it)."""
        shutil.copytree(self.store, dest)
        return dest


@pytest.fixture(scope="session")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def chain(work: Path) -> Callable[[str], Chain]:
    made: dict[str, Chain] = {}

    def get(arch: str) -> Chain:
        if arch not in made:
            base = work / arch
            model = tools.build_model(arch, base / "model")
            store = base / "store"
            tools.train_and_publish(model, store, LAST, ANCHORS)
            folders = tools.pull_folders(store, model, base / "checkpoints", list(range(LAST + 1)))
            made[arch] = Chain(arch, model, store, folders)
        return made[arch]

    return get


@pytest.fixture(scope="session")
def reference(chain: Callable[[str], Chain]) -> Callable[[str, int, list[int]], dict[int, Any]]:
    """Outputs of fresh engines (one per version's checkpoint folder) at TP 1 or 2."""
    made: dict[tuple[str, int, int], Any] = {}

    def get(arch: str, tp: int, versions: list[int]) -> dict[int, Any]:
        c = chain(arch)
        todo = [v for v in versions if (arch, tp, v) not in made]
        # TP 1: one process, an engine per folder; TP 2: a process per engine (a second
        # multiprocess engine in one driver process hangs at start-up)
        batches = [todo] if tp == 1 else [[v] for v in todo]
        for batch in batches if todo else []:
            folders = [str(c.folders[v]) for v in batch]
            got = tools.run_engine(["reference", *folders, "--tp", str(tp)], tp, tp > 1)
            for v, f in zip(batch, folders, strict=True):
                made[arch, tp, v] = got[f]
        return {v: made[arch, tp, v] for v in versions}

    return get
