"""vLLM presets: every rank's local tensors, synced through the layout, equal bit-wise an
independent re-sharding (plain torch ops) of the trainer's HF tensors, at every version."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import deltastore.tensors.words as words_module
from deltastore import Publisher, Subscriber
from deltastore.errors import LayoutError, TensorMismatchError
from deltastore.format.manifest import Manifest
from deltastore.layout.boxes import Layout
from deltastore.layout.presets import ModelSpec, hf_shapes, padded_vocab, vllm_layout
from deltastore.store import open_store
from deltastore.testing.synthetic import AdamWTrajectory, ModelConfig
from tests.test_stores_e2e import CountingStore

VERSIONS = 5  # an anchor and 4 AdamW deltas
_SIZES = {"vocab": 1000, "hidden": 64, "layers": 2, "intermediate": 128, "head_dim": 16}
#: Qwen2-like: GQA (2 kv heads: at TP 4 each kv head is on 2 ranks), q/k/v biases.
QWEN2 = ModelConfig(**_SIZES, heads=8, kv_heads=2, qkv_bias=True, family="qwen2")
#: Qwen3-like: q/k norms, tied embeddings (no lm_head).
QWEN3 = ModelConfig(
    **_SIZES, heads=8, kv_heads=2, qk_norm=True, tie_word_embeddings=True, family="qwen3"
)
_MOE = {"heads": 4, "kv_heads": 2, "experts": 4, "moe_intermediate": 32}
QWEN3_MOE = ModelConfig(**_SIZES, **_MOE, qk_norm=True, family="qwen3_moe")
MIXTRAL = ModelConfig(**_SIZES, **_MOE, family="mixtral")

Ranks = list[tuple[int, int, int, int]]  # (tp_rank, tp_size, ep_rank, ep_size) per rank


def tp_ranks(tp: int) -> Ranks:
    return [(r, tp, 0, 1) for r in range(tp)]


def tp_ep_ranks(tp: int, ep: int) -> Ranks:
    return [(t, tp, e, ep) for e in range(ep) for t in range(tp)]


def engine_layout(spec: ModelSpec, ranks: Ranks) -> Layout:
    """All ranks of one engine in one process: rank r's tensors are named ``rank{r}/...``."""
    return sum(
        (
            vllm_layout(spec, tp_rank=t, tp_size=ts, ep_rank=e, ep_size=es).prefixed(f"rank{r}/")
            for r, (t, ts, e, es) in enumerate(ranks)
        ),
        Layout({}),
    )


# --- the independent reference: plain torch ops over whole HF tensors ------------------------


