"""Serving while syncing: tokens/s of an ``AsyncLLM`` (CPU engine) serving 4 greedy streams,
idle and during a background ``deltastore_prepare`` of a version with a real change, for each
priority of the sync's threads; and the sync's own latency.

Run under ``.venv-vllm`` from the repository root (one command; 18 minutes measured under a
load average of 20-30 on 2 cores, an estimated 6 on a quiet 2-core machine)::

    .venv-vllm/bin/python benchmarks/vllm_serving.py

It builds a random-init Qwen3 of ~22M parameters (hidden 512, 4 layers, vocab 8192, bf16),
publishes versions 0..N with one AdamW step each (lr 1e-4: 35-70% of the elements change per
version), starts one engine (a process of its own, the environment of ``tests/vllm/tools.py``)
and runs ``--reps`` rounds over the priority settings (round-robin, so that a load that
drifts hits each alike). Each round of a setting: re-attach with ``priority=<setting>``, an
idle window (``--idle-s`` seconds), ``deltastore_prepare`` of the next version polled every
20 ms until ready (the tokens of the 4 streams counted meanwhile), the commit (generation
paused with ``mode="keep"``), 1 s to settle, a second idle window. ``ratio`` is tokens/s
during the prepare over the mean of the two idle windows; ``prepare_s`` is the sync's latency
from the prepare call to every worker ready. Writes ``benchmarks/results/vllm-serving.json``
(``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

import tools  # noqa: E402

RESULT = "VLLM-SERVING-RESULT "
STREAMS = 4
MAX_TOKENS = 400


def small_config() -> Any:
    import transformers as tf

    return tf.Qwen3Config(
        vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, intermediate_size=1536, max_position_embeddings=1024,
        tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"],
    )  # fmt: skip


def build_chain(work: Path, versions: int, lr: float) -> tuple[Path, Path]:
    """The model folder (version 0) and a local store holding versions 0..``versions``."""
    import torch
    import transformers as tf

    from deltastore import Publisher

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(small_config())
    folder = work / "model"
    model.to(torch.bfloat16).save_pretrained(folder)
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    store = work / "store"
    pub = Publisher(str(store))

    def state() -> dict[str, torch.Tensor]:
        return {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.named_parameters()}

    pub.publish(state(), version=0)
    torch.manual_seed(1)
    for v in range(1, versions + 1):
        batch = torch.randint(0, 8000, (4, 32))
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()
        pub.publish(state(), version=v)
    return folder, store


# --- the engine process ---------------------------------------------------------------------


async def serve_and_sync(a: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from deltastore.engines import vllm as dv

    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=a.model,
            skip_tokenizer_init=True,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=512,
            seed=0,
            enable_prefix_caching=False,
            worker_extension_cls="deltastore.engines.vllm.DeltastoreWorkerExtension",
        )
    )
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    stamps: list[tuple[float, int]] = []  # (time.monotonic(), tokens that arrived)
    stop = asyncio.Event()
    counter = iter(range(1 << 30))

    async def stream(i: int) -> None:
        prompt = [(i * 97 + j * 31) % 8000 + 1 for j in range(16)]
        while not stop.is_set():
            async for r in engine.generate(
                TokensPrompt(prompt_token_ids=prompt), params, request_id=f"s{i}-{next(counter)}"
            ):
                stamps.append((time.monotonic(), len(r.outputs[0].token_ids)))
                if stop.is_set():
                    break

    def rate(t0: float, t1: float) -> float:
        return sum(n for t, n in stamps if t0 <= t < t1) / (t1 - t0)

    version = 0
    await dv.attach_async(engine, a.store, version=0, lease_ttl=0)
    tasks = [asyncio.ensure_future(stream(i)) for i in range(STREAMS)]
    await asyncio.sleep(a.warmup_s)
    rounds: dict[str, list[dict[str, Any]]] = {str(x): [] for x in a.priorities}
    attach_s: dict[str, list[float]] = {str(x): [] for x in a.priorities}
    for _ in range(a.reps):  # settings round-robin: a load that drifts hits each alike
        for setting in a.priorities:
            prio: int | str = "idle" if setting == "idle" else int(setting)
            options: dict[str, Any] = {"priority": prio, "lease_ttl": 0}
            if a.max_workers:
                options["max_workers"] = a.max_workers
            t_att = time.monotonic()
            await dv.attach_async(engine, a.store, version=version, **options)
            attach_s[setting].append(time.monotonic() - t_att)
            await asyncio.sleep(1.0)
            i0 = time.monotonic()
            await asyncio.sleep(a.idle_s)
            i1 = p0 = time.monotonic()
            await engine.collective_rpc("deltastore_prepare", args=(version + 1,))
            while True:
                states = await engine.collective_rpc("deltastore_status")
                if all(s["state"] in ("ready", "done") for s in states):
                    break
                await asyncio.sleep(0.02)
            p1 = time.monotonic()
            await engine.pause_generation(mode="keep", clear_cache=False)
            try:
                out = await engine.collective_rpc("deltastore_commit", args=(600.0,))
            finally:
                await engine.resume_generation()
            c1 = time.monotonic()
            dv.raise_for_error(out)
            await asyncio.sleep(1.0)  # the streams settle after the pause
            j0 = time.monotonic()
            await asyncio.sleep(a.idle_s)
            j1 = time.monotonic()
            version = out[0]["version"]
            report = out[0]["report"]
            changed = report["changed_elements"] / report["total_elements"]
            idle = (rate(i0, i1) + rate(j0, j1)) / 2  # the idle windows before and after
            during = rate(p0, p1)
            rounds[setting].append({
                "version": version, "idle_before_tok_s": rate(i0, i1),
                "idle_after_tok_s": rate(j0, j1), "during_tok_s": during,
                "ratio": during / idle if idle else None, "prepare_s": p1 - p0,
                "commit_s": c1 - p1, "changed": changed,
                "fetch_s": report["fetch_s"], "decode_s": report["decode_s"],
                "verify_s": report["verify_s"], "pause_s": report["pause_s"],
                "rebuild_s": out[0]["rebuild_s"], "loadavg": os.getloadavg()[0],
            })  # fmt: skip
    settings: list[dict[str, Any]] = []
    for setting, rs in rounds.items():
        ratios = [r["ratio"] for r in rs if r["ratio"] is not None]
        settings.append({
            "priority": "idle" if setting == "idle" else int(setting),
            "attach_s": attach_s[setting], "rounds": rs,
            "median_ratio": statistics.median(ratios) if ratios else None,
            "min_ratio": min(ratios) if ratios else None,
            "median_prepare_s": statistics.median(r["prepare_s"] for r in rs),
            "max_prepare_s": max(r["prepare_s"] for r in rs),
            "median_commit_s": statistics.median(r["commit_s"] for r in rs),
            "median_idle_tok_s": statistics.median(
                (r["idle_before_tok_s"] + r["idle_after_tok_s"]) / 2 for r in rs
            ),
            "median_during_tok_s": statistics.median(r["during_tok_s"] for r in rs),
        })  # fmt: skip
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    engine.shutdown()
    return {"settings": settings}


# --- the driver ------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--priorities", default="0,10,19,idle", help="comma-separated settings")
    p.add_argument("--reps", type=int, default=4, help="prepare rounds per setting")
    p.add_argument("--idle-s", type=float, default=3.0, help="idle windows around each prepare")
    p.add_argument("--warmup-s", type=float, default=5.0)
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW lr of the published steps")
    p.add_argument("--max-workers", type=int, default=0, help="attach option (0: default)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm-serving.json"))
    p.add_argument("--note", default="", help="recorded with the result (e.g. 'quiet machine')")
    p.add_argument("--engine", nargs=2, metavar=("MODEL", "STORE"), help=argparse.SUPPRESS)
    a = p.parse_args()
    a.priorities = [s.strip() for s in a.priorities.split(",") if s.strip()]
    if a.engine:
        a.model, a.store = a.engine
        res = asyncio.run(serve_and_sync(a))
        sys.stdout.write("\n" + RESULT + json.dumps(res) + "\n")
        return
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vllm-serving-") as tmp:
        versions = len(a.priorities) * a.reps
        model, store = build_chain(Path(tmp), versions, a.lr)
        build_s = time.monotonic() - t0
        args = [sys.executable, __file__, "--engine", str(model), str(store)]
        args += ["--priorities", ",".join(a.priorities), "--reps", str(a.reps)]
        args += ["--idle-s", str(a.idle_s), "--warmup-s", str(a.warmup_s)]
        args += ["--max-workers", str(a.max_workers)]
        proc = subprocess.run(
            args, env=tools.engine_env(1, True), capture_output=True, text=True, timeout=3600
        )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        sys.exit(
            f"engine failed ({proc.returncode}):\n{proc.stderr[-6000:]}\n{proc.stdout[-2000:]}"
        )
    res = json.loads(lines[-1][len(RESULT) :])
    argv = sys.argv[1:]
    res |= {
        "command": shlex.join([".venv-vllm/bin/python", "benchmarks/vllm_serving.py", *argv]),
        "note": a.note,
        "model": "Qwen3 random init, hidden 512, 4 layers, vocab 8192, bf16 (~22M params)",
        "streams": STREAMS, "max_tokens": MAX_TOKENS, "lr": a.lr, "reps": a.reps,
        "idle_s": a.idle_s, "cpus": os.cpu_count(), "loadavg_end": os.getloadavg(),
        "machine": platform.platform(), "build_s": build_s, "total_s": time.monotonic() - t0,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    for s in res["settings"]:
        print(
            f"priority {s['priority']!s:>5}: during/idle {s['median_ratio']:.2f} "
            f"({s['median_during_tok_s']:.0f} / {s['median_idle_tok_s']:.0f} tok/s), "
            f"prepare {s['median_prepare_s']:.2f} s"
        )
    print(f"written {a.out} in {res['total_s']:.0f} s")


if __name__ == "__main__":
    main()
