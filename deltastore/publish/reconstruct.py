"""The previous bf16 words of AdamW-updated parameters, from the optimizer's own state.

A snapshot-free publisher needs the words it published last (the XOR parent) without keeping
them. After one ``torch.optim.AdamW`` step the previous fp32 master value ``p0`` of each element
follows from the current one ``p`` and the state the optimizer keeps (``exp_avg`` m,
``exp_avg_sq`` v, ``step`` t) and the hyper-parameters the step used (lr, betas, eps,
weight_decay)::

    d = 1 - lr * weight_decay                  alpha = lr / (1 - beta1**t)
    c = sqrt(1 - beta2**t)                     U = alpha * m / (sqrt(v) / c + eps)
    p = fl(p0 * d) - U  (fp32 roundings)  =>   x = (p + U) / d  (float64)

Each element also gets a rigorous bound ``B >= |p0 - x|`` that covers the fp32 roundings of the
step's own computation in any operation order or with FMA (see :func:`step_coefficients` and
docs/design/snapshot-free.md): ``B = 2 * ((u*|p| + E_upd*|U|) / d + E_wt*|x| + g*(|p|+|U|)/d
+ g*|x|)``, ``u = 2**-24``, ``g = 2**-50``. An element is *certain* when every fp32 value in
``[x - B, x + B]`` casts to the same bf16 word (round to nearest even, as torch's cast):
rounding is monotone, so it suffices that the interval lies strictly between the two rounding
ties (fp32 values) around ``x``. The bound is not a substitute for verification: fed a wrong
lr, a certain element can be wrong.

Pure numpy below :class:`AdamWInverter`; torch is imported only in :meth:`AdamWInverter.plan`.
Units: element counts and element offsets in the parameter's C order; words are ``<u2``
(bf16 bit patterns, little-endian).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    import torch

#: Unit roundoff of IEEE binary32 (round to nearest).
U32 = 2.0**-24
#: Slack for the float64 arithmetic of the reconstruction itself.
G64 = 2.0**-50
#: Factor applied to the whole first-order bound (absorbs second-order terms).
SAFETY = 2.0
#: Below this magnitude an fp32 intermediate might be subnormal: its rounding error is not
#: relative any more, so such elements are never certain.
TINY = 2.0**-125
#: Elements reconstructed per chunk by :meth:`Inversion.chunks` (float64 temporaries: a peak
#: of about 41 bytes per element of the chunk, 41 MiB at this size).
DEFAULT_CHUNK = 1 << 20
#: Largest relative scalar uncertainty accepted before a step is gated.
MAX_SCALAR_ERROR = 1e-3
#: Step pre-hook calls remembered between two :meth:`AdamWInverter.mark` calls.
MAX_CALLS = 64

GateCode = Literal[
    "unchanged",
    "steps",
    "no-watermark",
    "no-lr",
    "ambiguous-lr",
    "optimizer",
    "adam-l2",
    "amsgrad",
    "maximize",
    "capturable",
    "differentiable",
    "dtype",
    "layout",
    "no-state",
    "not-a-parameter",
    "hyper",
]


@dataclass(frozen=True)
class Gate:
    """Why a parameter is not reconstructed. ``code`` is one of :data:`GateCode`;
    ``unchanged`` means no optimizer step moved it since the last mark (its words are the
    current ones: an empty delta, to be verified); every other code means "fall back" (anchor,
    or a snapshot of this tensor). ``reason``: one sentence for a report or a log."""

    code: GateCode
    reason: str

    @property
    def unchanged(self) -> bool:
        return self.code == "unchanged"


@dataclass(frozen=True)
class StepScalars:
    """The hyper-parameters one AdamW step of one param group used, and the step count ``t``
    of the parameter after that step (``state["step"]``, 1 for the first step).
    ``device_scalars``: the kernel may compute the bias corrections in fp32 on the device
    (the fused CUDA kernel); else they are computed in double (every CPU path, foreach and
    single-tensor everywhere)."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    device_scalars: bool = False


@dataclass(frozen=True)
class Coefficients:
    """What :func:`invert_chunk` needs: the float64 centres ``decay`` (d), ``step_size``
    (alpha), ``bc2_sqrt`` (c), ``eps``, and the relative error bounds ``weight_rel`` (E_wt:
    the decay multiply, its scalar and its rounding) and ``update_rel`` (E_upd: the kernel's
    whole computation of the update U, scalars included)."""

    decay: float
    step_size: float
    bc2_sqrt: float
    eps: float
    weight_rel: float
    update_rel: float


