"""``deltastore bench --mode trainer``: real AdamW steps with a publish after each, per publisher.

The trainer is the bench's model (:data:`~deltastore.testing.sizes.SIZES`) as fp32
``torch.nn.Parameter`` s (matrices and embeddings normal(0, 0.02), norms 1.0, biases 0) with a
``torch.optim.AdamW``; each step's gradients are seeded normal(0, 1) (the bench's workload uses
the same, :mod:`deltastore.testing.synthetic`), drawn untimed before the step. Per publisher
(``none``: ``Publisher(url, snapshot="none", optimizer=opt)``; ``memory``: today's memory
snapshot, fed bf16 casts of the masters in staging tensors it owns) one process of its own
(:func:`run_child`) builds the trainer, runs ``warmup`` steps, takes the trainer's resident
memory as the baseline, builds the publisher, publishes the anchor (version 0, untimed), then
for each measured version: gradients (untimed), ``opt.step()`` (timed, peak RSS), publish
(timed, peak RSS over the baseline: :class:`~deltastore.bench.ops.RssMeter` with a fixed
baseline, VmHWM reset on entry), and untimed: the read floor (a sum over every weight and both
moments), the inverse alone over every parameter (snapshot-free run), the version's digest.
The bench process then follows each store with a :class:`~deltastore.Subscriber` and checks
every version's digest (bit-exact receivers), compares the runs' digests (the same versions)
and checks the bar.

Not thread-safe (each child owns its trainer); the bench process holds no model while the
children run.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deltastore.bench.analysis import _check
from deltastore.bench.ops import (
    RssMeter,
    digest,
    load_average,
    memory_bytes,
    rss_bytes,
    stderr_log,
)
from deltastore.bench.schema import BarCheck
from deltastore.bench.trainer_ops import (
    kernel_time,
    load_code,
    publish_passes,
    read_floor,
    version_digest,
)
from deltastore.bench.trainer_schema import (
    PUBLISHERS,
    PublisherName,
    PublisherRun,
    TrainerMedians,
    TrainerResult,
    TrainerSample,
)
from deltastore.testing.sizes import SIZES

Log = Callable[[str], None]

#: Resident bytes per element of a trainer at its peak: fp32 master, gradient, exp_avg,
#: exp_avg_sq (16) and the foreach step's temporaries (one fp32 list: 4); plus the memory
#: publisher's bf16 staging and snapshot (4) in its run.
TRAINER_BYTES_PER_ELEMENT = 20
MEMORY_PUBLISHER_BYTES_PER_ELEMENT = 4
#: Share of the machine's memory a run may plan for (other processes share the machine).
MEMORY_SHARE = 0.6
#: The bar: snapshot-free publish / optimizer.step(), extra RSS, payload vs the snapshot.
RATIO_MAX = 0.6
RSS_SHARE_MAX = 0.02
RSS_FLOOR_BYTES = 64 << 20
PAYLOAD_RATIO_MAX = 1.02

#: The allocator setting of the ``none-live`` run: every buffer of 1 MiB or more is a mapping
#: of its own, returned when freed (glibc otherwise raises this threshold to 32 MiB as large
#: buffers are freed, and each thread's arena keeps what the thread freed).
LIVE_ENV = (("MALLOC_MMAP_THRESHOLD_", "1048576"),)

RSS_METHOD = (
    "per publisher a process of its own; baseline: the trainer's VmRSS after its warm-up "
    "steps, before the publisher (and its staging) existed; per publish: peak of VmHWM (reset "
    "through /proc/self/clear_refs on entry) and VmRSS sampled every 50 ms, minus the baseline"
)


@dataclass
class TrainerOptions:
    """What :func:`run_trainer` runs. ``size``: a size of the bench's table or ``"auto"``
    (the largest whose trainer fits in :data:`MEMORY_SHARE` of the machine's memory);
    ``optimizer``: ``foreach``, ``fused`` or ``single-tensor``; ``threads``: torch intra-op
    threads; ``workdir``: where the local stores go (default: a temporary folder)."""

    size: str = "auto"
    versions: int = 5
    warmup: int = 2
    lr: float = 1e-6
    weight_decay: float = 0.1
    seed: int = 0
    optimizer: str = "foreach"
    threads: int = 2
    publishers: Sequence[str] = PUBLISHERS
    workdir: str | os.PathLike[str] | None = None
    verify: bool = True
    #: Also run the snapshot-free trainer with :data:`LIVE_ENV` (``runs["none-live"]``): the
    #: publisher's live peak, without what the allocator keeps of freed buffers.
    live_rss: bool = True
    #: Run each publisher's trainer in this process (tests: no process start-up; the RSS
    #: numbers then include whatever this process holds).
    in_process: bool = False
    log: Log = field(default=stderr_log, repr=False)


def choose_size(size: str, memory: int) -> tuple[str, str]:
    """The size to train and why (a sentence for the JSON and the docs)."""
    need = {
        name: (TRAINER_BYTES_PER_ELEMENT + MEMORY_PUBLISHER_BYTES_PER_ELEMENT) * c.numel()
        for name, c in SIZES.items()
    }
    budget = MEMORY_SHARE * memory
    per = TRAINER_BYTES_PER_ELEMENT + MEMORY_PUBLISHER_BYTES_PER_ELEMENT
    rule = (
        f"a trainer needs ~{per} B per element at its peak (fp32 master, gradient, two moments, "
        "the foreach step's temporaries, the memory publisher's staging and snapshot)"
    )
    if size != "auto":
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}; choose auto or one of {list(SIZES)}")
        return size, f"asked for; {rule}: {need[size] / 1e9:.1f} GB"
    fits = [n for n in SIZES if need[n] <= budget]
    chosen = fits[-1] if fits else "tiny"
    names = list(SIZES)
    larger = names[names.index(chosen) + 1 :]
    why = f"{rule}: {chosen} needs {need[chosen] / 1e9:.1f} GB"
    if larger:
        why += (
            f", {larger[0]} {need[larger[0]] / 1e9:.1f} GB, over {MEMORY_SHARE:.0%} of this "
            f"machine's {memory / 1e9:.1f} GB (shared with the test suite and the subscriber)"
        )
    return chosen, why


# --- the child: one trainer, one publisher -----------------------------------------------


@dataclass(frozen=True)
class ChildTask:
    publisher: PublisherName
    size: str
    url: str
    versions: int
    warmup: int
    lr: float
    weight_decay: float
    seed: int
    optimizer: str
    threads: int
    passes: bool = True
    #: Environment variables of the child (e.g. the allocator's), set before it starts.
    env: tuple[tuple[str, str], ...] = ()


def build_params(size: str, seed: int) -> dict[str, torch.nn.Parameter]:
    """The bench model's tensors as fp32 parameters (norms 1.0, biases 0, others
    normal(0, 0.02)), seeded."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.nn.Parameter] = {}
    for name, shape in SIZES[size].shapes().items():
        t = torch.empty(shape, dtype=torch.float32)
        if "norm" in name:
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.zero_()
        else:
            t.normal_(0.0, 0.02, generator=gen)
        out[name] = torch.nn.Parameter(t)
    return out