def reference(
    full: dict[str, torch.Tensor], spec: ModelSpec, tp_rank: int, tp: int, ep_rank: int, ep: int
) -> dict[str, torch.Tensor]:
    """What vLLM rank (tp_rank, ep_rank) holds, cut out of the full HF tensors."""

    def col(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, 0)[tp_rank]

    def row(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp, 1)[tp_rank]

    def vocab(t: torch.Tensor) -> torch.Tensor:
        padded = (spec.vocab + 63) // 64 * 64
        t = F.pad(t, (0, 0, 0, padded - spec.vocab))  # zero rows at the end
        return t.chunk(tp, 0)[tp_rank]

    def heads(t: torch.Tensor, n: int) -> torch.Tensor:
        """This rank's heads of a [n * head_dim, ...] projection (kv heads repeat past n)."""
        per_head = t.unflatten(0, (n, spec.head_dim))
        if tp >= n:  # one head, shared by tp // n consecutive ranks
            return per_head[tp_rank // (tp // n)]
        return per_head.chunk(tp, 0)[tp_rank].flatten(0, 1)

    out = {"model.embed_tokens.weight": vocab(full["model.embed_tokens.weight"])}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        out[p + "input_layernorm.weight"] = full[p + "input_layernorm.weight"]
        for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
            out[a + "qkv_proj." + kind] = torch.cat(
                [
                    heads(full[a + "q_proj." + kind], spec.heads),
                    heads(full[a + "k_proj." + kind], spec.kv_heads),
                    heads(full[a + "v_proj." + kind], spec.kv_heads),
                ]
            )
        if spec.qk_norm:
            out[a + "q_norm.weight"] = full[a + "q_norm.weight"]
            out[a + "k_norm.weight"] = full[a + "k_norm.weight"]
        out[a + "o_proj.weight"] = row(full[a + "o_proj.weight"])
        out[p + "post_attention_layernorm.weight"] = full[p + "post_attention_layernorm.weight"]
        if spec.experts:
            moe, w1, w3, w2 = {
                "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
            }[spec.family]
            mine = range(ep_rank * (spec.experts // ep), (ep_rank + 1) * (spec.experts // ep))
            x = [f"{p}{moe}.experts.{e}." for e in mine]
            out[f"{p}{moe}.gate.weight"] = full[f"{p}{moe}.gate.weight"]
            out[f"{p}{moe}.experts.w13_weight"] = torch.stack(
                [
                    torch.cat([col(full[e + w1 + ".weight"]), col(full[e + w3 + ".weight"])])
                    for e in x
                ]
            )
            out[f"{p}{moe}.experts.w2_weight"] = torch.stack(
                [row(full[e + w2 + ".weight"]) for e in x]
            )
        else:
            gate, up = full[p + "mlp.gate_proj.weight"], full[p + "mlp.up_proj.weight"]
            out[p + "mlp.gate_up_proj.weight"] = torch.cat([col(gate), col(up)])
            out[p + "mlp.down_proj.weight"] = row(full[p + "mlp.down_proj.weight"])
    out["model.norm.weight"] = full["model.norm.weight"]
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = vocab(full["lm_head.weight"])
    return out


def engine_reference(
    full: dict[str, torch.Tensor], spec: ModelSpec, ranks: Ranks
) -> dict[str, torch.Tensor]:
    return {
        f"rank{r}/{name}": t
        for r, cut in enumerate(ranks)
        for name, t in reference(full, spec, *cut).items()
    }


def assert_bits_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), name


# --- stores ---------------------------------------------------------------------------------


Published = tuple[Path, list[dict[str, torch.Tensor]]]


@pytest.fixture(scope="module")
def publish(tmp_path_factory: pytest.TempPathFactory) -> Callable[[ModelConfig], Published]:
    """config -> (store, the trainer's bf16 tensors per version); each store written once."""
    done: dict[ModelConfig, Published] = {}

    def get(config: ModelConfig) -> Published:
        if config not in done:
            store = tmp_path_factory.mktemp(config.family)
            traj = AdamWTrajectory(config, lr=1e-6, seed=5)
            pub = Publisher(store, max_frame_bytes=4096, max_object_bytes=64 << 10)
            states = [traj.bf16()]
            pub.publish(states[0], version=1)
            for v in range(2, VERSIONS + 1):
                states.append(traj.step())
                assert pub.publish(states[-1], version=v).kind == "delta"
            done[config] = (store, states)
        return done[config]

    return get


# --- every rank bit-exact at every version ----------------------------------------------------


@pytest.mark.parametrize(
    ("config", "ranks"),
    [
        pytest.param(QWEN2, tp_ranks(1), id="qwen2-tp1"),
        pytest.param(QWEN2, tp_ranks(2), id="qwen2-tp2"),
        pytest.param(QWEN2, tp_ranks(4), id="qwen2-tp4"),
        pytest.param(QWEN3, tp_ranks(1), id="qwen3-tp1"),
        pytest.param(QWEN3, tp_ranks(2), id="qwen3-tp2"),
        pytest.param(QWEN3, tp_ranks(4), id="qwen3-tp4"),
        pytest.param(QWEN3_MOE, tp_ep_ranks(2, 2), id="qwen3_moe-tp2-ep2"),
        pytest.param(MIXTRAL, tp_ep_ranks(2, 2), id="mixtral-tp2-ep2"),
        pytest.param(MIXTRAL, tp_ep_ranks(1, 4), id="mixtral-tp1-ep4"),
    ],
)
def test_every_rank_bit_exact_at_every_version(
    publish: Callable[[ModelConfig], Published], config: ModelConfig, ranks: Ranks
) -> None:
    store, states = publish(config)
    layout = engine_layout(config, ranks)
    sub = Subscriber(store, layout=layout, max_workers=2)
    pad = padded_vocab(config) - config.vocab
    for v, state in enumerate(states, start=1):
        report = sub.sync(v)
        assert report.kind == ("anchor" if v == 1 else "delta")
        assert sub.tensors is not None
        assert_bits_equal(dict(sub.tensors), engine_reference(state, config, ranks))
        last = f"rank{len(ranks) - 1}/model.embed_tokens.weight"
        assert pad > 0 and not sub.tensors[last][-pad:].view(torch.int16).any()
    sub.verify()


def test_local_shapes_of_real_models() -> None:
    """Shapes vLLM allocates, for configs as HF publishes them (one layer, to stay fast)."""
    qwen3_moe = {  # Qwen3-30B-A3B
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "intermediate_size": 6144,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "moe_intermediate_size": 768,
        "tie_word_embeddings": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    spec = dataclasses.replace(ModelSpec.from_hf_config(qwen3_moe), layers=1)
    assert spec.qk_norm and not spec.qkv_bias and spec.experts == 128
    got = vllm_layout(spec, tp_rank=3, tp_size=4).bind(hf_shapes(spec)).local_shapes
    p = "model.layers.0."
    assert got["model.embed_tokens.weight"] == (37984, 2048)
    assert got[p + "self_attn.qkv_proj.weight"] == ((8 + 1 + 1) * 128, 2048)
    assert got[p + "self_attn.o_proj.weight"] == (2048, 1024)
    assert got[p + "self_attn.q_norm.weight"] == (128,)
    assert got[p + "mlp.gate.weight"] == (128, 2048)
    assert got[p + "mlp.experts.w13_weight"] == (128, 384, 2048)
    assert got[p + "mlp.experts.w2_weight"] == (128, 2048, 192)

    qwen25 = {  # Qwen2.5-0.5B: 14 heads, 2 kv heads, tied, no head_dim key
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "intermediate_size": 4864,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    }
    spec = dataclasses.replace(ModelSpec.from_hf_config(qwen25), layers=1)
    assert spec.head_dim == 64 and spec.qkv_bias and spec.tie_word_embeddings
    got = vllm_layout(spec, tp_rank=1, tp_size=2).bind(hf_shapes(spec)).local_shapes
    assert "lm_head.weight" not in got and "lm_head.weight" not in hf_shapes(spec)
    assert got[p + "self_attn.qkv_proj.weight"] == ((7 + 1 + 1) * 64, 896)
    assert got[p + "self_attn.qkv_proj.bias"] == ((7 + 1 + 1) * 64,)
    assert got[p + "mlp.gate_up_proj.weight"] == (4864, 896)
    assert got[p + "mlp.down_proj.weight"] == (896, 2432)

    mixtral = {  # Mixtral-8x7B: experts' intermediate is intermediate_size
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
    }
    spec = dataclasses.replace(ModelSpec.from_hf_config(mixtral), layers=1)
    got = vllm_layout(spec, tp_rank=0, tp_size=8, ep_rank=1, ep_size=2).bind(hf_shapes(spec))
    shapes = got.local_shapes
    assert shapes[p + "block_sparse_moe.experts.w13_weight"] == (4, 2 * 14336 // 8, 4096)
    assert shapes[p + "block_sparse_moe.experts.w2_weight"] == (4, 4096, 14336 // 8)
    assert shapes["lm_head.weight"] == (4000, 4096)
    held = {n for n in got.placements if ".experts." in n}
    assert held == {
        f"{p}block_sparse_moe.experts.{e}.{w}.weight"
        for e in range(4, 8)
        for w in ("w1", "w2", "w3")
    }


# --- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: vllm_layout(QWEN2, tp_size=3), r"heads=8 is not divisible by tp_size=3"),
        (
            lambda: vllm_layout(dataclasses.replace(QWEN2, heads=12, kv_heads=4), tp_size=6),
            r"kv_heads=4 and tp_size=6: one must divide the other",
        ),
        (
            lambda: vllm_layout(dataclasses.replace(QWEN2, intermediate=130), tp_size=4),
            r"intermediate=130 is not divisible by tp_size=4",
        ),
        (
            lambda: vllm_layout(dataclasses.replace(MIXTRAL, moe_intermediate=30), tp_size=4),
            r"moe_intermediate=30 is not divisible by tp_size=4",
        ),
        (lambda: vllm_layout(MIXTRAL, ep_size=3), r"experts=4 is not divisible by ep_size=3"),
        (lambda: vllm_layout(QWEN2, ep_size=2), r"ep_size=2 for a model without experts"),
        (lambda: vllm_layout(QWEN2, tp_rank=2, tp_size=2), r"tp_rank 2 is not in \[0, tp_size=2\)"),
        (
            lambda: vllm_layout(dataclasses.replace(QWEN2, vocab=999), pad_vocab_to=1, tp_size=2),
            r"vocab 999 padded .* does not split over tp_size=2",
        ),
        (lambda: ModelConfig(experts=4, moe_intermediate=8), r"family 'qwen2' with experts=4"),
        (lambda: ModelConfig(family="qwen3_moe"), r"MoE families .* need experts > 0"),
        (lambda: ModelConfig(heads=16, kv_heads=3), r"heads=16 is not a multiple of kv_heads=3"),
        (lambda: ModelSpec.from_hf_config({"model_type": "gpt2"}), r"model_type 'gpt2'"),
        (
            lambda: ModelSpec.from_hf_config({"model_type": "llama", "attention_bias": True}),
            r"llama with attention_bias",
        ),
        (
            lambda: ModelSpec.from_hf_config({"model_type": "qwen3_moe", "mlp_only_layers": [0]}),
            r"qwen3_moe with dense layers",
        ),
    ],
)
def test_impossible_configs(make: Callable[[], object], message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        make()


def test_wrong_local_shape(publish: Callable[[ModelConfig], Published]) -> None:
    store, states = publish(QWEN2)
    ranks = tp_ranks(2)
    tensors = {n: torch.zeros_like(t) for n, t in engine_reference(states[0], QWEN2, ranks).items()}
    bad = "rank1/model.layers.1.self_attn.o_proj.weight"
    tensors[bad] = torch.zeros(64, 65, dtype=torch.bfloat16)
    sub = Subscriber(store, tensors=tensors, layout=engine_layout(QWEN2, ranks))
    with pytest.raises(
        LayoutError, match=rf"{bad}'?: shape \[64, 65\], the layout gives \[64, 64\]"
    ):
        sub.sync(1)


def test_missing_global_tensor(publish: Callable[[ModelConfig], Published]) -> None:
    store, _ = publish(QWEN3)  # no q/k/v biases, tied embeddings
    spec = dataclasses.replace(QWEN3, qkv_bias=True)
    with pytest.raises(LayoutError, match=r"'model\.layers\.0\.self_attn\.q_proj\.bias' is not in"):
        vllm_layout(spec).bind(hf_shapes(QWEN3))
    untied = dataclasses.replace(QWEN3, tie_word_embeddings=False)
    sub = Subscriber(store, layout=engine_layout(untied, tp_ranks(2)))
    with pytest.raises(
        LayoutError, match=r"global tensor 'lm_head\.weight' is not in the manifest"
    ):
        sub.sync(1)
    assert sub.version is None


def test_one_rank_alone_holds_partial_tensors(
    publish: Callable[[ModelConfig], Published],
) -> None:
    """One rank's layout in a process without its group: its shards cannot be verified."""
    store, _ = publish(QWEN2)
    sub = Subscriber(store, layout=vllm_layout(QWEN2, tp_rank=0, tp_size=2))
    with pytest.raises(LayoutError, match=r"the group holds only part of some tensors") as exc:
        sub.sync(1)
    assert "model.embed_tokens.weight: 32768 of 64000 elements" in str(exc.value)
    assert sub.version is None


# --- verification of split and repeated tensors ------------------------------------------------


@pytest.mark.parametrize(
    ("local", "index", "global_name"),
    [
        # a replicated norm: held by all 4 ranks; corrupt rank 2's copy only
        ("rank2/model.layers.1.input_layernorm.weight", 5, "model.layers.1.input_layernorm.weight"),
        # a GQA kv head, repeated on ranks 0 and 1 at TP 4: rows 32..47 of qkv_proj are k
        ("rank1/model.layers.0.self_attn.qkv_proj.weight", 32 * 64 + 3, "self_attn.k_proj.weight"),
        # a plain shard
        ("rank3/lm_head.weight", 7, "lm_head.weight"),
    ],
)
def test_verify_catches_one_bad_copy(
    publish: Callable[[ModelConfig], Published], local: str, index: int, global_name: str
) -> None:
    store, states = publish(QWEN2)
    ranks = tp_ranks(4)
    tensors = engine_reference(states[2], QWEN2, ranks)
    tensors = {n: t.clone() for n, t in tensors.items()}
    sub = Subscriber(store, tensors=tensors, version=3, layout=engine_layout(QWEN2, ranks))
    sub.verify()
    tensors[local].view(-1).view(torch.int16)[index] ^= 1
    with pytest.raises(TensorMismatchError, match=rf"Adler-32 mismatch: .*{global_name}"):
        sub.verify()
    tensors[local].view(-1).view(torch.int16)[index] ^= 1
    sub.verify()
    sub.sync(VERSIONS)
    assert_bits_equal(tensors, engine_reference(states[-1], QWEN2, ranks))


# --- fetching only what some box touches --------------------------------------------------------


def test_frames_no_box_touches_are_not_fetched(
    publish: Callable[[ModelConfig], Published],
) -> None:
    store_dir, states = publish(QWEN2)
    ranks = tp_ranks(2)
    keep = ("norm.weight", "embed_tokens.weight")
    full = engine_layout(QWEN2, ranks)
    layout = Layout({n: p for n, p in full.parts.items() if n.endswith(keep)})
    store = open_store(store_dir)
    counter = CountingStore(store)
    sub = Subscriber(store, layout=layout, max_workers=1)  # one thread: the counter is unlocked
    held = {n for n in hf_shapes(QWEN2) if n.endswith(keep)}
    assert len(held) == 2 * QWEN2.layers + 2

    def frame_bytes(m: Manifest, names: set[str]) -> int:
        return sum(f.length for n in names for f in m.tensors[n].frames)

    for v, state in enumerate(states, start=1):
        before = counter.fetched
        sub.sync(v)
        m = sub.manifest(v)
        assert counter.fetched - before == frame_bytes(m, held)
        assert frame_bytes(m, set(m.tensors)) > 3 * frame_bytes(m, held)
        assert sub.tensors is not None
        want = engine_reference(state, QWEN2, ranks)
        assert_bits_equal(dict(sub.tensors), {n: want[n] for n in layout.parts})


# --- pause / resume around the write phase -------------------------------------------------------


def test_pause_resume_around_writes(
    publish: Callable[[ModelConfig], Published], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, states = publish(QWEN3_MOE)
    ranks = tp_ep_ranks(2, 2)
    refs = [engine_reference(s, QWEN3_MOE, ranks) for s in states]
    events: list[tuple[str, int | None]] = []
    sub: Subscriber

    def at() -> int | None:
        """The version the local tensors equal bit-wise, if any."""
        if sub.tensors is None:
            return None
        cur = dict(sub.tensors)
        same = [
            v
            for v, ref in enumerate(refs, start=1)
            if all(
                torch.equal(cur[n].view(torch.int16), t.view(torch.int16)) for n, t in ref.items()
            )
        ]
        return same[-1] if same else None

    real = words_module.scatter
    calls = {"n": 0, "fail_at": -1}

    def flaky(words: torch.Tensor, positions: np.ndarray, values: np.ndarray) -> None:
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise OSError("device lost")
        real(words, positions, values)

    monkeypatch.setattr(words_module, "scatter", flaky)
    sub = Subscriber(
        store,
        layout=engine_layout(QWEN3_MOE, ranks),
        pause=lambda: events.append(("pause", at())),
        resume=lambda: events.append(("resume", at())),
    )
    sub.sync(1)  # fresh: the anchor is written between pause and resume
    assert events == [("pause", None), ("resume", 1)]
    for v in range(2, VERSIONS):
        events.clear()
        sub.sync(v)
        assert events == [("pause", v - 1), ("resume", v)]

    # A write that fails halfway: rolled back, resume still called, the next sync works.
    calls["n"], calls["fail_at"] = 0, 3
    events.clear()
    with pytest.raises(OSError, match="device lost"):
        sub.sync(VERSIONS)
    assert events == [("pause", VERSIONS - 1), ("resume", VERSIONS - 1)]
    assert sub.version == VERSIONS - 1
    calls["fail_at"] = -1
    sub.sync(VERSIONS)
    assert at() == VERSIONS


def test_synthetic_moe_model() -> None:
    assert QWEN3_MOE.shapes() == hf_shapes(QWEN3_MOE)
    names = set(MIXTRAL.shapes())
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in names
    assert not any(".mlp." in n for n in names)
    params = AdamWTrajectory(QWEN3, seed=0).params
    assert bool(params["model.layers.0.self_attn.q_norm.weight"].eq(1).all())