def _f32(x: float) -> float:
    return float(np.float32(x))


def _rel(candidate: float, centre: float) -> float:
    return abs(candidate - centre) / abs(centre)


def _bias_correction(beta: float, t: int, device_scalars: bool) -> tuple[float, float]:
    """``1 - beta**t`` in float64 and its relative uncertainty: computed in double (torch's
    Python paths and the fused CPU kernel) and rounded to fp32 once where used, or, with
    ``device_scalars``, possibly in fp32 on the device (pow of the fp32 beta and step, with a
    few ulps of pow error)."""
    exact = 1.0 - beta**t
    if not device_scalars:
        return exact, 16 * 2.0**-53 / exact
    with np.errstate(all="ignore"):
        in_f32 = float(np.float32(1.0) - np.float32(beta) ** np.float32(t))
    sigma = max(_rel(_f32(exact), exact), _rel(in_f32, exact)) + 8 * U32 * beta**t / exact
    return exact, sigma + 2 * U32


def step_coefficients(s: StepScalars) -> Coefficients | Gate:
    """The centres and error bounds of one step, or a ``hyper`` gate when the hyper-parameters
    are out of range or the scalar uncertainty exceeds :data:`MAX_SCALAR_ERROR`.

    Error model: each scalar the kernel uses (d, alpha, c, eps) is the float64 centre times
    ``1 + s`` with ``|s| <= sigma`` (the largest deviation of the candidate computations, fp32
    casts and, with ``device_scalars``, fp32 computation; plus one u of slack); each fp32
    operation on elements rounds once, relative error ``<= u``. The update
    ``fl(alpha*m / (fl(sqrt v)/c + eps))`` takes at most six roundings in any order (sqrt, the
    division by c or a reciprocal and a multiply, the eps add, the alpha product, the
    division); the denominator is a sum of non-negative terms, so its relative error is the
    largest of its parts'. Hence E_upd = sigma_alpha + max(sigma_c, sigma_eps) + 7u and
    E_wt = sigma_d + u (one rounding of ``p0*d``, or of the CUDA kernel's ``p0 - lr*wd*p0``
    computed in double; 0 when weight_decay is 0: no multiply); an FMA only removes
    roundings. The final subtraction's rounding (``u*|p|``) is in :func:`invert_chunk`."""
    values = (s.lr, s.beta1, s.beta2, s.eps, s.weight_decay)
    if not all(math.isfinite(v) for v in values) or s.step < 1:
        return Gate("hyper", f"non-finite hyper-parameter or step < 1 ({s})")
    if not (s.lr >= 0 and 0 <= s.beta1 < 1 and 0 <= s.beta2 < 1 and s.eps >= 0):
        return Gate("hyper", f"hyper-parameters out of AdamW's range ({s})")
    if not 0 <= s.lr * s.weight_decay < 0.5:
        return Gate("hyper", f"lr * weight_decay must be in [0, 0.5) ({s})")
    decay = 1.0 - s.lr * s.weight_decay
    with np.errstate(all="ignore"):
        d32 = float(np.float32(1) - np.float32(s.lr) * np.float32(s.weight_decay))
    sigma_d = max(_rel(_f32(decay), decay), _rel(d32, decay)) + U32
    bc1, sigma_bc1 = _bias_correction(s.beta1, s.step, s.device_scalars)
    bc2, sigma_bc2 = _bias_correction(s.beta2, s.step, s.device_scalars)
    step_size = s.lr / bc1
    bc2_sqrt = math.sqrt(bc2)
    sigma_alpha = sigma_bc1 + U32
    sigma_c = sigma_bc2 / 2 + U32
    sigma_eps = U32
    # weight_decay == 0: torch skips the multiply (or multiplies by 1.0): p0 * d is exact.
    weight_rel = sigma_d + U32 if s.weight_decay != 0 else 0.0
    update_rel = sigma_alpha + max(sigma_c, sigma_eps) + 7 * U32
    if not (weight_rel < MAX_SCALAR_ERROR and update_rel < MAX_SCALAR_ERROR):
        return Gate("hyper", f"scalar uncertainty {max(weight_rel, update_rel):.2e} is too large")
    return Coefficients(decay, step_size, bc2_sqrt, s.eps, weight_rel, update_rel)


