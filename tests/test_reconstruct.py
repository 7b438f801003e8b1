"""The snapshot-free reconstruction (``deltastore.publish.reconstruct``) against real
``torch.optim.AdamW`` steps: every element it calls certain is bit-exactly the bf16 word the
parameter had before the step (checked against a copy the test keeps), the fp32 value before
the step lies within the unscaled bound, few elements are uncertain, and every case the
inverse does not cover is gated with its reason and no reconstruction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from deltastore.publish.reconstruct import (
    SAFETY,
    AdamWInverter,
    Gate,
    Inversion,
    bf16_words,
    reconstruct_chunk,
)

torch = pytest.importorskip("torch")
nn = torch.nn

from tests.trainer import IMPLS, TinyLM, groups, warmup_cosine, words  # noqa: E402


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: on a shared 2-core machine torch's spinning pool costs 20x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Tally:
    elements: int = 0
    changed: int = 0
    uncertain: int = 0
    wrong: int = 0
    outside: int = 0
    per_step: list[float] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        """Uncertain elements over all elements, summed over the steps."""
        return self.uncertain / self.elements

    def summary(self) -> str:
        """The uncertain fractions, as printed by the tests."""
        return (
            f"uncertain {self.fraction:.2e} of elements, "
            f"{self.uncertain / max(self.changed, 1):.2e} of changed ({self.changed} changed), "
            f"after the first step mean {np.mean(self.per_step[1:]):.2e}, "
            f"worst {max(self.per_step[1:]):.2e}"
        )


def train(
    model: TinyLM,
    opt: torch.optim.Optimizer,
    steps: int,
    *,
    batch: tuple[int, int],
    check_bound: bool,
    chunk: int = 1 << 20,
) -> Tally:
    """``steps`` real steps (clipping, warm-up + cosine stepped after ``step()``); after each,
    every parameter is reconstructed and compared with the words kept before the step."""
    gen = torch.Generator().manual_seed(1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(steps))
    inv = AdamWInverter(opt)
    inv.mark()
    tally = Tally()
    params = list(model.parameters())
    vocab = model.embed.num_embeddings
    for _ in range(steps):
        before = [words(p) for p in params]
        before32 = [p.detach().reshape(-1).clone().numpy() for p in params] if check_bound else []
        tokens = torch.randint(0, vocab, batch, generator=gen)
        opt.zero_grad()
        model.loss(tokens).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step_uncertain = 0
        for i, p in enumerate(params):
            plan = inv.plan(p)
            assert isinstance(plan, Inversion), plan
            after = words(p)
            for part in plan.chunks(chunk):
                stop = part.start + len(part.words)
                true = before[i][part.start : stop]
                assert part.words.dtype == np.dtype("<u2")
                tally.wrong += int(np.count_nonzero(part.certain & (part.words != true)))
                step_uncertain += int(np.count_nonzero(~part.certain))
                tally.changed += int(np.count_nonzero(after[part.start : stop] != true))
            if check_bound:
                flat = [t.detach().reshape(-1).numpy() for t in (p, *_moments(opt, p))]
                x, bound, exposed = reconstruct_chunk(*flat, plan.coefficients)
                ok = np.abs(before32[i].astype(np.float64) - x) <= bound / SAFETY
                tally.outside += int(np.count_nonzero(~ok & ~exposed & np.isfinite(x)))
        n = sum(p.numel() for p in params)
        tally.elements += n
        tally.uncertain += step_uncertain
        tally.per_step.append(step_uncertain / n)
        inv.mark()
    inv.close()
    return tally


def _moments(opt: torch.optim.Optimizer, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    state = opt.state[p]
    return state["exp_avg"], state["exp_avg_sq"]


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("lr", [1e-6, 3e-4])
@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_certain_elements_are_exact(impl: str, lr: float, wd: float) -> None:
    """foreach, fused and single-tensor AdamW; lr 1e-6 and 3e-4 with warm-up + cosine stepped
    after ``step()``; weight decay 0 and 0.1; two param groups; clipping: no certain element is
    wrong, every value before the step is inside the unscaled bound, and under 1% of the
    elements are uncertain (printed)."""
    torch.manual_seed(0)
    model = TinyLM(vocab=256, dim=64, hidden=128, blocks=2)
    opt = torch.optim.AdamW(groups(model, lr, wd), **IMPLS[impl])
    tally = train(model, opt, 12, batch=(4, 17), check_bound=True, chunk=4096)
    print(f"\n{impl} lr={lr} wd={wd}: {tally.summary()}")
    assert tally.wrong == 0
    assert tally.outside == 0
    assert tally.fraction < 0.01


def test_long_run_on_a_2m_model() -> None:
    """300 foreach steps of a 2.1M-parameter model (lr 3e-4, weight decay 0.1 on matrices):
    never a wrong certain element; the uncertain fraction stays small at every step after the
    first (where the zero biases cannot be certified: their sign is unknown)."""
    torch.manual_seed(0)
    model = TinyLM(vocab=1024, dim=256, hidden=1024, blocks=3)
    assert sum(p.numel() for p in model.parameters()) >= 2_000_000
    opt = torch.optim.AdamW(groups(model, 3e-4, 0.1), foreach=True)
    tally = train(model, opt, 300, batch=(2, 9), check_bound=False)
    print(f"\nlong run: {tally.summary()}")
    assert tally.wrong == 0
    assert tally.fraction < 1e-3
    assert max(tally.per_step[1:]) < 0.01


def stepped(
    opt_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
) -> tuple[nn.Linear, torch.optim.Optimizer, AdamWInverter]:
    """A small layer, its optimizer, an inverter marked after one step, and one more step."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    opt = opt_factory(list(layer.parameters()))
    inv = AdamWInverter(opt)
    _step(layer, opt)
    inv.mark()
    _step(layer, opt)
    return layer, opt, inv


