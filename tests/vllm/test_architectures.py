"""The architecture matrix (``make test-vllm-full``): for each architecture, a tiny random model
from the installed transformers, 5 AdamW versions, and an engine that follows them through
deltastore with the layout it derives itself (no hand-written layout). After each version its
greedy ids and first-token logprobs equal those of a fresh engine loaded from that version's
checkpoint folder, and the sync refreshed exactly the modules that read a changed tensor (a tied
LM head with the embedding, MLA attention with its ``kv_b_proj``).

Every engine runs in a process of its own (``engine.py``): TP 1 in-process, TP 2 with a worker
process per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tools
from conftest import Chain
from test_engine import check_distinct, manifest

VERSIONS = [1, 2, 3, 4, 5]

#: Architectures followed at TP 1; the LM head of those with ``+tied`` (and Gemma's) is the
#: embedding.
TP1 = [
    "deepseek_v2",
    "gemma3_text",
    "phi3",
    "qwen2_moe",
    "olmoe",
    "gemma2",
    "llama+tied",
    "qwen3+tied",
    "qwen3",
    "qwen2",
]
#: One dense tied model and one MoE (with a shared expert) at TP 2.
TP2 = ["llama+tied", "qwen2_moe"]


def changed_tensors(store: Path, v: int) -> set[str]:
    """The HF tensors version ``v`` changed (all of them for an anchor)."""
    m = manifest(store, v)
    anchor = m.get("kind") == "anchor"
    return {n for n, t in m["tensors"].items() if anchor or t["changed"]}


def check_refresh(attached: dict[str, Any], step: dict[str, Any], store: Path) -> None:
    """The sync refreshed every module that reads a tensor the version changed, and only those,
    each once; none is left pending."""
    consumers = attached["consumers"]
    changed = changed_tensors(store, step["target"])
    for r in step["results"]:
        expected = {n for n, c in consumers.items() if changed & set(c["sources"])}
        assert sorted(r["refreshed"]) == sorted(set(r["refreshed"])), r["refreshed"]
        assert set(r["refreshed"]) == expected, (
            f"version {step['target']} rank {r['rank']}: refreshed {sorted(r['refreshed'])}, "
            f"expected {sorted(expected)}"
        )
        assert r["pending"] == []


def tied(arch: str) -> bool:
    return arch.endswith(tools.TIED) or arch.removesuffix(tools.TIED) in tools.ALWAYS_TIED


def follow(
    arch: str, tp: int, chain: Callable[[str], Chain], reference: Any, tmp_path: Path
) -> None:
    c = chain(arch)
    refs = reference(arch, tp, VERSIONS)
    check_distinct(refs)
    store = c.store_copy(tmp_path / "store")
    out = tools.run_engine(
        ["follow", str(c.folders[0]), str(store), ",".join(map(str, VERSIONS)), "--tp", str(tp)],
        tp=tp, multiprocess=tp > 1,
    )  # fmt: skip
    assert [a["rank"] for a in out["attached"]] == list(range(tp))
    for att in out["attached"]:
        kinds = {c["kind"] for c in att["consumers"].values()}
        assert "quant" in kinds  # CPU: the packed kernels are rebuilt from shadows
        if arch == "deepseek_v2":  # MLA's W_UV / W_UK_T are computed from kv_b_proj
            mla = [n for n, c in att["consumers"].items() if c["kind"] == "attention"]
            assert len(mla) == 2, att["consumers"]
            for n in mla:
                assert any("kv_b_proj" in s for s in att["consumers"][n]["sources"]), n
        # a tied LM head holds the embedding's weight and is refreshed with it (on CPUs whose
        # kernel packs a copy of it, outputs would otherwise go stale; this machine's kernel
        # reads it in place, so the outputs alone cannot show it)
        shared = att["shared_modules"]
        if tied(arch) and arch.removesuffix(tools.TIED) != "gemma2":
            assert shared == {"lm_head": "model.embed_tokens.weight"}, shared
            assert att["consumers"]["lm_head"]["sources"] == ["model.embed_tokens.weight"]
        else:  # Gemma2 computes its logits with the embedding module itself
            assert shared == {}, shared
    for step in out["steps"]:
        v = step["target"]
        for r in step["results"]:
            assert r["ok"], r["error"]
            assert r["version"] == v and r["report"]["applied"] == [v]
        check_refresh(out["attached"][0], step, store)
        if tied(arch) and "model.embed_tokens.weight" in changed_tensors(store, v):
            assert all("lm_head" in r["refreshed"] or arch == "gemma2" for r in step["results"])
        assert step["outputs"] == refs[v], f"{arch} TP {tp} version {v}: the outputs differ"


@pytest.mark.full
@pytest.mark.parametrize("arch", TP1)
def test_tp1_follows_every_version(
    arch: str, chain: Callable[[str], Chain], reference: Any, tmp_path: Path
) -> None:
    follow(arch, 1, chain, reference, tmp_path)


@pytest.mark.full
@pytest.mark.parametrize("arch", TP2)
def test_tp2_follows_every_version(
    arch: str, chain: Callable[[str], Chain], reference: Any, tmp_path: Path
) -> None:
    follow(arch, 2, chain, reference, tmp_path)