def make_optimizer(params: Sequence[torch.Tensor], task: ChildTask) -> torch.optim.AdamW:
    kinds = {"foreach": {"foreach": True}, "fused": {"fused": True}, "single-tensor": {}}
    if task.optimizer not in kinds:
        raise ValueError(f"optimizer must be one of {list(kinds)}, not {task.optimizer!r}")
    extra: dict[str, Any] = dict(kinds[task.optimizer])
    if task.optimizer == "single-tensor":
        extra = {"foreach": False}
    return torch.optim.AdamW(params, lr=task.lr, weight_decay=task.weight_decay, **extra)


def fill_grads(params: dict[str, torch.nn.Parameter], seed: int, step: int) -> None:
    """Seeded normal(0, 1) gradients for ``step``, into reused buffers."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    for p in params.values():
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.normal_(generator=gen)


class _Memory:
    """The memory snapshot publisher, fed bf16 casts in staging tensors it owns."""

    method = "Publisher(snapshot='memory') of bf16 staging casts"

    def __init__(self, url: str, params: dict[str, torch.nn.Parameter]) -> None:
        from deltastore.publish.publisher import Publisher

        self.params = params
        self.staging = {n: torch.empty_like(p, dtype=torch.bfloat16) for n, p in params.items()}
        self.pub = Publisher(url)

    def publish(self, version: int) -> tuple[Any, float]:
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, p in self.params.items():
                self.staging[name].copy_(p)
        cast = time.perf_counter() - t0
        return self.pub.publish(self.staging, version=version), cast


class _None:
    """The snapshot-free publisher, fed the fp32 parameters."""

    method = "Publisher(snapshot='none', optimizer=opt) of the fp32 masters"

    def __init__(self, url: str, params: dict[str, torch.nn.Parameter], opt: Any) -> None:
        from deltastore.publish.publisher import Publisher

        self.params = params
        self.pub = Publisher(url, snapshot="none", optimizer=opt)

    def publish(self, version: int) -> tuple[Any, None]:
        return self.pub.publish(dict(self.params), version=version), None


def _sample(
    version: int, step: tuple[float, int], publish: tuple[float, int], rep: Any, **kw: Any
) -> TrainerSample:
    stats = getattr(rep, "snapshot_free", None)
    return TrainerSample(
        version=version,
        step_s=step[0],
        publish_s=publish[0],
        ratio=publish[0] / step[0],
        payload_bytes=rep.payload_bytes,
        changed_elements=rep.changed_elements,
        rss_extra_bytes=publish[1],
        step_rss_extra_bytes=step[1],
        uncertain=None if stats is None else stats.uncertain,
        blocks_verified=None if stats is None else stats.blocks_verified,
        blocks_raw=None if stats is None else stats.blocks_raw,
        snapshots=None if stats is None else len(stats.snapshots),
        anchor_reason=rep.anchor_reason,
        **kw,
    )


def run_child(task: ChildTask) -> PublisherRun:
    """One publisher's run (see the module docstring); in a process of its own."""
    allocator = " ".join(f"{k}={v}" for k, v in task.env) or "glibc default"
    torch.set_num_threads(task.threads)
    params = build_params(task.size, task.seed)
    opt = make_optimizer(list(params.values()), task)
    inverter = None
    if task.publisher == "none":
        from deltastore.publish.reconstruct import AdamWInverter

        inverter = AdamWInverter(opt)  # the kernel timing's own hook, before any step
        opt._deltastore_bench_inverter = inverter  # type: ignore[attr-defined]
    for step in range(task.warmup):
        fill_grads(params, task.seed, step)
        opt.step()
    before = rss_bytes()
    load_code(task.publisher)
    baseline = rss_bytes()
    sender: _Memory | _None
    try:
        sender = (
            _None(task.url, params, opt) if task.publisher == "none" else _Memory(task.url, params)
        )
    except (TypeError, ValueError) as exc:  # snapshot="none" not built yet
        method = "Publisher(snapshot='none', optimizer=opt)"
        return PublisherRun(
            publisher=task.publisher, method=method, available=False, error=str(exc),
            allocator=allocator, baseline_rss_bytes=baseline, code_rss_bytes=baseline - before,
            setup_s=0.0,
            samples=[], median=None, exact=None,
        )  # fmt: skip
    t0 = time.perf_counter()
    sender.publish(0)
    setup = time.perf_counter() - t0
    if inverter is not None:
        inverter.mark()
    samples = []
    for version in range(1, task.versions + 1):
        fill_grads(params, task.seed, task.warmup + version)
        with RssMeter(0.05, baseline) as step_meter:
            t0 = time.perf_counter()
            opt.step()
            step_s = time.perf_counter() - t0
        with RssMeter(0.05, baseline) as meter:
            t0 = time.perf_counter()
            rep, cast = sender.publish(version)
            publish_s = time.perf_counter() - t0
        kernel = kernel_time(inverter, params) if inverter is not None else None
        passes = publish_passes(opt, params) if inverter is not None and task.passes else {}
        if inverter is not None:
            inverter.mark()
        samples.append(
            _sample(
                version,
                (step_s, step_meter.extra_bytes),
                (publish_s, meter.extra_bytes),
                rep,
                cast_s=cast,
                floor_s=read_floor(opt, params),
                kernel_s=kernel,
                passes_s=passes,
                digest=version_digest(params),
            )
        )
    return PublisherRun(
        publisher=task.publisher,
        method=sender.method,
        available=True,
        error=None,
        allocator=allocator,
        baseline_rss_bytes=baseline,
        code_rss_bytes=baseline - before,
        setup_s=setup,
        samples=samples,
        median=medians(samples),
        exact=None,
    )


