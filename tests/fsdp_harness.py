"""FSDP2 / HSDP trainers for tests: a tiny language model sharded with ``fully_shard`` on a
CPU gloo mesh, trained with AdamW on seeded data, and the checks that compare what a
:class:`~deltastore.Subscriber` holds with the trainer's ``full_tensor()``.

Used by ``tests/test_module_writer_fsdp.py`` and by restart tests: build the model
(:func:`build_model`, the same initial weights on every rank from ``seed``), shard it
(:func:`shard_model`: per block and root ``fully_shard``, plus parameters sharded or replicated
by hand), step it (:func:`train_step`: a real forward/backward on rank-seeded tokens), publish
with ``ModuleWriter.step`` and check every version (:func:`publish_loop`). Processes are started
by :func:`spawn` (``torch.multiprocessing.spawn``, file rendezvous, gloo, one thread each); the
worker function must be a module-level function (it is pickled by name), it returns a
JSON-able dict that :func:`spawn` hands back per rank.

What the model holds (names as ``state_dict`` spells them):

- ``embed.weight`` (37 x 16: 37 rows divide by neither 2 nor 4, so ``Shard(0)`` shards are
  uneven), tied to ``head.weight`` (the same parameter: published once, as ``embed.weight``);
- ``blocks.<i>.{norm,up,down}.{weight,bias}``, one ``fully_shard`` per block (``up`` has 45
  rows, also uneven);
- ``scale`` (16): a plain ``nn.Parameter`` left out of FSDP (``ignored_params``), its gradient
  averaged by hand, as DDP would;
- ``side.mix`` (16 x 16): a DTensor with ``Replicate()`` on every mesh dimension (replicated
  by hand, left out of FSDP), gradient averaged by hand;
- ``side.proj`` (16 x 24): a DTensor sharded on dim 1 (``Shard(1)`` on the last mesh
  dimension, ``Replicate()`` on the others): not a row range, the writers redistribute it to
  dim-0 rows;
- buffers: ``pos`` (8 x 16, persistent, one row nudged per step), ``seen`` (0-dim, persistent,
  counts the steps), ``scratch`` (non-persistent: never published).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HIDDEN, PROJ, LAYERS = 37, 16, 45, 24, 2
SEQ, BATCH = 8, 4
#: Rendezvous and collective timeout: a lost rank fails the test instead of hanging it.
TIMEOUT = timedelta(seconds=120)
#: An integer dtype of each element size, for bit-wise comparisons.
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Block(nn.Module):
    """Pre-norm MLP residual block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class Side(nn.Module):
    """Parameters FSDP does not manage: replicated (``mix``) and dim-1 sharded (``proj``)."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.eye(DIM) + 0.05 * torch.randn(DIM, DIM, generator=g))
        self.proj = nn.Parameter(0.1 * torch.randn(DIM, PROJ, generator=g))


class TinyLM(nn.Module):
    """The model of the module docstring (a few thousand parameters)."""

    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.scale = nn.Parameter(torch.ones(DIM))
        self.side = Side(g)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("pos", 0.02 * torch.randn(SEQ, DIM, generator=g))
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("scratch", torch.zeros(DIM), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        h = (h * self.scale) @ _local(self.side.mix)
        wide = h @ _whole(self.side.proj)  # (..., PROJ): fold it back to DIM columns
        return self.head(h + 0.5 * (wide[..., :DIM] + wide[..., PROJ - DIM :]))

    def hand_managed(self) -> list[nn.Parameter]:
        """The parameters whose gradients :func:`train_step` averages by hand."""
        return [self.scale, self.side.mix]


def _local(p: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's local copy (a plain tensor as is); its gradient stays local."""
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def _whole(p: torch.Tensor) -> torch.Tensor:
    """A sharded DTensor gathered; the gradient is summed over every rank on the way back."""
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(p, DTensor):
        return p
    return p.full_tensor(grad_placements=[Partial()] * p.device_mesh.ndim)


def build_model(seed: int = 0) -> TinyLM:
    """The model with the same initial weights on every rank (plain tensors, not sharded)."""
    torch.manual_seed(seed)  # nn.Linear / nn.Embedding / LayerNorm initializers
    return TinyLM(torch.Generator().manual_seed(seed + 1))


def make_mesh(shape: tuple[int, ...]) -> Any:
    """A CPU device mesh: ``(world,)`` for FSDP2, ``(replicas, shards)`` (dims named
    ``replicate``, ``shard``) for HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    if len(shape) == 1:
        return init_device_mesh("cpu", shape)
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def shard_model(model: TinyLM, mesh: Any) -> TinyLM:
    """Shard ``model`` in place: ``side.mix`` replicated and ``side.proj`` dim-1 sharded by
    hand (``distribute_tensor``), ``fully_shard`` per block and on the root (the root takes
    the tied embedding), ``scale`` and ``side`` left out."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    others = [Replicate()] * (mesh.ndim - 1)
    side = model.side
    side.mix = nn.Parameter(distribute_tensor(side.mix.data, mesh, [Replicate(), *others]))
    side.proj = nn.Parameter(distribute_tensor(side.proj.data, mesh, [*others, Shard(1)]))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params={model.scale, side.mix, side.proj})
    return model


