"""Trace vLLM's own weight loading (deltastore.engines.vllm_trace) on vLLM's model classes,
instantiated on the meta device (no engine, no weights) at TP 1 or TP 2, one process per rank.

    trace_probe.py ARCH... --tp N --workdir DIR
    trace_probe.py --bench tiny|qwen3-0.6b --workdir DIR     what a trace costs

For each architecture (a tiny model of ``tools.tiny_config``, saved to ``DIR/ARCH``) and rank
it prints, on the line that starts with ``tools.RESULT``: the checkpoint tensors (names and
shapes in the saved safetensors: what a trainer publishes), the
traced layout (per parameter its shape and boxes), the derived parameters, whether every
parameter is traced or derived, the trace's time, and for the preset families whether the
traced placements equal the preset's (``equal_preset``, with the first differences).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tools


def checkpoint_shapes(folder: Path) -> dict[str, list[int]]:
    """The tensors of the checkpoint in ``folder`` (names, shapes from the safetensors
    headers): what a trainer that saves with transformers publishes (tied weights once)."""
    from safetensors import safe_open

    out: dict[str, list[int]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for n in st.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
                out[n] = list(st.get_slice(n).get_shape())
    return out


def _placements(layout: Any, shapes: dict[str, list[int]]) -> dict[str, list[list[Any]]]:
    from deltastore.engines.vllm_trace import merge_boxes

    bound = layout.bind(shapes)
    per: dict[str, list[Any]] = {}
    for ps in bound.placements.values():
        for p in ps:
            per.setdefault(p.local, []).append(p.box)
    return {
        n: [[b.source, list(b.offset), list(b.lengths), list(b.dst_offset)]
            for b in merge_boxes(boxes, bound.local_shapes[n])]
        for n, boxes in per.items()
    }  # fmt: skip


def _one(cfg: Any, model: Any, rank: int, world: int) -> dict[str, Any]:
    from deltastore.engines.vllm_layout import derive_layout
    from deltastore.engines.vllm_trace import checkpoint_meta, trace_layout
    from deltastore.layout.presets import FAMILIES

    hf = cfg.model_config.hf_config
    shapes = checkpoint_shapes(Path(cfg.model_config.model))
    params = {n: list(m.shape) for n, m in checkpoint_meta(model).items()}
    t0 = time.perf_counter()
    got = trace_layout(model, shapes)
    seconds = time.perf_counter() - t0
    traced = _placements(got.layout.layout, shapes)
    out: dict[str, Any] = {
        "class": type(model).__name__,
        "params": params,
        "traced": traced,
        "derived": list(got.derived),
        "padding": {n: [list(map(list, r)) for r in rs] for n, rs in got.padding.items()},
        "covers_every_parameter": set(traced) | set(got.derived) == set(params),
        "seconds": seconds,
    }
    if hf.model_type in FAMILIES:
        preset = derive_layout(params, hf.to_dict(), tp_rank=rank, tp_size=world)
        want = _placements(preset.layout, shapes)
        diff = [n for n in sorted(set(want) | set(traced)) if want.get(n) != traced.get(n)]
        out["equal_preset"] = not diff
        out["preset_diff"] = [{"param": n, "preset": want.get(n), "traced": traced.get(n)}
                              for n in diff[:3]]  # fmt: skip
    return out


def _rank(rank: int, world: int, port: int, archs: list[str], workdir: str, q: Any) -> None:
    out: dict[str, Any] = {}
    for i, arch in enumerate(sorted(archs, key=lambda a: a.split("+")[0] not in tools.MOE)):
        try:
            with tools.meta_model(arch, workdir, rank, world, port, first=i == 0) as (cfg, model):
                out[arch] = _one(cfg, model, rank, world)
        except Exception as exc:  # reported to the test, which fails with it
            out[arch] = {"error": f"{type(exc).__name__}: {exc}"}
    q.put((rank, out))


def run(archs: list[str], tp: int, workdir: Path) -> dict[str, Any]:
    for arch in archs:  # a tiny model of each, saved by the installed transformers
        if not (workdir / arch / "config.json").exists():
            tools.build_model(arch, workdir / arch)
    return tools.run_ranks(_rank, tp, archs, workdir)


#: Qwen3-0.6B's shapes (its config.json), for the cost of a trace on a model that is not tiny.
QWEN3_06B = dict(
    vocab_size=151936, hidden_size=1024, num_hidden_layers=28, intermediate_size=3072,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    max_position_embeddings=40960, architectures=["Qwen3ForCausalLM"],
)  # fmt: skip


def bench(workdir: Path, name: str) -> dict[str, Any]:
    """The cost of tracing (wall time, peak RSS growth) at TP 1, in this process: ``tiny``
    (``tools.tiny_config("qwen3")``) or ``qwen3-0.6b`` (:data:`QWEN3_06B`, no weights: the
    model on the meta device, the checkpoint shapes from the preset): traced, traced and
    written to the cache, read from the cache."""
    import resource

    import torch
    import transformers as tf
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    from deltastore.engines.vllm_trace_cache import cached_trace
    from deltastore.layout.presets import ModelSpec, hf_shapes

    config = tools.tiny_config("qwen3") if name == "tiny" else tf.Qwen3Config(**QWEN3_06B)
    config.save_pretrained(workdir / name)
    cfg = EngineArgs(
        model=str(workdir / name), skip_tokenizer_init=True, dtype="bfloat16",
        enforce_eager=True, max_model_len=256,
    ).create_engine_config()  # fmt: skip
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{tools.free_port()}",
        )  # fmt: skip
        initialize_model_parallel(tensor_model_parallel_size=1)
        with torch.device("meta"):
            model = initialize_model(vllm_config=cfg)
    shapes = hf_shapes(ModelSpec.from_hf_config(cfg.model_config.hf_config.to_dict()))
    # the RSS now (kB); the peak after the runs, less it, is what tracing added at most
    status = Path("/proc/self/status").read_text().split("VmRSS:")[1]
    rss0 = int(status.split()[0])
    out: dict[str, Any] = {"elements": sum(int(torch.tensor(s).prod()) for s in shapes.values())}
    # a trace (no cache), a trace written to the cache, a read from the cache
    for run_, use in (("trace s", False), ("trace and write s", True), ("cached s", True)):
        t0 = time.perf_counter()
        got = cached_trace(model, shapes, {"bench": name}, cache=use, directory=workdir / "c")
        out[run_] = round(time.perf_counter() - t0, 3)
        out["cached"] = got.cached
    out["peak rss growth MiB"] = round(
        (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024, 1
    )
    out["parameters"] = len(got.layout.layout.parts)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("archs", nargs="*")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--workdir", required=True)
    p.add_argument("--bench", choices=["tiny", "qwen3-0.6b"])
    a = p.parse_args()
    if a.bench:
        os.environ["VLLM_DIST_IDENT"] = str(os.getpid())
        res: Any = bench(Path(a.workdir), a.bench)
    else:
        res = run(a.archs, a.tp, Path(a.workdir))
    sys.stdout.write("\n" + tools.RESULT + json.dumps(res) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
