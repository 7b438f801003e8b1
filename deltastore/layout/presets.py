"""Layout presets for vLLM-style engines: HF checkpoint names in, an engine rank's tensors out.

:class:`ModelSpec` describes a decoder-only transformer (read it from an HF ``config.json``
with :meth:`ModelSpec.from_hf_config`); :func:`hf_shapes` gives the global tensors the trainer
publishes under their HF names; :func:`vllm_layout` gives the :class:`~deltastore.layout.Layout`
of one engine rank, under the names vLLM's model classes use (``qkv_proj``, ``gate_up_proj``,
``experts.w13_weight``...), sharded the way vLLM's parallel layers shard them:

- ``embed_tokens`` / ``lm_head``: vocab-parallel; the vocabulary is padded up to a multiple of
  ``pad_vocab_to`` and each rank holds ``padded // tp_size`` rows (the rows past the
  vocabulary are padding, zero, never written);
- ``qkv_proj``: q, k and v sharded on dim 0 and fused; with more TP ranks than kv heads every
  rank holds one kv head (rank ``r`` holds head ``r // (tp_size // kv_heads)``);
- ``o_proj``, ``down_proj``, ``w2_weight``: row-parallel (dim 1); ``gate_up_proj``,
  ``w13_weight``: column-parallel (dim 0);
- norms and MoE routers: replicated;
- experts: expert-parallel rank ``ep_rank`` holds the contiguous block of ``experts //
  ep_size`` experts, stacked, their intermediate dim sharded by ``tp_rank`` / ``tp_size``.

Pure functions over frozen values; thread-safe.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from deltastore.errors import LayoutError
from deltastore.layout.boxes import Layout, Part, fuse, shard, stack

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"]
FAMILIES: tuple[str, ...] = get_args(Family)
_MOE: frozenset[str] = frozenset({"qwen3_moe", "mixtral"})
#: Per-expert HF weight names (gate, up, down) and the MoE block's name, by family.
_EXPERT_NAMES = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer (HF layout: linear weights are ``[out, in]``).

    ``experts`` > 0 (MoE families only) replaces every layer's MLP by a router and
    ``experts`` experts of intermediate size ``moe_intermediate``; ``intermediate`` is then
    unused. ``qkv_bias``: q/k/v projections have biases (Qwen2). ``qk_norm``: per-head RMS norms
    ``q_norm`` / ``k_norm`` (Qwen3). ``tie_word_embeddings``: no ``lm_head.weight`` (the
    output projection is the embedding).
    """

    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int = 0
    moe_intermediate: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    family: Family = "llama"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise LayoutError(f"family {self.family!r} is not one of {list(FAMILIES)}")
        dims = ("vocab", "hidden", "layers", "intermediate", "heads", "kv_heads", "head_dim")
        bad = [f"{d}={getattr(self, d)}" for d in dims if getattr(self, d) < 1]
        if bad:
            raise LayoutError(f"model dimensions must be positive: {', '.join(bad)}")
        if (self.experts > 0) != (self.family in _MOE):
            raise LayoutError(
                f"family {self.family!r} with experts={self.experts}: MoE families "
                f"{sorted(_MOE)} need experts > 0, the others experts=0"
            )
        if self.experts and self.moe_intermediate < 1:
            raise LayoutError(f"experts={self.experts} needs moe_intermediate > 0")
        if self.heads % self.kv_heads:
            raise LayoutError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelSpec:
        """Read an HF ``config.json`` (as a dict) of model type ``llama``, ``qwen2``,
        ``qwen3``, ``qwen3_moe`` or ``mixtral``.

        Keys: ``model_type``, ``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
        ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads`` (default: the
        heads), ``head_dim`` (default: hidden / heads), ``num_experts`` (qwen3_moe; transformers
        5 writes ``num_local_experts``) or ``num_local_experts`` (mixtral),
        ``moe_intermediate_size`` (qwen3_moe; mixtral's
        experts use ``intermediate_size``), ``tie_word_embeddings`` (default False). Qwen2 has
        q/k/v biases, Qwen3 q/k norms. Raises :class:`LayoutError` for other model types and for
        variants the presets do not describe (biased llama attention, Qwen3-MoE dense layers).
        """
        family = config.get("model_type")
        if family not in FAMILIES:
            raise LayoutError(f"model_type {family!r} is not one of {list(FAMILIES)}")
        if family == "llama" and (config.get("attention_bias") or config.get("mlp_bias")):
            raise LayoutError("llama with attention_bias or mlp_bias is not supported")
        if family == "qwen3_moe" and (
            config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1
        ):
            raise LayoutError("qwen3_moe with dense layers (mlp_only_layers, decoder_sparse_step)")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        # transformers 5 names Qwen3-MoE's expert count num_local_experts, as Mixtral's
        experts = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts"}.get(family)
        if experts and experts not in config and "num_local_experts" in config:
            experts = "num_local_experts"
        moe_inter = {"qwen3_moe": "moe_intermediate_size", "mixtral": "intermediate_size"}
        return cls(
            vocab=int(config["vocab_size"]),
            hidden=hidden,
            layers=int(config["num_hidden_layers"]),
            intermediate=int(config["intermediate_size"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            experts=int(config[experts]) if experts else 0,
            moe_intermediate=int(config[moe_inter[family]]) if experts else 0,
            qkv_bias=family == "qwen2",
            qk_norm=family in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            family=family,
        )


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The global tensors of the HF checkpoint: name -> shape, in checkpoint order."""
    h, hd = spec.hidden, spec.head_dim
    q, kv = spec.heads * hd, spec.kv_heads * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab, h)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        for proj, rows in (("q", q), ("k", kv), ("v", kv)):
            out[f"{p}self_attn.{proj}_proj.weight"] = (rows, h)
            if spec.qkv_bias:
                out[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        if spec.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "self_attn.o_proj.weight"] = (h, q)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if spec.experts:
            block, gate, up, down = _EXPERT_NAMES[spec.family]
            inter = spec.moe_intermediate
            out[f"{p}{block}.gate.weight"] = (spec.experts, h)
            for e in range(spec.experts):
                x = f"{p}{block}.experts.{e}."
                out |= {x + f"{gate}.weight": (inter, h), x + f"{up}.weight": (inter, h)}
                out[x + f"{down}.weight"] = (h, inter)
        else:
            out[p + "mlp.gate_proj.weight"] = (spec.intermediate, h)
            out[p + "mlp.up_proj.weight"] = (spec.intermediate, h)
            out[p + "mlp.down_proj.weight"] = (h, spec.intermediate)
    out["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (spec.vocab, h)
    return out


def padded_vocab(spec: ModelSpec, pad_vocab_to: int = 64) -> int:
    """The vocabulary rounded up to a multiple of ``pad_vocab_to`` (vLLM pads to 64)."""
    if pad_vocab_to < 1:
        raise LayoutError(f"pad_vocab_to must be positive, got {pad_vocab_to}")
    return -(-spec.vocab // pad_vocab_to) * pad_vocab_to


def _check(spec: ModelSpec, tp_rank: int, tp_size: int, ep_rank: int, ep_size: int) -> None:
    problems = []
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        problems.append(f"tp_rank {tp_rank} is not in [0, tp_size={tp_size})")
    if ep_size < 1 or not 0 <= ep_rank < ep_size:
        problems.append(f"ep_rank {ep_rank} is not in [0, ep_size={ep_size})")
    if problems:
        raise LayoutError("; ".join(problems))
    if spec.heads % tp_size:
        problems.append(f"heads={spec.heads} is not divisible by tp_size={tp_size}")
    if (tp_size % spec.kv_heads) if tp_size > spec.kv_heads else (spec.kv_heads % tp_size):
        problems.append(
            f"kv_heads={spec.kv_heads} and tp_size={tp_size}: one must divide the other"
        )
    if spec.experts:
        if spec.experts % ep_size:
            problems.append(f"experts={spec.experts} is not divisible by ep_size={ep_size}")
        if spec.moe_intermediate % tp_size:
            problems.append(
                f"moe_intermediate={spec.moe_intermediate} is not divisible by tp_size={tp_size}"
            )
    else:
        if ep_size > 1:
            problems.append(f"ep_size={ep_size} for a model without experts")
        if spec.intermediate % tp_size:
            problems.append(
                f"intermediate={spec.intermediate} is not divisible by tp_size={tp_size}"
            )
    if problems:
        raise LayoutError(
            f"{spec.family} model at TP {tp_size} / EP {ep_size}: " + "; ".join(problems)
        )


def vllm_layout(
    spec: ModelSpec,
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
    pad_vocab_to: int = 64,
) -> Layout:
    """The layout of TP rank ``tp_rank`` of ``tp_size`` (and, for MoE, EP rank ``ep_rank`` of
    ``ep_size``) of a vLLM engine: vLLM local names -> boxes of the HF tensors of
    :func:`hf_shapes` (see the module docstring for the sharding rules).

    Local shapes come from ``vllm_layout(...).bind(hf_shapes(spec)).local_shapes``. Raises
    :class:`LayoutError` for configurations vLLM cannot run (heads, kv heads, intermediate or
    experts not divisible, padded vocabulary not divisible by ``tp_size``).
    """
    _check(spec, tp_rank, tp_size, ep_rank, ep_size)
    if padded_vocab(spec, pad_vocab_to) % tp_size:
        raise LayoutError(
            f"vocab {spec.vocab} padded to a multiple of pad_vocab_to={pad_vocab_to} does not "
            f"split over tp_size={tp_size}"
        )
    block = padded_vocab(spec, pad_vocab_to) // tp_size

    def col(name: str) -> Part:  # column-parallel: output rows split
        return shard(name, 0, tp_rank, tp_size)

    def row(name: str) -> Part:  # row-parallel: input columns split
        return shard(name, 1, tp_rank, tp_size)

    if tp_size > spec.kv_heads:  # every rank holds one kv head, repeated over ranks
        kv_rank, kv_world = tp_rank // (tp_size // spec.kv_heads), spec.kv_heads
    else:
        kv_rank, kv_world = tp_rank, tp_size

    def qkv(p: str, suffix: str) -> Part:
        return fuse(
            [
                shard(f"{p}self_attn.q_proj.{suffix}", 0, tp_rank, tp_size),
                shard(f"{p}self_attn.k_proj.{suffix}", 0, kv_rank, kv_world),
                shard(f"{p}self_attn.v_proj.{suffix}", 0, kv_rank, kv_world),
            ]
        )

    vocab = shard("model.embed_tokens.weight", 0, tp_rank, tp_size, block=block)
    parts: dict[str, Part | str] = {"model.embed_tokens.weight": vocab}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        parts[p + "input_layernorm.weight"] = p + "input_layernorm.weight"
        parts[p + "self_attn.qkv_proj.weight"] = qkv(p, "weight")
        if spec.qkv_bias:
            parts[p + "self_attn.qkv_proj.bias"] = qkv(p, "bias")
        if spec.qk_norm:
            parts[p + "self_attn.q_norm.weight"] = p + "self_attn.q_norm.weight"
            parts[p + "self_attn.k_norm.weight"] = p + "self_attn.k_norm.weight"
        parts[p + "self_attn.o_proj.weight"] = row(p + "self_attn.o_proj.weight")
        parts[p + "post_attention_layernorm.weight"] = p + "post_attention_layernorm.weight"
        if spec.experts:
            moe, gate, up, down = _EXPERT_NAMES[spec.family]
            n = spec.experts // ep_size
            mine = [f"{p}{moe}.experts.{e}." for e in range(ep_rank * n, (ep_rank + 1) * n)]
            parts[f"{p}{moe}.gate.weight"] = f"{p}{moe}.gate.weight"
            parts[f"{p}{moe}.experts.w13_weight"] = stack(
                fuse([col(x + gate + ".weight"), col(x + up + ".weight")]) for x in mine
            )
            parts[f"{p}{moe}.experts.w2_weight"] = stack(row(x + down + ".weight") for x in mine)
        else:
            parts[p + "mlp.gate_up_proj.weight"] = fuse(
                [col(p + "mlp.gate_proj.weight"), col(p + "mlp.up_proj.weight")]
            )
            parts[p + "mlp.down_proj.weight"] = row(p + "mlp.down_proj.weight")
    parts["model.norm.weight"] = "model.norm.weight"
    if not spec.tie_word_embeddings:
        parts["lm_head.weight"] = shard("lm_head.weight", 0, tp_rank, tp_size, block=block)
    return Layout(parts)


__all__ = ["FAMILIES", "Family", "ModelSpec", "hf_shapes", "padded_vocab", "vllm_layout"]