def bf16_words(x: np.ndarray) -> np.ndarray:
    """bf16 words (``<u2``) of fp32 values, rounded to nearest even as torch's cast does
    (NaN becomes 0x7FC0)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
    words = rounded.astype("<u2")
    words[np.isnan(x)] = 0x7FC0
    return words


def reconstruct_chunk(
    param: np.ndarray, exp_avg: np.ndarray, exp_avg_sq: np.ndarray, coef: Coefficients
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The float64 reconstruction ``x`` of the values before the step, the bound ``B``
    (:data:`SAFETY` included) with ``|p0 - x| <= B / SAFETY`` wherever the third result,
    ``exposed``, is False. ``exposed``: a rounded fp32 result of the step (``p0*d``, the new
    value, ``alpha*m``, ``m/den``, the update) might have been subnormal (below :data:`TINY`),
    where rounding errors are not relative.

    ``param``, ``exp_avg``, ``exp_avg_sq``: 1-D float32 arrays of equal length, the values
    after the step. Non-finite inputs give non-finite ``x`` or ``B``. Pure, thread-safe;
    float64 temporaries of the chunk's size."""
    d = coef.decay
    alpha = coef.step_size
    with np.errstate(all="ignore"):
        p = param.astype(np.float64)
        update = exp_avg.astype(np.float64)
        den = exp_avg_sq.astype(np.float64)
        np.sqrt(den, out=den)
        den /= coef.bc2_sqrt
        den += coef.eps
        scratch = np.abs(update)
        # alpha*|m|, |m|/den and |U| = alpha*|m|/den are all >= TINY exactly when
        # |m| >= TINY * max(1/alpha, den * max(1, 1/alpha)).
        floor = den * (TINY * max(1.0, 1.0 / alpha) if alpha > 0 else math.inf)
        np.maximum(floor, TINY / alpha if alpha > 0 else math.inf, out=floor)
        exposed = scratch < floor
        del floor
        exposed &= scratch != 0
        exposed |= (np.abs(param) < TINY) & (param != 0)
        update *= alpha
        update /= den
        abs_u = np.abs(update, out=den)
        x = np.add(p, update, out=update)
        x /= d
        bound = np.abs(p, out=p)
        bound *= SAFETY * (U32 + G64) / d
        np.multiply(abs_u, SAFETY * (coef.update_rel + G64) / d, out=scratch)
        bound += scratch
        np.abs(x, out=scratch)
        exposed |= scratch < TINY / d
        scratch *= SAFETY * (coef.weight_rel + G64)
        bound += scratch
    return x, bound, exposed


def invert_chunk(
    param: np.ndarray, exp_avg: np.ndarray, exp_avg_sq: np.ndarray, coef: Coefficients
) -> tuple[np.ndarray, np.ndarray]:
    """Previous bf16 words and the certain mask of one chunk.

    ``param``, ``exp_avg``, ``exp_avg_sq``: 1-D float32 arrays of equal length, the values
    after the step. Returns ``(words, certain)``: ``<u2`` words (bf16 of the reconstruction, a
    best guess; where ``certain`` is True, provably the bf16 word of the value before the
    step; for a NaN reconstruction no particular word) and a bool
    mask. An element is certain when ``[|x| - B, |x| + B]`` lies strictly between the two
    bf16 rounding ties around ``|x|`` (then every fp32 value within the bound, the true one
    included, casts to the same word; the float64 rounding of ``|x| +- B`` is far inside the
    safety factor). Never certain: non-finite values, ``exposed`` elements
    (:func:`reconstruct_chunk`), intervals that touch zero (the sign of a zero is not known,
    and the zero word's cell is not checked), except an element with
    ``param == 0`` and ``exp_avg == +0`` (the update was exactly zero and the decay keeps the
    sign: it was that zero). Assumes IEEE arithmetic with gradual underflow (torch's default;
    ``torch.set_flush_denormal(True)`` is not covered). Pure, thread-safe; float64
    temporaries of the chunk's size."""
    x, bound, exposed = reconstruct_chunk(param, exp_avg, exp_avg_sq, coef)
    with np.errstate(all="ignore"):
        bits = x.astype(np.float32).view(np.uint32)
        rounded = bits >> 16
        rounded &= 1
        rounded += 0x7FFF
        rounded += bits
        rounded >>= 16
        words = rounded.astype("<u2")
        # The fp32 magnitudes that round to this word lie between the two ties around it
        # (exact fp32 values; for the zero word the lower one wraps to NaN: never certain).
        rounded &= 0x7FFF
        rounded <<= 16
        ax = np.abs(x, out=x)
        edge = np.subtract(ax, bound)
        certain = edge > (rounded - 0x8000).view(np.float32)
        np.add(ax, bound, out=edge)
        certain &= edge < (rounded + 0x8000).view(np.float32)
        certain &= ~exposed
    zeros = np.flatnonzero(param == 0)
    if zeros.size:
        m = exp_avg[zeros]
        kept = zeros[(m == 0) & ~np.signbit(m)]
        certain[kept] = True
        words[kept] = (param[kept].view(np.uint32) >> 16).astype("<u2")
    return words, certain