def _step(layer: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    layer(torch.randn(3, 8)).pow(2).sum().backward()
    opt.step()


def gate_of(inv: AdamWInverter, p: torch.Tensor) -> str:
    plan = inv.plan(p)
    assert isinstance(plan, Gate), plan
    assert plan.reason
    return plan.code


@pytest.mark.parametrize(
    ("factory", "code"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "optimizer"),
        (lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.1), "adam-l2"),
        (lambda ps: torch.optim.AdamW(ps, amsgrad=True), "amsgrad"),
        (lambda ps: torch.optim.AdamW(ps, maximize=True), "maximize"),
    ],
)
def test_gates_other_optimizers(
    factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer], code: str
) -> None:
    """SGD, Adam with L2 decay, AMSGrad, maximize, differentiable: gated, never inverted."""
    layer, _, inv = stepped(factory)
    assert gate_of(inv, layer.weight) == code


@pytest.mark.parametrize("flag", ["capturable", "differentiable"])
def test_gates_capturable_and_differentiable(flag: str) -> None:
    layer = nn.Linear(8, 4)
    inv = AdamWInverter(torch.optim.AdamW(layer.parameters(), **{flag: True}))
    inv.mark()
    assert gate_of(inv, layer.weight) == flag


def test_adam_without_decay_is_inverted() -> None:
    """Adam with weight_decay 0 is AdamW with weight_decay 0: inverted, and exact."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
    inv = AdamWInverter(opt)
    inv.mark()
    before = words(layer.weight)
    _step(layer, opt)
    plan = inv.plan(layer.weight)
    assert isinstance(plan, Inversion)
    part = plan.chunk(0, plan.numel)
    assert np.array_equal(part.words[part.certain], before[part.certain])


def test_gates_bf16_params_and_moments() -> None:
    layer, _, inv = stepped(lambda ps: torch.optim.AdamW(ps))
    layer16 = nn.Linear(8, 4).to(torch.bfloat16)
    opt16 = torch.optim.AdamW(layer16.parameters())
    inv16 = AdamWInverter(opt16)
    inv16.mark()
    opt16.zero_grad()
    layer16(torch.randn(3, 8, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    opt16.step()
    assert gate_of(inv16, layer16.weight) == "dtype"
    state = inv.optimizer.state[layer.weight]
    state["exp_avg_sq"] = state["exp_avg_sq"].to(torch.bfloat16)
    assert gate_of(inv, layer.weight) == "dtype"
    assert isinstance(inv.plan(layer.bias), Inversion)


def test_gates_frozen_params_and_buffers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    model[1].weight.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters())
    inv = AdamWInverter(opt)
    inv.mark()
    _step(model, opt)
    assert gate_of(inv, model[1].weight) == "no-state"
    assert gate_of(inv, model[1].running_mean) == "not-a-parameter"
    assert isinstance(inv.plan(model[0].weight), Inversion)


def test_gates_watermark() -> None:
    """No mark: no-watermark. A step() that moved nothing (a skipped step leaves ``step``
    unchanged): unchanged. Two steps since the mark: steps. The step after a skipped one is
    inverted when the lr did not change, gated as ambiguous when it did."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    inv = AdamWInverter(opt)
    _step(layer, opt)
    assert gate_of(inv, layer.weight) == "no-watermark"
    inv.mark()
    opt.zero_grad(set_to_none=True)
    opt.step()  # what GradScaler's skip leaves: no parameter moved, the counter unchanged
    assert gate_of(inv, layer.weight) == "unchanged"
    before = words(layer.weight)
    _step(layer, opt)
    plan = inv.plan(layer.weight)
    assert isinstance(plan, Inversion)
    part = plan.chunk(0, plan.numel)
    assert np.array_equal(part.words[part.certain], before[part.certain])
    _step(layer, opt)
    assert gate_of(inv, layer.weight) == "steps"
    inv.mark()
    opt.zero_grad(set_to_none=True)
    opt.step()
    opt.param_groups[0]["lr"] = 2e-3
    _step(layer, opt)
    assert gate_of(inv, layer.weight) == "ambiguous-lr"


