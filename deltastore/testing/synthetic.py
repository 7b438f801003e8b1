"""A synthetic Qwen-like bf16 model whose versions come from real AdamW steps: the one
generator the tests, the demo and the benchmark use.

fp32 master weights (normal(0, 0.02); norms at 1.0), ``torch.optim.AdamW`` (weight decay
0.01, fused kernel) on seeded normal(0, 1) gradients, cast to bf16. The optimizer starts in its
stationary state for such gradients, as after a long run (``exp_avg`` ~ normal(0,
sqrt((1 - beta1) / (1 + beta1))), ``exp_avg_sq`` = E[g^2] = 1, step 1000 so the bias
corrections are ~1): from zeros, Adam's first steps move every weight by ~``lr`` (4% of bf16
elements change at lr 1e-6) and the change rate takes tens of steps to settle near the ~1% of
a long training run; from the stationary state it is there from the first step.

Every random number comes from a stream seeded by ``(seed, tensor position, step)``, drawn in
chunks of :data:`RNG_CHUNK` elements (each chunk its own stream): a tensor's values do not
depend on the other tensors, on threads, or on whether the tensors are generated together
(:class:`AdamWTrajectory`: every tensor in memory, for the tests and the demo) or one at a
time in reused buffers (:class:`AdamWTensor`, as the benchmark generates its 2 GB model).

Model shapes are :mod:`deltastore.testing.sizes` (re-exported here: :data:`SIZES`,
:class:`ModelConfig`...). Not thread-safe: one thread drives a generator (the random chunks may
run on a thread pool it is given).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Final

import numpy as np
import torch

from deltastore.testing.sizes import LARGE as LARGE
from deltastore.testing.sizes import MEDIUM as MEDIUM
from deltastore.testing.sizes import SIZES as SIZES
from deltastore.testing.sizes import SMALL as SMALL
from deltastore.testing.sizes import TINY as TINY
from deltastore.testing.sizes import ModelConfig as ModelConfig

#: Elements per random-number chunk (each chunk has its own seeded stream).
RNG_CHUNK: Final = 1 << 22
#: AdamW hyper-parameters besides the learning rate (torch's default betas and eps).
WEIGHT_DECAY: Final = 0.01
BETA1: Final = 0.9
#: Optimizer step count of the stationary start (bias corrections ~1).
START_STEP: Final = 1000.0


def fill_normal(
    out: np.ndarray, seed: Sequence[int], pool: Executor | None = None, scale: float = 1.0
) -> None:
    """``out`` (1-D float32) <- normal(0, ``scale``), one seeded torch stream per chunk of
    :data:`RNG_CHUNK` elements (stream ``k`` from ``SeedSequence(seed)``). torch's vectorized
    ``normal_`` releases the GIL: with ``pool`` the chunks run in parallel on it (same values)."""
    bounds = [(a, min(a + RNG_CHUNK, out.size)) for a in range(0, out.size, RNG_CHUNK)]
    seeds = np.random.SeedSequence(list(seed)).generate_state(len(bounds), dtype=np.uint64)
    target = torch.from_numpy(out)

    def work(k: int) -> None:
        a, b = bounds[k]
        gen = torch.Generator().manual_seed(int(seeds[k]) >> 1)
        chunk = target[a:b].normal_(generator=gen)
        if scale != 1.0:
            chunk.mul_(scale)

    if pool is None:
        for k in range(len(bounds)):
            work(k)
    else:
        list(pool.map(work, range(len(bounds))))


class AdamWTensor:
    """One tensor's fp32 master weights and AdamW state, stepped on seeded random gradients.

    ``position`` is the tensor's index in the model's table (it seeds its streams with
    ``seed``). ``buffers``: four 1-D float32 arrays of at least ``prod(shape)`` elements
    (master, gradient, ``exp_avg``, ``exp_avg_sq``: 16 bytes per element), reused by the
    caller from tensor to tensor; fresh ones by default. Call order: construct, then
    :meth:`step` and read the weights (:meth:`bf16`, :meth:`bf16_into`) as often as needed.
    """

    def __init__(
        self,
        name: str,
        shape: Sequence[int],
        *,
        position: int,
        lr: float = 1e-6,
        seed: int = 0,
        buffers: Sequence[np.ndarray] | None = None,
        pool: Executor | None = None,
    ) -> None:
        n = int(np.prod(shape, dtype=np.int64))
        if buffers is None:
            buffers = [np.empty(n, dtype=np.float32) for _ in range(4)]
        master, grad, exp_avg, exp_avg_sq = (b[:n] for b in buffers)
        self._seed, self._position, self._pool, self._grad = seed, position, pool, grad
        if name.endswith("norm.weight"):
            master.fill(1.0)
        else:
            fill_normal(master, [seed, position, 0], pool, scale=0.02)
        shape = tuple(shape)
        self.param = torch.nn.Parameter(torch.from_numpy(master).view(shape))
        self.param.grad = torch.from_numpy(grad).view(shape)
        self._opt = torch.optim.AdamW([self.param], lr=lr, weight_decay=WEIGHT_DECAY, fused=True)
        # The stationary state for i.i.d. normal(0, 1) gradients (module docstring), in the
        # given buffers: as if the trainer had run for a long time.
        fill_normal(
            exp_avg, [seed, position, 1 << 30], pool, scale=((1 - BETA1) / (1 + BETA1)) ** 0.5
        )
        exp_avg_sq.fill(1.0)
        self._opt.state[self.param] = {
            "step": torch.tensor(START_STEP, dtype=torch.float32),
            "exp_avg": torch.from_numpy(exp_avg).view(shape),
            "exp_avg_sq": torch.from_numpy(exp_avg_sq).view(shape),
        }
        #: AdamW steps taken since construction.
        self.steps = 0

    def step(self) -> None:
        """One AdamW step on a fresh normal(0, 1) gradient (stream ``(seed, position, steps)``)."""
        self.steps += 1
        fill_normal(self._grad, [self._seed, self._position, self.steps], self._pool)
        self._opt.step()

    def bf16(self) -> torch.Tensor:
        """The current weights cast to bf16 (a new tensor of the tensor's shape)."""
        return self.param.detach().to(torch.bfloat16)

    def bf16_into(self, words: np.ndarray) -> None:
        """Write the current weights cast to bf16 into ``words`` (1-D int16, one word per
        element, little-endian bf16 bits)."""
        torch.from_numpy(words).view(torch.bfloat16).copy_(self.param.detach().reshape(-1))


class AdamWTrajectory:
    """Every tensor of a :class:`ModelConfig` as an :class:`AdamWTensor` (all in memory, 16
    bytes per element); :meth:`step` advances one version and returns the bf16 tensors.

    ``warmup`` steps are taken before the first version (:meth:`bf16` right after
    construction). With the same config, ``lr``, ``seed`` and ``warmup``, version ``i`` equals
    version ``i`` of the benchmark workload (:mod:`deltastore.bench.workload`).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        lr: float = 1e-6,
        seed: int = 0,
        warmup: int = 0,
        pool: Executor | None = None,
    ) -> None:
        self.tensors = {
            name: AdamWTensor(name, shape, position=i, lr=lr, seed=seed, pool=pool)
            for i, (name, shape) in enumerate(config.shapes().items())
        }
        #: fp32 master weights by name (the optimizer's parameters).
        self.params: dict[str, torch.nn.Parameter] = {
            name: t.param for name, t in self.tensors.items()
        }
        for _ in range(warmup):
            self._advance()

    def _advance(self) -> None:
        for t in self.tensors.values():
            t.step()

    def bf16(self) -> dict[str, torch.Tensor]:
        """Current weights cast to bf16 (new tensors)."""
        return {name: t.bf16() for name, t in self.tensors.items()}

    def step(self) -> dict[str, torch.Tensor]:
        """One real AdamW step of every tensor; returns the new bf16 weights."""
        self._advance()
        return self.bf16()


__all__ = [
    "LARGE",
    "MEDIUM",
    "SIZES",
    "SMALL",
    "TINY",
    "AdamWTensor",
    "AdamWTrajectory",
    "ModelConfig",
    "fill_normal",
]