def make_optimizer(model: nn.Module, lr: float = 1e-2) -> torch.optim.AdamW:
    """Decoupled AdamW (foreach): DTensor and plain parameters in separate param groups
    (torch's foreach kernels refuse a mix of both)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if isinstance(p, DTensor)]},
        {"params": [p for p in params if not isinstance(p, DTensor)]},
    ]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.1, foreach=True)


def batch(step: int, rank: int, seed: int = 0) -> torch.Tensor:
    """Tokens ``(BATCH, SEQ + 1)`` of ``rank`` at ``step`` (each data-parallel rank its own)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def train_step(model: TinyLM, opt: torch.optim.Optimizer, step: int, seed: int = 0) -> float:
    """One optimizer step of every rank (collective): forward/backward on :func:`batch`,
    hand-managed gradients averaged over the world, AdamW, then the buffers move (``seen``
    +1, one row of ``pos`` nudged). Returns this rank's loss."""
    tokens = batch(step, dist.get_rank(), seed)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    with torch.no_grad():
        for p in model.hand_managed():
            assert p.grad is not None
            g = _local(p.grad)
            dist.all_reduce(g)
            g.div_(dist.get_world_size())
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        model.seen += 1
        model.pos[step % SEQ] += 1e-3
    return float(loss.detach())


def expected_names(model: nn.Module) -> list[str]:
    """What a module writer publishes, from torch alone: ``named_parameters()`` (a tied
    parameter once, under its first name) and the persistent buffers."""
    persistent = set(model.state_dict())
    buffers = [n for n, _ in model.named_buffers() if n in persistent]
    return [n for n, _ in model.named_parameters()] + buffers


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every published tensor whole (``full_tensor()`` of a DTensor: a collective, every rank
    calls it), detached copies, by :func:`expected_names`."""
    from torch.distributed.tensor import DTensor

    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    out = {}
    for name in expected_names(model):
        t = tensors[name].detach()
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).clone()
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s words as integers of its element size (bit-wise comparison)."""
    return t.detach().contiguous().view(_INT[t.element_size()])


def mismatches(
    got: Mapping[str, torch.Tensor],
    want: Mapping[str, torch.Tensor],
    cast: Callable[[str, torch.Tensor], torch.dtype] | None = None,
) -> list[str]:
    """Why ``got`` is not bit for bit ``want`` (empty: it is). ``cast(name, tensor)``: the
    dtype each ``want`` tensor is published as (default: its own)."""
    out = [f"{n}: missing" for n in want if n not in got]
    out += [f"{n}: not expected" for n in got if n not in want]
    for name, w in want.items():
        g = got.get(name)
        if g is None:
            continue
        w = w.to(cast(name, w)) if cast is not None else w
        if g.dtype != w.dtype or tuple(g.shape) != tuple(w.shape):
            out.append(f"{name}: {g.dtype} {tuple(g.shape)}, want {w.dtype} {tuple(w.shape)}")
        elif not torch.equal(bits(g), bits(w)):
            diff = int((bits(g) != bits(w)).sum())
            out.append(f"{name}: {diff} of {w.numel()} words differ")
    return out


def layout(model: nn.Module) -> dict[str, Any]:
    """How this rank holds each parameter: ``{name: {"placements": [...] (repr, empty for a
    plain tensor), "local": local shape}}``, and ``coordinate``: this rank's mesh coordinate
    (of the first DTensor; None without one)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {"coordinate": None, "params": {}}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            out["params"][name] = {
                "placements": [repr(x) for x in p.placements],
                "local": list(p.to_local().shape),
            }
            if out["coordinate"] is None:
                out["coordinate"] = p.device_mesh.get_coordinate()
        else:
            out["params"][name] = {"placements": [], "local": list(p.shape)}
    return out


def save(cfg: Mapping[str, Any], name: str, rank: int, record: Mapping[str, Any]) -> None:
    """Write one scenario's record of ``rank`` to ``cfg["dir"]/<name>-rank<rank>.json`` (a
    worker running several scenarios keeps those done when a later one fails)."""
    Path(cfg["dir"], f"{name}-rank{rank}.json").write_text(json.dumps(record))


def load(cfg: Mapping[str, Any], name: str, world: int) -> list[dict[str, Any]] | None:
    """Every rank's record of scenario ``name`` (:func:`save`); None when one is missing."""
    paths = [Path(cfg["dir"], f"{name}-rank{r}.json") for r in range(world)]
    if not all(p.is_file() for p in paths):
        return None
    return [json.loads(p.read_text()) for p in paths]