_InvertFn = Callable[
    [np.ndarray, np.ndarray, np.ndarray, Coefficients], tuple[np.ndarray, np.ndarray]
]
_kernel: list[_InvertFn] = []


def _fast_invert() -> _InvertFn:
    """The compiled kernel (:mod:`deltastore.publish.invert_kernel`, bit-identical to
    :func:`invert_chunk`, numba) when it imports, else :func:`invert_chunk`; imported on the
    first reconstruction only."""
    if not _kernel:
        kernel: _InvertFn
        try:
            from deltastore.publish.invert_kernel import invert_chunk as kernel
        except ImportError:  # numba missing or not built for this platform
            kernel = invert_chunk
        _kernel.append(kernel)
    return _kernel[0]


@dataclass(frozen=True)
class ReconstructedChunk:
    """Elements ``[start, start + len(words))`` of a parameter (flat, C order): ``words``, the
    previous bf16 words (``<u2``), and ``certain``, where those words are proven."""

    start: int
    words: np.ndarray
    certain: np.ndarray


class Inversion:
    """One parameter's reconstruction, computed chunk by chunk on demand.

    Reads the live parameter and moments (a DTensor's local shards: element offsets are then
    in the local shard): compute every chunk before the next ``optimizer.step()``.
    :meth:`chunk` is pure numpy on copies of one range, so several threads may compute
    different chunks at once (no step running meanwhile). Memory: O(chunk)."""

    def __init__(
        self,
        param: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        coef: Coefficients,
    ) -> None:
        # a DTensor (FSDP2) parameter and its moments: this rank's local shards
        local = [
            t.to_local() if hasattr(t, "to_local") else t for t in (param, exp_avg, exp_avg_sq)
        ]
        self._flat = [t.detach().reshape(-1) for t in local]
        self.coefficients = coef
        self.numel = int(local[0].numel())

    def chunk(
        self, start: int, stop: int, out: tuple[np.ndarray, np.ndarray] | None = None
    ) -> ReconstructedChunk:
        """Elements ``[start, stop)`` (clipped to the parameter). ``out``: a ``<u2`` and a
        bool buffer (1-D, contiguous, at least the chunk's length) to write the words and the
        certain mask into, e.g. one pair per thread reused from chunk to chunk (the results
        are then views of their first elements)."""
        start, stop = max(0, start), min(stop, self.numel)
        arrays = [t[start:stop].cpu().numpy() for t in self._flat]
        kernel = _fast_invert()
        if out is None:
            words, certain = kernel(arrays[0], arrays[1], arrays[2], self.coefficients)
        elif kernel is invert_chunk:  # the numpy reference: no out, copied
            w, c = invert_chunk(arrays[0], arrays[1], arrays[2], self.coefficients)
            words, certain = out[0][: w.size], out[1][: w.size]
            words[:], certain[:] = w, c
        else:
            from deltastore.publish.invert_kernel import invert_chunk as fast

            words, certain = fast(arrays[0], arrays[1], arrays[2], self.coefficients, out=out)
        return ReconstructedChunk(start, words, certain)

    def candidates(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For elements at flat ``positions`` (int64, any order): the bf16 words of the two
        ends of the bound, ``bf16(x - B)`` and ``bf16(x + B)`` (``<u2``; the true previous word
        lies between them in value, wherever the bound holds), and whether ``[x - B, x + B]``
        touches zero (then ``+0`` is a likely candidate: a zero-initialised element). Used to
        resolve the uncertain elements of a block against a digest. Reads the range from
        the smallest to the largest position once (one slice per tensor, numpy indexing:
        gather the positions of one chunk in one call); O(that range)."""
        if positions.size == 0:
            empty = np.empty(0, dtype="<u2")
            return empty, empty.copy(), np.empty(0, dtype=np.bool_)
        lo_at, hi_at = int(positions.min()), int(positions.max()) + 1
        local = positions - lo_at
        arrays = [t[lo_at:hi_at].cpu().numpy()[local] for t in self._flat]
        x, bound, _ = reconstruct_chunk(arrays[0], arrays[1], arrays[2], self.coefficients)
        with np.errstate(all="ignore"):
            lo, hi = x - bound, x + bound
            zero = (lo <= 0) & (hi >= 0)
            return bf16_words(lo.astype(np.float32)), bf16_words(hi.astype(np.float32)), zero

    def chunks(self, chunk_elements: int = DEFAULT_CHUNK) -> Iterator[ReconstructedChunk]:
        """The whole parameter, ``chunk_elements`` at a time (1-4 Mi is a good size)."""
        for start in range(0, self.numel, max(1, chunk_elements)):
            yield self.chunk(start, start + chunk_elements)


def _scalar(value: Any) -> float:
    """A hyper-parameter as a float (a 1-element tensor included)."""
    return float(value)


def _capture(value: Any) -> Any:
    """A hyper-parameter as the step sees it: a tensor is copied (schedulers fill it in place)."""
    clone = getattr(value, "clone", None)
    return clone().detach() if callable(clone) else value


class AdamWInverter:
    """Attaches to a ``torch.optim.AdamW`` and tells, per parameter, how to get the words it
    had at the last :meth:`mark`: an :class:`Inversion` or a :class:`Gate`.

    Call order: ``AdamWInverter(optimizer)`` before the first ``step()`` whose result will be
    reconstructed (it registers a step pre-hook that records each param group's lr, betas, eps
    and weight_decay as the step uses them: a scheduler stepped after ``step()`` changes
    ``param_groups[i]["lr"]``); :meth:`mark` once the version holding the current weights is
    published (the step watermark: each parameter's ``state["step"]``); after the next
    ``step()``, :meth:`plan` for each parameter, read its chunks, publish, :meth:`mark` again;
    :meth:`close` to remove the hook. A parameter is reconstructed only when exactly one step
    moved it since the mark: no step (``step`` unchanged, e.g. a step GradScaler skipped) is
    the ``unchanged`` gate, more than one is ``steps``. Not thread-safe: call it from the
    training thread, between steps."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._calls: list[list[tuple[Any, Any, Any, Any]]] = []
        self._overflow = False
        self._marks: dict[int, int] | None = None
        self._groups: dict[int, int] = {}
        self._handle = optimizer.register_step_pre_hook(self._pre_step)

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if len(self._calls) >= MAX_CALLS:
            self._overflow = True
            self._calls.pop(0)
        self._calls.append(
            [
                (
                    _capture(g.get("lr", math.nan)),
                    tuple(_capture(b) for b in g.get("betas", (math.nan, math.nan))),
                    g.get("eps", math.nan),
                    g.get("weight_decay", math.nan),
                )
                for g in optimizer.param_groups
            ]
        )

    def close(self) -> None:
        """Remove the step pre-hook (idempotent)."""
        self._handle.remove()

    def mark(self) -> None:
        """Record the step watermark of every parameter (0 for one without state yet) and
        forget the captured hyper-parameters: call after a publish of the current weights."""
        self._groups = {
            id(p): i for i, g in enumerate(self.optimizer.param_groups) for p in g["params"]
        }
        self._marks = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                state = self.optimizer.state.get(p, {})
                self._marks[id(p)] = int(_scalar(state["step"])) if "step" in state else 0
        self._calls = []
        self._overflow = False

    def plan(self, param: torch.Tensor) -> Inversion | Gate:
        """How to get ``param``'s words at the last mark: an :class:`Inversion` after exactly
        one plain AdamW step, else a :class:`Gate` with the reason."""
        import torch

        opt = self.optimizer
        wrong = _type_gate(opt)
        if wrong is not None:
            return wrong
        if id(param) not in self._groups:
            self._groups = {id(p): i for i, g in enumerate(opt.param_groups) for p in g["params"]}
        index = self._groups.get(id(param))
        if index is None:
            return Gate("not-a-parameter", "the tensor is not a parameter of the optimizer")
        group = opt.param_groups[index]
        gate = _group_gate(group)
        if gate is not None:
            return gate
        state = opt.state.get(param, {})
        if "exp_avg" not in state or "exp_avg_sq" not in state or "step" not in state:
            return Gate("no-state", "no optimizer state (frozen, or never stepped)")
        moments = (state["exp_avg"], state["exp_avg_sq"])
        if param.dtype != torch.float32 or any(t.dtype != torch.float32 for t in moments):
            kinds = ", ".join(str(t.dtype) for t in (param, *moments))
            return Gate("dtype", f"parameter and moments must be float32 (found {kinds})")
        if not all(
            t.is_contiguous() and t.shape == param.shape and t.device == param.device
            for t in (param, *moments)
        ):
            return Gate("layout", "parameter or moments not contiguous, or not alike")
        if self._marks is None or id(param) not in self._marks:
            return Gate("no-watermark", "no mark since attaching: the last step is unknown")
        step = int(_scalar(state["step"]))
        moved = step - self._marks[id(param)]
        if moved == 0:
            return Gate("unchanged", "no optimizer step moved it since the last mark")
        if moved != 1:
            return Gate("steps", f"{moved} optimizer steps since the last mark, not 1")
        return self._inversion(param, index, step, moments)

    def _inversion(
        self, param: torch.Tensor, index: int, step: int, moments: tuple[Any, Any]
    ) -> Inversion | Gate:
        seen = [call[index] for call in self._calls if index < len(call)]
        if not seen or self._overflow:
            return Gate("no-lr", "no captured lr for the step (hook attached after it?)")
        hypers = {
            (_scalar(lr), _scalar(b[0]), _scalar(b[1]), _scalar(eps), _scalar(wd))
            for lr, b, eps, wd in seen
        }
        if len(hypers) != 1:
            return Gate(
                "ambiguous-lr",
                f"{len(seen)} step() calls with different hyper-parameters since the last "
                "mark moved it once (a skipped step?): which one moved it is unknown",
            )
        lr, beta1, beta2, eps, wd = hypers.pop()
        fused_device = bool(self.optimizer.param_groups[index].get("fused")) and (
            param.device.type != "cpu"
        )
        coef = step_coefficients(StepScalars(lr, beta1, beta2, eps, wd, step, fused_device))
        if isinstance(coef, Gate):
            return coef
        return Inversion(param, moments[0], moments[1], coef)


def optimizer_gate(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> Gate | None:
    """The gates of :meth:`AdamWInverter.plan` that hold for every step (the optimizer's
    type, its param group's flags, a parameter not in any group); None when none applies.
    Lets a publisher decide before the first step which parameters it cannot reconstruct."""
    wrong = _type_gate(optimizer)
    if wrong is not None:
        return wrong
    for group in optimizer.param_groups:
        if any(p is param for p in group["params"]):
            return _group_gate(group)
    return Gate("not-a-parameter", "the tensor is not a parameter of the optimizer")


def _type_gate(optimizer: torch.optim.Optimizer) -> Gate | None:
    """The gate for an optimizer that is not ``AdamW`` or ``Adam`` (subclasses included: their
    step is not known), else None."""
    import torch

    if type(optimizer) in (torch.optim.AdamW, torch.optim.Adam):
        return None
    name = type(optimizer).__name__
    return Gate("optimizer", f"{name} is not torch.optim.AdamW: no inverse is known")


def _group_gate(group: dict[str, Any]) -> Gate | None:
    """A gate for a param group whose update is not plain decoupled AdamW, else None."""
    if group.get("weight_decay", 0) != 0 and not group.get("decoupled_weight_decay", False):
        return Gate("adam-l2", "Adam with L2 weight decay: the decay is inside the moments")
    flags: tuple[tuple[GateCode, str], ...] = (
        ("amsgrad", "the update uses max_exp_avg_sq"),
        ("maximize", "not covered (untested)"),
        ("capturable", "bias corrections on the device in another op order"),
        ("differentiable", "bias corrections from a float32 step tensor"),
    )
    for flag, why in flags:
        if group.get(flag, False):
            return Gate(flag, f"{flag}=True: {why}")
    return None