def test_gates_missing_lr() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    opt = torch.optim.AdamW(layer.parameters())
    inv = AdamWInverter(opt)
    inv.mark()
    inv.close()
    _step(layer, opt)
    assert gate_of(inv, layer.weight) == "no-lr"


def test_a_wrong_lr_gives_wrong_certain_elements() -> None:
    """The bound covers the rounding of the step, not a wrong input: with the step run at
    twice the captured lr, elements called certain are wrong. A publisher must verify what
    it reconstructs (block digests) before trusting it."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 64)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, weight_decay=0.1)
    inv = AdamWInverter(opt)

    def double_lr(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        optimizer.param_groups[0]["lr"] = 2e-2  # after the inverter captured 1e-2

    opt.register_step_pre_hook(double_lr)
    inv.mark()
    before = words(layer.weight)
    opt.zero_grad()
    layer(torch.randn(16, 64)).pow(2).sum().backward()
    opt.step()
    plan = inv.plan(layer.weight)
    assert isinstance(plan, Inversion)
    part = plan.chunk(0, plan.numel)
    assert np.count_nonzero(part.certain & (part.words != before)) > 0


def test_bf16_words_match_torch() -> None:
    """The bf16 rounding used for certainty is torch's cast, bit for bit, on ties, subnormals,
    infinities (a NaN becomes some NaN word)."""
    gen = np.random.default_rng(0)
    bits = gen.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    ties = (gen.integers(0, 2**16, 1000, dtype=np.uint32) << 16) | 0x8000
    special = np.array(
        [0, 0x80000000, 0x7F800000, 0xFF800000, 1, 0x7F7FFFFF, 0x7FC00001], np.uint32
    )
    x = np.concatenate([bits, ties, special]).view(np.float32)
    mine, torchs = bf16_words(x), words(torch.from_numpy(x))
    nan = np.isnan(x)
    assert np.array_equal(mine[~nan], torchs[~nan])
    assert np.all((mine[nan] & 0x7F80 == 0x7F80) & (mine[nan] & 0x7F != 0))


def test_zero_update_keeps_a_signed_zero() -> None:
    """A parameter at +-0 whose exp_avg is +0 did not move: certain, sign kept; with exp_avg
    -0 the sign of the old zero is lost (-0 + +0 is +0): uncertain."""
    from deltastore.publish.reconstruct import StepScalars, invert_chunk, step_coefficients

    coef = step_coefficients(StepScalars(1e-3, 0.9, 0.999, 1e-8, 0.1, 5))
    assert not isinstance(coef, Gate)
    param = np.array([0.0, -0.0, 0.0, 1e-3], np.float32)
    m = np.array([0.0, 0.0, -0.0, 1e-3], np.float32)
    v = np.full(4, 1e-6, np.float32)
    w, certain = invert_chunk(param, m, v, coef)
    assert certain.tolist()[:3] == [True, True, False]
    assert w[:2].tolist() == [0x0000, 0x8000]


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_a_step_gradscaler_skipped_is_unchanged(impl: str) -> None:
    """GradScaler finds an inf: the fused kernel skips the update and puts ``step`` back, the
    other paths do not call ``step()``: unchanged. The next step is inverted, exactly."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3, **IMPLS[impl])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    inv = AdamWInverter(opt)

    def scaled_step(overflow: bool) -> None:
        opt.zero_grad()
        loss = layer(torch.randn(3, 8)).pow(2).sum() * (math.inf if overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    scaled_step(False)
    inv.mark()
    before = words(layer.weight)
    scaled_step(True)
    assert gate_of(inv, layer.weight) == "unchanged"
    assert np.array_equal(words(layer.weight), before)
    scaled_step(False)
    plan = inv.plan(layer.weight)
    assert isinstance(plan, Inversion)
    part = plan.chunk(0, plan.numel)
    assert part.certain.any()
    assert np.array_equal(part.words[part.certain], before[part.certain])


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_bound_holds_across_magnitudes(impl: str) -> None:
    """Weights from 1e-33 to 1e3 (and exact zeros), gradients from 1e-38 to 1e2 (subnormal
    second moments, updates far larger than the weights, zero gradients), lr up to 1e-2:
    never a wrong certain element, the true value always within the unscaled bound where no
    intermediate may be subnormal."""
    gen = torch.Generator().manual_seed(3)
    n = 50_000
    for lr, wd in [(1e-2, 0.1), (3e-4, 0.0), (1e-6, 0.1)]:
        mag = 10 ** (torch.rand(n, generator=gen) * 36 - 33)
        p = nn.Parameter(torch.randn(n, generator=gen).sign() * mag)
        p.data[:500] = 0
        opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd, **IMPLS[impl])
        inv = AdamWInverter(opt)
        inv.mark()
        for step in range(4):
            before32 = p.detach().clone().numpy()
            before = words(p)
            p.grad = torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * 40 - 38)
            if step == 2:
                p.grad[:2000] = 0
            opt.step()
            plan = inv.plan(p)
            assert isinstance(plan, Inversion), plan
            part = plan.chunk(0, n)
            assert np.count_nonzero(part.certain & (part.words != before)) == 0
            assert part.certain.mean() > 0.3  # not vacuous
            flat = [t.detach().numpy() for t in (p, *_moments(opt, p))]
            x, bound, exposed = reconstruct_chunk(*flat, plan.coefficients)
            inside = np.abs(before32.astype(np.float64) - x) <= bound / SAFETY
            assert np.count_nonzero(~inside & ~exposed & np.isfinite(x)) == 0
            inv.mark()