def slice_record(writer: Any, truth: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """This rank's ``writer.slices()`` (collective) as ``{name: [row_start, rows]}``, and the
    slices whose rows are not those rows of ``truth`` (bit-wise, the slice's dtype): the
    offsets come from the writer, the check from the full tensor."""
    rows: dict[str, list[int]] = {}
    wrong: list[str] = []
    for name, s in writer.slices().items():
        local = s.tensor.detach()
        n = local.shape[0] if local.dim() else 1
        rows[name] = [int(s.row_start), int(n)]
        want = truth[name]
        want = want[s.row_start : s.row_start + n] if want.dim() else want
        if list(s.global_shape) != list(truth[name].shape) or not torch.equal(
            bits(local), bits(want.to(local.dtype))
        ):
            wrong.append(name)
    return {"rows": rows, "wrong": wrong}


def publish_loop(
    writer: Any,
    model: TinyLM,
    opt: torch.optim.Optimizer,
    url: str,
    *,
    steps: int,
    first_step: int = 0,
    cast: Callable[[str, torch.Tensor], torch.dtype] | None = None,
    seed: int = 0,
    explicit: bool = False,
) -> dict[str, Any]:
    """Publish the model as it is, then ``steps`` times train one step and publish, each with
    ``writer.step()`` (``explicit``: after the first, ``writer.step(writer.version + 1)``);
    after each version a Subscriber on rank 0 syncs it and compares it with
    :func:`full_state` (cast by ``cast``), then a fresh Subscriber reads the last one. Step
    ``i`` trains on the tokens of step ``first_step + i`` (:func:`batch`, ``seed``).

    Returns this rank's record: ``versions`` (one dict per version: ``version``, ``held``
    (``writer.version`` after the step), ``kind``, ``changed``, ``total``, ``frames``,
    ``payload``, ``raw`` (snapshot-free raw blocks, None in a snapshot mode), ``step_s``
    (wall seconds of ``writer.step()``), rank 0 also ``mismatch`` and ``names`` (the
    manifest's)), ``slices`` (first and last version's :func:`slice_record`), ``fresh``
    (rank 0: the fresh subscriber's version and mismatches), ``run``, ``rank``, ``world``,
    ``names`` (:func:`expected_names`), ``shapes`` (global), ``layout`` (:func:`layout`),
    ``losses``.
    """
    from deltastore import Subscriber

    rank = dist.get_rank()
    sub = Subscriber(url) if rank == 0 else None
    out: dict[str, Any] = {"versions": [], "slices": [], "losses": []}
    out.update(run=writer.run, rank=writer.rank, world=writer.world, names=expected_names(model))
    out["layout"] = layout(model)
    truth: dict[str, torch.Tensor] = {}
    for i in range(steps + 1):
        if i:
            out["losses"].append(train_step(model, opt, first_step + i, seed))
        t0 = time.perf_counter()
        held = writer.version
        report = writer.step(held + 1) if explicit and held is not None else writer.step()
        step_s = time.perf_counter() - t0
        truth = full_state(model)  # collective: every rank
        sf = report.snapshot_free
        rec: dict[str, Any] = {
            "version": report.version,
            "held": writer.version,
            "kind": report.kind,
            "changed": report.changed_elements,
            "total": report.total_elements,
            "frames": report.frames,
            "payload": report.payload_bytes,
            "raw": None if sf is None else sf.blocks_raw,
            "step_s": round(step_s, 4),
        }
        if i in (0, steps):
            out["slices"].append(slice_record(writer, truth))
        if sub is not None:
            sub.sync(version=report.version)
            assert sub.tensors is not None
            rec["mismatch"] = mismatches(sub.tensors, truth, cast)
            rec["names"] = sorted(sub.manifest(report.version).tensors)
        out["versions"].append(rec)
    out["shapes"] = {n: list(t.shape) for n, t in truth.items()}
    if sub is not None:
        fresh = Subscriber(url)
        fresh.sync()
        assert fresh.tensors is not None
        out["fresh"] = {
            "version": fresh.version,
            "mismatch": mismatches(fresh.tensors, truth, cast),
        }
    return out


def spawn(
    fn: Callable[[int, int, dict[str, Any]], dict[str, Any]], world: int, cfg: dict[str, Any]
) -> list[dict[str, Any]]:
    """Run ``fn(rank, world, cfg)`` in ``world`` fresh processes joined in one gloo process
    group (``cfg["dir"]``: a folder for the rendezvous file and the results); returns each
    rank's result. A rank that raises writes ``{"error": traceback}`` first, then
    ``torch.multiprocessing.spawn`` raises in the caller."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the children's: one thread each
    try:
        mp.spawn(_entry, args=(fn, world, cfg), nprocs=world, join=True)
    finally:
        if before is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = before
    return [json.loads(Path(cfg["dir"], f"rank{r}.json").read_text()) for r in range(world)]


def _entry(
    rank: int,
    fn: Callable[[int, int, dict[str, Any]], dict[str, Any]],
    world: int,
    cfg: dict[str, Any],
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{cfg['dir']}/init",
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )
    result = Path(cfg["dir"], f"rank{rank}.json")
    try:
        result.write_text(json.dumps(fn(rank, world, cfg)))
    except BaseException:
        result.write_text(json.dumps({"error": traceback.format_exc()}))
        raise
    finally:
        dist.destroy_process_group()
