"""Instantiate vLLM's own model classes (no engine, no weights: on the meta device) at TP 1
or TP 2 and derive deltastore's layout for each rank from them.

Per rank and architecture the result holds the model's ``params`` (``named_parameters()``
names and shapes, as vLLM made them), the HF config vLLM gives its workers (``hf_config``,
what the worker extension passes to ``derive_layout``), the model ``class``, and the layout
deltastore derives (``derived``). ``capture_layouts.py`` writes ``params`` and ``hf_config``
to the fixture the main suite's ``tests/test_engines_vllm.py`` reads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import tools


def _rank(rank: int, world: int, port: int, archs: list[str], workdir: str, q: Any) -> None:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    from deltastore.engines.vllm import derive_layout

    out: dict[str, Any] = {}
    # vLLM creates its expert-parallel group only when the model parallel state is set up for
    # a MoE model: initialize under one
    archs = sorted(archs, key=lambda a: a.split("+")[0] not in ("qwen3_moe", "mixtral"))
    os.environ["VLLM_DIST_IDENT"] = str(port)  # as vLLM's CPU worker sets it
    try:
        for i, arch in enumerate(archs):
            folder = Path(workdir) / arch
            cfg = EngineArgs(
                model=str(folder), skip_tokenizer_init=True, dtype="bfloat16",
                enforce_eager=True, max_model_len=256, tensor_parallel_size=world,
            ).create_engine_config()  # fmt: skip
            with set_current_vllm_config(cfg):
                if i == 0:
                    init_distributed_environment(
                        world_size=world, rank=rank, local_rank=rank, backend="gloo",
                        distributed_init_method=f"tcp://127.0.0.1:{port}",
                    )  # fmt: skip
                    initialize_model_parallel(tensor_model_parallel_size=world)
                with torch.device("meta"):
                    model = initialize_model(vllm_config=cfg)
            params = {n: list(p.shape) for n, p in model.named_parameters()}
            hf = cfg.model_config.hf_config.to_dict()
            derived = derive_layout(params, hf, tp_rank=rank, tp_size=world)
            out[arch] = {
                "params": params,
                "derived": {n: list(s) for n, s in derived.shapes.items()},
                "class": type(model).__name__,
                "hf_config": json.loads(json.dumps(hf, default=str)),
            }
    except Exception as exc:  # reported to the test, which fails with it
        out["error"] = f"{type(exc).__name__}: {exc}"
    q.put((rank, out))


def run(archs: list[str], tp: int, workdir: Path) -> dict[str, Any]:
    for arch in archs:  # a tiny config of each, written by the installed transformers
        tools.tiny_config(arch).save_pretrained(workdir / arch)
    return tools.run_ranks(_rank, tp, archs, workdir)
