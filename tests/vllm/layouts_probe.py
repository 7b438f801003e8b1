"""Instantiate vLLM's own model classes (no engine, no weights: on the meta device) at TP 1
or TP 2 and derive deltastore's layout for each rank from them.

Per rank and architecture the result holds the model's ``params`` (``named_parameters()``
names and shapes, as vLLM made them), the HF config vLLM gives its workers (``hf_config``,
what the worker extension passes to ``derive_layout``), the model ``class``, and the layout
deltastore derives (``derived``). ``capture_layouts.py`` writes ``params`` and ``hf_config``
to the fixture the main suite's ``tests/test_engines_vllm.py`` reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tools


def _rank(rank: int, world: int, port: int, archs: list[str], workdir: str, q: Any) -> None:
    from deltastore.engines.vllm import derive_layout

    out: dict[str, Any] = {}
    try:
        for i, arch in enumerate(sorted(archs, key=lambda a: a.split("+")[0] not in tools.MOE)):
            with tools.meta_model(arch, workdir, rank, world, port, first=i == 0) as (cfg, model):
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
