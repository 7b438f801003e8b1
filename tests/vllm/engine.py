"""One vLLM engine in a process of its own (the tests start it with the environment of
``tools.engine_env``); prints its JSON result on the stdout line that starts with ``tools.RESULT``.

    engine.py reference FOLDER...            fresh engines, one per checkpoint folder
    engine.py follow START STORE V,V,...     an engine loaded from START follows STORE
    engine.py layouts ARCH...                derived layouts vs the real model's parameters
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tools


def engine_kwargs(folder: str, tp: int) -> dict[str, Any]:
    return dict(
        model=folder, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
        max_model_len=256, tensor_parallel_size=tp, seed=0,
        worker_extension_cls="deltastore.engines.vllm.DeltastoreWorkerExtension",
    )  # fmt: skip


def params() -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=tools.MAX_TOKENS, temperature=0.0, logprobs=0)


def outputs_of(results: list[Any]) -> list[dict[str, Any]]:
    out = []
    for r in results:
        c = r.outputs[0]
        first = c.logprobs[0][c.token_ids[0]].logprob
        out.append({"ids": list(c.token_ids), "lp": first})
    return out


def generate(llm: Any) -> list[dict[str, Any]]:
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in tools.PROMPTS]
    return outputs_of(llm.generate(prompts, params(), use_tqdm=False))


def reference(folders: list[str], tp: int) -> dict[str, Any]:
    import gc

    from vllm import LLM

    out = {}
    for folder in folders:
        llm = LLM(**engine_kwargs(folder, tp))
        out[folder] = generate(llm)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return out


def follow_llm(a: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM

    from deltastore.engines import vllm as dv

    llm = LLM(**engine_kwargs(a.start, a.tp))
    t0 = time.perf_counter()
    attached = dv.attach(llm, a.store, version=a.at, reader_id="engine-under-test")
    out: dict[str, Any] = {"attached": attached, "attach_s": time.perf_counter() - t0}
    out["start"] = generate(llm)
    out["steps"] = []
    for v in a.versions:
        if v == a.corrupt:
            tools.corrupt_frame(Path(a.store), v)
        results = dv.sync(llm, v)
        out["steps"].append({"target": v, "results": results, "outputs": generate(llm)})
    if a.follow_to is not None:  # the polling loop, to the newest version
        seen: list[list[dict[str, Any]]] = []
        done = dv.follow(llm, a.store, version=out["steps"][-1]["results"][0]["version"],
                         interval=0.05, until=a.follow_to, on_sync=seen.append)  # fmt: skip
        out["follow"] = {"version": done.version, "synced": done.synced, "outputs": generate(llm)}
    return out


async def follow_async(a: argparse.Namespace) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    from deltastore.engines import vllm as dv

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(a.start, a.tp)))
    counter = iter(range(1 << 30))
    # The timeline of each sync (time.monotonic seconds): the engine's pause and resume, each
    # collective_rpc of the sync, when each output of the request served meanwhile came, and
    # those of a probe request submitted right after generation was paused.
    events: list[tuple[str, float, float]] = []
    probe_stamps: list[float] = []
    probes: list[Any] = []

    def timed(name: str, fn: Any) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                return await fn(*args, **kwargs)
            finally:
                label = args[0] if name == "rpc" and args else name
                events.append((str(label), t0, time.monotonic()))

        return call

    pause = engine.pause_generation

    async def pause_and_probe(*args: Any, **kwargs: Any) -> Any:
        done = await pause(*args, **kwargs)
        probes.append(asyncio.ensure_future(one(tools.PROMPTS[2], probe_stamps)))
        return done

    engine.pause_generation = timed("pause_generation", pause_and_probe)
    engine.resume_generation = timed("resume_generation", engine.resume_generation)
    engine.collective_rpc = timed("rpc", engine.collective_rpc)

    async def one(prompt: list[int], stamps: list[float] | None = None) -> Any:
        last = None
        async for r in engine.generate(TokensPrompt(prompt_token_ids=prompt), params(),
                                       request_id=f"r{next(counter)}"):  # fmt: skip
            last = r
            if stamps is not None:
                stamps.append(time.monotonic())
        return last

    async def batch() -> list[dict[str, Any]]:
        return outputs_of(list(await asyncio.gather(*(one(p) for p in tools.PROMPTS))))

    attached = await dv.attach_async(engine, a.store, version=a.at, reader_id="engine-under-test")
    out: dict[str, Any] = {"attached": attached, "start": await batch(), "steps": []}
    for v in a.versions:
        stamps: list[float] = []
        events.clear()
        probe_stamps.clear()
        probes.clear()
        t0 = time.monotonic()
        # served while the sync runs
        background = asyncio.ensure_future(one(tools.PROMPTS[1], stamps))
        results = await dv.sync_async(engine, v)
        t1 = time.monotonic()
        served = await background
        await asyncio.gather(*probes)
        timeline = {"sync": [t0, t1], "events": list(events), "outputs": stamps,
                    "probe": list(probe_stamps)}  # fmt: skip
        out["steps"].append({"target": v, "results": results, "outputs": await batch(),
                             "served_meanwhile": len(served.outputs[0].token_ids),
                             "timeline": timeline})  # fmt: skip
    engine.shutdown()
    return out


def layouts(archs: list[str], tp: int, workdir: str) -> dict[str, Any]:
    import layouts_probe

    return layouts_probe.run(archs, tp, Path(workdir))


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("reference")
    r.add_argument("folders", nargs="+")
    r.add_argument("--tp", type=int, default=1)
    f = sub.add_parser("follow")
    f.add_argument("start")
    f.add_argument("store")
    f.add_argument("versions", type=lambda s: [int(x) for x in s.split(",")])
    f.add_argument("--at", type=int, default=0)
    f.add_argument("--tp", type=int, default=1)
    f.add_argument("--api", choices=["llm", "async"], default="llm")
    f.add_argument("--corrupt", type=int, default=None)
    f.add_argument("--follow-to", type=int, default=None)
    lay = sub.add_parser("layouts")
    lay.add_argument("archs", nargs="+")
    lay.add_argument("--tp", type=int, default=1)
    lay.add_argument("--workdir", required=True)
    a = p.parse_args()
    if a.cmd == "reference":
        res: Any = reference(a.folders, a.tp)
    elif a.cmd == "follow":
        res = asyncio.run(follow_async(a)) if a.api == "async" else follow_llm(a)
    else:
        res = layouts(a.archs, a.tp, a.workdir)
    sys.stdout.write("\n" + tools.RESULT + json.dumps(res) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
