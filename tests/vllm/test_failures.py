"""Failures on one rank of a TP-2 engine leave it serving, in step and at its version.

One engine (``failures_engine.py``, multiprocess workers, TP 2) meets: a layout that does not
fit rank 1 (``failures_layout.py``), attached twice with no binding and once over one, and a
corrupted frame that one rank fetches. The driver gets the typed error of the rank that failed;
the engine's outputs stay equal to those of a fresh engine loaded from the version it holds
(``conftest.reference``); every later call's replies answer that call (vLLM's
``collective_rpc`` stops reading at the first rank that raised, so an error raised past the
extension would leave a reply queued for the next call); good attaches and syncs then work.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tools
from conftest import Chain

START = 1  # the engine loads version 1, syncs to 2; 3 is corrupted, then repaired


def run_failures_engine(args: list[str], timeout: float = 900) -> Any:
    """``failures_engine.py args...`` at TP 2 in processes of their own; its JSON result."""
    return tools.run_engine(args, 2, True, timeout, script="failures_engine.py")


# a TP-2 engine and a third TP-2 reference: about 4 minutes, more than CI can spend on it; the
# fake engine of tests/test_engines_vllm.py checks the same agreement in the main suite
@pytest.mark.full
def test_tp2_failures_on_one_rank_keep_the_engine_serving_and_in_step(
    chain: Callable[[str], Chain], reference: Any, tmp_path: Path
) -> None:
    c = chain("qwen3")
    refs = reference("qwen3", 2, [START, START + 1, START + 2])
    assert refs[START] != refs[START + 1] != refs[START + 2], "versions are indistinguishable"
    store = c.store_copy(tmp_path / "store")
    out = run_failures_engine([str(c.folders[START]), str(store), str(START)])
    assert out["start"] == refs[START]

    # a layout that fails on rank 1 only: rank 1's LayoutError, the engine serves on
    bad = out["bad_attach"]
    assert bad["type"] == "LayoutError", bad
    assert bad["message"].startswith("rank 1: the test layout does not fit TP rank 1 of 2"), bad
    assert out["after_bad_attach"] == refs[START]
    # the next call's replies answer it: both ranks are unbound (not rank 1's attach reply)
    info = out["info_unbound"]
    assert [(r["rank"], r["ok"], r["call"]) for r in info] == [
        (0, False, "info-1"),
        (1, False, "info-1"),
    ]
    assert all("not attached" in r["error"]["message"] for r in info), info
    # the retry fails the same way, with replies of its own: rank 1 failed, rank 0 stopped
    retry = out["retry_raw"]
    assert [(r["rank"], r["call"]) for r in retry] == [(0, "retry"), (1, "retry")]
    assert [r["error"]["type"] for r in retry] == ["RankError", "LayoutError"], retry
    assert "rank 1 of the engine failed" in retry[0]["error"]["message"]

    # a good attach works; the bad layout over it fails and keeps the binding
    assert [(r["rank"], r["ok"], r["version"]) for r in out["attach"]] == [
        (0, True, 1),
        (1, True, 1),
    ]
    assert out["bad_over_binding"]["type"] == "LayoutError"
    assert out["bad_over_binding"]["message"].startswith("rank 1: ")
    bound = out["info_bound"]
    assert [(r["ok"], r["version"], r["reader_id"], r["call"]) for r in bound] == [
        (True, START, "failures", "info-2")
    ] * 2
    for r in out["sync_next"]:
        assert r["ok"] and r["version"] == START + 1 and r["report"]["applied"] == [START + 1]
    assert out["after_sync_next"] == refs[START + 1]

    # a corrupted frame, fetched by one rank: that rank's integrity error, the other stopped
    results = out["corrupt_results"]
    assert [r["version"] for r in results] == [START + 1] * 2
    assert all(not r["ok"] for r in results)
    types = [r["error"]["type"] for r in results]
    assert sorted(types) in (["FrameError", "RankError"], ["IntegrityError", "RankError"]), types
    failed = types.index("RankError") ^ 1
    raised = out["corrupt_raised"]
    assert raised["type"] == types[failed], raised
    assert raised["message"].startswith(f"rank {failed}: "), raised
    assert f"versions/{START + 2:020d}/" in raised["message"]
    assert out["after_corrupt"] == refs[START + 1], "after a failed sync: the previous version"
    status = out["status_after_corrupt"]
    assert [(r["ok"], r["version"], r["call"]) for r in status] == [(True, START + 1, "st")] * 2
    # the frame repaired: the same sync works
    for r in out["sync_repaired"]:
        assert r["ok"] and r["version"] == START + 2, r
    assert out["after_repaired"] == refs[START + 2]