def medians(samples: Sequence[TrainerSample]) -> TrainerMedians:
    def med(xs: list[float]) -> float:
        return float(statistics.median(xs))

    kernels = [s.kernel_s for s in samples if s.kernel_s is not None]
    return TrainerMedians(
        step_s=med([s.step_s for s in samples]),
        publish_s=med([s.publish_s for s in samples]),
        ratio=med([s.ratio for s in samples]),
        step_min_s=min(s.step_s for s in samples),
        publish_min_s=min(s.publish_s for s in samples),
        min_ratio=min(s.publish_s for s in samples) / min(s.step_s for s in samples),
        payload_bytes=med([s.payload_bytes for s in samples]),
        floor_s=med([s.floor_s for s in samples]),
        kernel_s=med(kernels) if len(kernels) == len(samples) else None,
        rss_extra_max_bytes=max(s.rss_extra_bytes for s in samples),
        step_rss_extra_max_bytes=max(s.step_rss_extra_bytes for s in samples),
    )


def _entry(task: ChildTask, conn: Any) -> None:
    try:
        result: object = ("ok", run_child(task))
    except BaseException as exc:  # reported to the parent, which raises
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    conn.send(result)
    conn.close()


def spawn_child(task: ChildTask) -> PublisherRun:
    """:func:`run_child` in a fresh process (spawn: nothing of this process is shared)."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_entry, args=(task, send), name=f"bench-trainer-{task.publisher}")
    saved = {k: os.environ.get(k) for k, _ in task.env}
    os.environ.update(dict(task.env))  # the child's C library reads them as it starts
    try:
        proc.start()
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old
    send.close()
    try:
        status, payload = recv.recv()
    except EOFError:
        proc.join()
        raise RuntimeError(
            f"the {task.publisher} trainer died (exit code {proc.exitcode}; out of memory? "
            "try a smaller --size)"
        ) from None
    finally:
        recv.close()
    proc.join()
    if status != "ok":
        raise RuntimeError(f"the {task.publisher} trainer failed: {payload}")
    assert isinstance(payload, PublisherRun)
    return payload


# --- the bench process ----------------------------------------------------------------------


def follow(url: str, size: str, digests: Sequence[str]) -> bool:
    """A subscriber bootstraps from the anchor and syncs each version in turn: bit-exact at
    every one (its words hash to the trainer's digest)."""
    from deltastore.sync.subscriber import Subscriber

    names = list(SIZES[size].shapes())
    sub: Subscriber[Any] = Subscriber(url, lease_ttl=None)
    try:
        sub.sync(0)
        for version, want in enumerate(digests, start=1):
            sub.sync(version)
            tensors = sub.tensors
            assert tensors is not None
            got = digest(tensors[n].reshape(-1).view(torch.int16).numpy() for n in names)
            if got != want:
                return False
    finally:
        sub.close()
    return True


def bar_checks(
    runs: dict[str, PublisherRun], bf16_bytes: int, payload: float | None
) -> list[BarCheck]:
    """The trainer bar: publish / step, extra RSS and payload of the snapshot-free run."""
    none = runs.get("none")
    med = none.median if none is not None else None
    rss_limit = max(RSS_SHARE_MAX * bf16_bytes, RSS_FLOOR_BYTES)
    return [
        _check(
            "snapshot-free publish / optimizer.step()",
            None,
            None if med is None else med.min_ratio,
            "<=",
            RATIO_MAX,
            "fastest publish / fastest step of the run, one process (other load only adds "
            "time; the median of the per-version ratios is in the report)",
        ),
        _check(
            "snapshot-free extra peak RSS (bytes)",
            None,
            None if med is None else float(med.rss_extra_max_bytes),
            "<=",
            float(rss_limit),
            f"largest peak RSS over the trainer alone; bar max({RSS_SHARE_MAX:.0%} of the "
            f"model's bf16 bytes, {RSS_FLOOR_BYTES >> 20} MiB)",
        ),
        _check(
            "snapshot-free payload / memory snapshot payload",
            None,
            payload,
            "<=",
            PAYLOAD_RATIO_MAX,
            "median over versions, the same versions",
        ),
    ]


def run_trainer(options: TrainerOptions) -> TrainerResult:
    """Run the trainer-in-the-loop bench (see the module docstring)."""
    from deltastore.bench.runner import run_header

    t_start = time.perf_counter()
    load_start = load_average()
    log = options.log
    unknown = set(options.publishers) - set(PUBLISHERS)
    if unknown or not options.publishers:
        raise ValueError(f"publishers must be some of {list(PUBLISHERS)}, not {unknown or '[]'}")
    size, why = choose_size(options.size, memory_bytes())
    config = SIZES[size]
    numel = config.numel()
    log(f"trainer bench: {size} ({numel / 1e6:.0f}M elements): {why}")
    root = tempfile.mkdtemp(prefix="deltastore-trainer-", dir=options.workdir)
    runs: dict[str, PublisherRun] = {}
    plan: list[tuple[str, PublisherName, tuple[tuple[str, str], ...]]] = [
        (p, p, ()) for p in PUBLISHERS if p in options.publishers
    ]
    if options.live_rss and "none" in options.publishers and not options.in_process:
        plan.append(("none-live", "none", LIVE_ENV))
    try:
        for key, name, env in plan:
            task = ChildTask(
                publisher=name,
                size=size,
                url=os.path.join(root, key),
                versions=options.versions,
                warmup=options.warmup,
                lr=options.lr,
                weight_decay=options.weight_decay,
                seed=options.seed,
                optimizer=options.optimizer,
                threads=options.threads,
                passes=key == "none",
                env=env,
            )
            run = run_child(task) if options.in_process else spawn_child(task)
            if run.available and options.verify:
                exact = follow(task.url, size, [s.digest for s in run.samples])
                run = run.model_copy(update={"exact": exact})
            runs[key] = run
            _log_run(log, run)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    done = [r for r in runs.values() if r.available]
    digests = {tuple(s.digest for s in r.samples) for r in done}
    ratios = []
    if "none" in runs and "memory" in runs and runs["none"].available and runs["memory"].available:
        ratios = [
            a.payload_bytes / b.payload_bytes
            for a, b in zip(runs["none"].samples, runs["memory"].samples, strict=True)
            if b.payload_bytes
        ]
    payload = float(statistics.median(ratios)) if ratios else None
    return TrainerResult(
        **dict(run_header()),
        size=size,
        size_reason=why,
        elements=numel,
        tensors=len(config.shapes()),
        bf16_bytes=2 * numel,
        trainer_state_bytes=16 * numel,
        optimizer=options.optimizer,
        threads=options.threads,
        lr=options.lr,
        weight_decay=options.weight_decay,
        seed=options.seed,
        warmup=options.warmup,
        versions=options.versions,
        runs=runs,
        payload_ratio=payload,
        same_versions=len(digests) <= 1,
        rss_method=RSS_METHOD,
        load_average=[load_start, load_average()],
        bars=bar_checks(runs, 2 * numel, payload),
        exact=all(r.exact is not False for r in done) and len(digests) <= 1,
        wall_s=time.perf_counter() - t_start,
    )


def _log_run(log: Log, run: PublisherRun) -> None:
    if not run.available:
        log(f"  {run.publisher}: not available ({run.error})")
        return
    m = run.median
    assert m is not None
    log(
        f"  {run.publisher}: step {m.step_s:.3f} s, publish {m.publish_s:.3f} s "
        f"(ratio {m.ratio:.2f}), floor {m.floor_s:.3f} s"
        + (f", kernel {m.kernel_s:.3f} s" if m.kernel_s is not None else "")
        + f", payload {m.payload_bytes / 1e6:.2f} MB, extra RSS "
        f"{m.rss_extra_max_bytes / 2**20:.0f} MiB, exact {run.exact}"
    )
