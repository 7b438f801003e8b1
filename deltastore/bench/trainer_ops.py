"""What the trainer-in-the-loop bench (:mod:`deltastore.bench.trainer`) measures beside the
publish itself, in the trainer's process between two steps: the version's digest, the read
floor, the inverse alone, and each pass a snapshot-free publish makes over the model, timed on
its own (where the publish time goes). Not thread-safe: call from the training thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from deltastore.bench.ops import digest


def _words(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.bfloat16).reshape(-1).view(torch.int16).numpy()


def version_digest(params: dict[str, torch.nn.Parameter]) -> str:
    """XXH3-64 of the bf16 words of every parameter, in table order."""
    return digest(_words(p) for p in params.values())


def read_floor(opt: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter]) -> float:
    """Seconds of one read of every fp32 weight and both moments (a sum over each)."""
    t0 = time.perf_counter()
    for p in params.values():
        state = opt.state[p]
        for t in (p, state["exp_avg"], state["exp_avg_sq"]):
            t.detach().sum()
    return time.perf_counter() - t0


def load_code(publisher: str) -> None:
    """Import the publisher's code and load the compiled kernel (numba's cache) before the
    RSS baseline: code is not a per-model cost; :attr:`PublisherRun.code_rss_bytes` reports
    it on its own."""
    import deltastore.publish.publisher  # noqa: F401

    if publisher == "none":
        from deltastore.publish.invert_kernel import cast_adler, invert_and_diff, invert_chunk
        from deltastore.publish.reconstruct import StepScalars, step_coefficients

        coef = step_coefficients(StepScalars(1e-3, 0.9, 0.999, 1e-8, 0.0, 1))
        one = np.ones(1, dtype=np.float32)
        invert_chunk(one, one, one, coef)  # type: ignore[arg-type]
        invert_and_diff(one, one, one, coef)  # type: ignore[arg-type]
        cast_adler(one, np.empty(1, dtype="<u2"))


def publish_passes(
    opt: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter], chunk: int = 1 << 20
) -> dict[str, float]:
    """Seconds of each pass a snapshot-free publish makes over the model, each timed on its
    own on this thread alone (one core), chunk by chunk: where the publish time goes. Run
    after the publish, before the next step (the moments are the step's)."""
    from deltastore.format.checksum import adler32
    from deltastore.publish.digests import digest_blocks
    from deltastore.publish.invert_kernel import cast_adler, invert_and_diff, invert_chunk
    from deltastore.publish.reconstruct import bf16_words

    inverter = getattr(opt, "_deltastore_bench_inverter", None)
    plans = [(p, inverter.plan(p) if inverter is not None else None) for p in params.values()]
    flats = [(p.detach().reshape(-1), plan) for p, plan in plans]

    buf = np.empty(chunk, dtype="<u2")  # cast_adler's words, reused

    def each(fn: Callable[[torch.Tensor, int, int, Any], object]) -> float:
        t0 = time.perf_counter()
        for flat, plan in flats:
            for a in range(0, flat.numel(), chunk):
                fn(flat, a, min(a + chunk, flat.numel()), plan)
        return time.perf_counter() - t0

    def on_words(fn: Callable[[np.ndarray], object]) -> float:
        """``fn`` on each chunk's bf16 words, made untimed first (one chunk at a time)."""
        spent = 0.0
        for flat, _ in flats:
            for a in range(0, flat.numel(), chunk):
                words = bf16_words(flat[a : a + chunk].numpy())
                t0 = time.perf_counter()
                fn(words)
                spent += time.perf_counter() - t0
        return spent

    def inverse(flat: torch.Tensor, a: int, b: int, plan: Any, fused: bool = False) -> None:
        p, m, v = (t[a:b].numpy() for t in plan._flat)  # the parameter and its moments, flat
        if fused:
            invert_and_diff(p, m, v, plan.coefficients, threads=1)
        else:
            invert_chunk(p, m, v, plan.coefficients, threads=1)

    out = {
        "read p, m, v (torch sum)": read_floor(opt, params),
        "bf16 words (numpy bf16_words)": each(lambda f, a, b, _: bf16_words(f[a:b].numpy())),
        "bf16 cast (torch)": each(lambda f, a, b, _: f[a:b].to(torch.bfloat16)),
        "new words + Adler-32 (cast_adler, the publish's)": each(
            lambda f, a, b, _: cast_adler(f[a:b].numpy(), buf)
        ),
        "block digests (XXH3-64)": on_words(digest_blocks),
        "Adler-32": on_words(adler32),
    }
    if all(hasattr(plan, "coefficients") for _, plan in flats):
        out["inverse (invert_chunk)"] = each(inverse)
        out["inverse + new words + positions (invert_and_diff)"] = each(
            lambda f, a, b, plan: inverse(f, a, b, plan, fused=True)
        )
    return out


def kernel_time(inverter: Any, params: dict[str, torch.nn.Parameter]) -> float | None:
    """Seconds of the inverse alone over every parameter (None if a parameter is gated)."""
    t0 = time.perf_counter()
    for p in params.values():
        plan = inverter.plan(p)
        if not hasattr(plan, "chunks"):
            return None
        for _ in plan.chunks():
            pass
    return time.perf_counter() - t0
