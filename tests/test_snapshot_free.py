"""The snapshot-free publisher (``snapshot="none"``): exact receivers without a copy of the
model, its gates and fallbacks, digests that catch a wrong reconstruction.

Small models, a few dozen AdamW steps each; every published version is compared bit-wise
(int16 views) with torch's bf16 cast of the trainer's parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from deltastore import Publisher, Subscriber  # noqa: E402
from deltastore.errors import StoreError  # noqa: E402
from deltastore.publish.digests import BLOCK  # noqa: E402

nn = torch.nn


class Net(nn.Module):  # type: ignore[misc]
    """Embedding, LayerNorm (weights 1), two Linear layers with zero biases, a buffer."""

    def __init__(self, vocab: int = 64, dim: int = 48, hidden: int = 96) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, vocab)
        for lin in (self.up, self.down):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        self.register_buffer("scale", torch.ones(vocab))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(tokens[:, :-1]).float())
        logits = self.down(torch.nn.functional.gelu(self.up(h))) * self.scale
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def batch(step: int, vocab: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (8, 17), generator=g)


def train_step(net: Net, opt: torch.optim.Optimizer, step: int) -> None:
    opt.zero_grad()
    net.loss(batch(step)).backward()
    opt.step()


def expected(
    tensors: dict[str, torch.Tensor], as_is: frozenset[str] = frozenset()
) -> dict[str, np.ndarray]:
    """What a receiver must hold: torch's bf16 cast of float32 tensors (but those named in
    ``as_is``: not parameters), others as they are."""
    out = {}
    for name, t in tensors.items():
        t = t.detach()
        if t.dtype == torch.float32 and name not in as_is:
            t = t.to(torch.bfloat16)
        out[name] = t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)
    return {n: t.numpy().copy() for n, t in out.items()}


def assert_exact(
    sub: Subscriber,
    tensors: dict[str, torch.Tensor],
    version: int,
    as_is: frozenset[str] = frozenset(),
) -> None:
    sub.sync()
    assert sub.version == version
    held = sub.tensors
    assert held is not None
    for name, want in expected(tensors, as_is).items():
        got = held[name].contiguous()
        got = got.view(torch.int16 if got.element_size() == 2 else torch.int32).numpy()
        assert np.array_equal(got, want), f"{name} differs at version {version}"


def setup(
    tmp_path: Path, make_opt: Callable[[Any], torch.optim.Optimizer] | None = None, **options: Any
) -> tuple[Net, torch.optim.Optimizer, Publisher, Subscriber]:
    torch.manual_seed(0)
    net = Net()
    opt = (
        make_opt(net.parameters())
        if make_opt is not None
        else torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)
    )
    options.setdefault("max_frame_bytes", 8192)  # several frames and blocks per tensor
    pub = Publisher(tmp_path, snapshot="none", optimizer=opt, **options)
    return net, opt, pub, Subscriber(tmp_path)


def published(net: Net) -> dict[str, torch.Tensor]:
    return dict(net.named_parameters())


def test_bit_exact_foreach_adamw(tmp_path: Path) -> None:
    net, opt, pub, sub = setup(tmp_path)
    first = pub.publish(published(net), version=1)
    assert first.kind == "anchor" and first.snapshot_free is not None
    assert first.snapshot_free.reconstructed == 0
    assert_exact(sub, published(net), 1)
    uncertain = 0
    for v in range(2, 26):
        train_step(net, opt, v)
        report = pub.publish(published(net), version=v)
        stats = report.snapshot_free
        assert report.kind == "delta" and stats is not None
        assert stats.blocks_raw == 0 and not stats.absolute and not stats.snapshots
        assert stats.reconstructed == len(published(net))
        assert stats.blocks_verified > 0
        uncertain += stats.uncertain
        assert_exact(sub, published(net), v)
    assert uncertain > 0  # the zero biases of the first step at least


def test_no_copy_of_reconstructed_tensors(tmp_path: Path) -> None:
    net, opt, pub, _ = setup(tmp_path)
    pub.publish(published(net), version=1)
    train_step(net, opt, 2)
    pub.publish(published(net), version=2)
    held = pub._held.tensors
    assert held is not None
    assert all(s.words.size == 0 for s in held.values())
    digests = pub._snapfree.digests  # type: ignore[union-attr]
    total = sum(p.numel() for p in net.parameters())
    assert sum(d.nbytes for d in digests.values()) <= total * 2 / BLOCK * 4 + 8 * len(digests)


def test_v1_codecs_and_missing_optimizer_refused(tmp_path: Path) -> None:
    net = Net()
    opt = torch.optim.AdamW(net.parameters())
    with pytest.raises(ValueError, match="xor-patch"):
        Publisher(tmp_path, snapshot="none", optimizer=opt, codecs="v1")
    with pytest.raises(ValueError, match="optimizer="):
        Publisher(tmp_path, snapshot="none")
    with pytest.raises(ValueError, match="snapshot='none'"):
        Publisher(tmp_path, optimizer=opt)


@pytest.mark.parametrize("impl", [{"foreach": False}, {"fused": True}])
def test_bit_exact_single_tensor_and_fused(tmp_path: Path, impl: dict[str, bool]) -> None:
    net, opt, pub, sub = setup(
        tmp_path, lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, **impl)
    )
    pub.publish(published(net), version=1)
    for v in range(2, 10):
        train_step(net, opt, v)
        stats = pub.publish(published(net), version=v).snapshot_free
        assert stats is not None and stats.blocks_raw == 0 and not stats.absolute
        assert_exact(sub, published(net), v)


def test_a_wrong_lr_costs_raw_blocks_not_exactness(tmp_path: Path) -> None:
    net, opt, pub, sub = setup(tmp_path)
    pub.publish(published(net), version=1)
    inverter = pub._snapfree.inverter  # type: ignore[union-attr]
    raw = 0
    for v in range(2, 8):
        train_step(net, opt, v)
        if v in (4, 6):  # the inverse is fed twice the lr the step used
            calls = inverter._calls
            calls[-1] = [(lr * 2, b, eps, wd) for lr, b, eps, wd in calls[-1]]
        stats = pub.publish(published(net), version=v).snapshot_free
        assert stats is not None
        if v in (4, 6):
            assert stats.blocks_raw > 0
        else:
            assert stats.blocks_raw == 0
        raw += stats.blocks_raw
        assert_exact(sub, published(net), v)
    assert raw > 0


def test_publishing_every_two_steps_is_an_anchor(tmp_path: Path) -> None:
    net, opt, pub, sub = setup(tmp_path)
    pub.publish(published(net), version=1)
    for v in range(2, 6):
        train_step(net, opt, 2 * v)
        train_step(net, opt, 2 * v + 1)
        report = pub.publish(published(net), version=v)
        stats = report.snapshot_free
        assert report.kind == "anchor" and stats is not None
        assert stats.anchor_reason is not None and "steps" in stats.anchor_reason
        assert report.anchor_reason == stats.anchor_reason
        assert_exact(sub, published(net), v)
    train_step(net, opt, 99)  # one step again: deltas again
    assert pub.publish(published(net), version=9).kind == "delta"
    assert_exact(sub, published(net), 9)


def test_a_skipped_step_is_an_empty_verified_delta(tmp_path: Path) -> None:
    net, opt, pub, sub = setup(tmp_path)
    pub.publish(published(net), version=1)
    train_step(net, opt, 2)
    pub.publish(published(net), version=2)
    opt.zero_grad()  # GradScaler found inf: optimizer.step() is not called
    report = pub.publish(published(net), version=3)
    stats = report.snapshot_free
    assert report.kind == "delta" and report.changed_elements == 0 and report.frames == 0
    assert stats is not None and stats.blocks_verified > 0 and stats.blocks_raw == 0
    assert stats.reconstructed == len(published(net))
    assert_exact(sub, published(net), 3)
    train_step(net, opt, 4)
    assert pub.publish(published(net), version=4).snapshot_free.blocks_raw == 0  # type: ignore[union-attr]
    assert_exact(sub, published(net), 4)


def test_a_changed_tensor_without_a_step_is_caught_by_the_digests(tmp_path: Path) -> None:
    net, _, pub, sub = setup(tmp_path)
    pub.publish(published(net), version=1)
    with torch.no_grad():  # changed outside the optimizer: no step, new words
        net.up.weight[3, :5] += 1.0
    report = pub.publish(published(net), version=2)
    stats = report.snapshot_free
    assert stats is not None and stats.blocks_raw == 1 and report.changed_elements == BLOCK
    assert_exact(sub, published(net), 2)


def _two_groups(ps: Any) -> torch.optim.Optimizer:
    ps = list(ps)
    return torch.optim.AdamW(
        [{"params": ps[:2]}, {"params": ps[2:], "lr": 1e-3}], lr=3e-3, weight_decay=0.1
    )


@pytest.mark.parametrize("gate", ["no-lr", "ambiguous-lr"])
def test_a_missing_or_ambiguous_lr_sends_those_tensors_whole(tmp_path: Path, gate: str) -> None:
    net, opt, pub, sub = setup(tmp_path, _two_groups)
    pub.publish(published(net), version=1)
    inverter = pub._snapfree.inverter  # type: ignore[union-attr]
    for v in range(2, 6):
        train_step(net, opt, v)
        calls = inverter._calls
        if v == 3 and gate == "no-lr":
            calls[:] = [call[:1] for call in calls]  # group 1's lr was never captured
        elif v == 3:
            calls.append([calls[-1][0], (9e-3, *calls[-1][1][1:])])
        report = pub.publish(published(net), version=v)
        stats = report.snapshot_free
        assert stats is not None and stats.blocks_raw == 0
        if v == 3:
            whole = set(list(published(net))[2:])
            assert set(stats.absolute) == whole and report.kind == "delta"
            assert all(r.startswith(gate) for r in stats.absolute.values())
            assert stats.reconstructed == 2
        else:
            assert not stats.absolute
        assert_exact(sub, published(net), v)


@pytest.mark.parametrize(
    ("make", "code"),
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "optimizer"),
        (lambda ps: torch.optim.Adam(ps, lr=3e-3, weight_decay=0.1), "adam-l2"),
        (lambda ps: torch.optim.AdamW(ps, lr=3e-3, amsgrad=True), "amsgrad"),
        (lambda ps: torch.optim.AdamW(ps, lr=3e-3, maximize=True), "maximize"),
    ],
)
def test_other_optimizers_fall_back_to_snapshots(tmp_path: Path, make: Any, code: str) -> None:
    net, opt, pub, sub = setup(tmp_path, make)
    first = pub.publish(published(net), version=1).snapshot_free
    assert first is not None
    assert set(first.snapshots) == set(published(net))
    assert all(r.startswith(code) for r in first.snapshots.values())
    for v in range(2, 6):
        train_step(net, opt, v)
        report = pub.publish(published(net), version=v)
        stats = report.snapshot_free
        assert report.kind == "delta" and stats is not None and stats.reconstructed == 0
        assert set(stats.snapshots) == set(published(net))
        assert_exact(sub, published(net), v)


def test_tensors_that_are_not_parameters_are_snapshots(tmp_path: Path) -> None:
    net, opt, pub, sub = setup(tmp_path)
    net.embed.weight.requires_grad_(False)  # frozen: no optimizer state

    def tensors() -> dict[str, torch.Tensor]:
        out = {f"renamed.{n}": p.data for n, p in net.named_parameters()}  # same storage
        out["scale"] = net.scale  # a buffer
        out["up.bf16"] = net.up.weight.detach().to(torch.bfloat16)  # a bf16 copy
        return out

    first = pub.publish(tensors(), version=1).snapshot_free
    assert first is not None
    assert first.snapshots["renamed.embed.weight"].startswith("no-state")
    assert first.snapshots["scale"].startswith("not-a-parameter")
    assert first.snapshots["up.bf16"].startswith("not-a-parameter")
    assert len(first.snapshots) == 3
    for v in range(2, 6):
        train_step(net, opt, v)
        with torch.no_grad():
            net.scale.mul_(1.01)
        stats = pub.publish(tensors(), version=v).snapshot_free
        assert stats is not None and stats.reconstructed == len(tensors()) - 3
        assert stats.blocks_raw == 0
        assert_exact(sub, tensors(), v, frozenset({"scale"}))


def test_bf16_master_weights_and_moments_fall_back(tmp_path: Path) -> None:
    net, opt, pub, sub = setup(tmp_path)
    net.embed.to(torch.bfloat16)  # bf16 master weights: published as they are
    pub.publish(published(net), version=1)
    train_step(net, opt, 2)
    pub.publish(published(net), version=2)
    train_step(net, opt, 3)
    state = opt.state[net.up.weight]
    fp32 = state["exp_avg"], state["exp_avg_sq"]
    state["exp_avg"], state["exp_avg_sq"] = (t.to(torch.bfloat16) for t in fp32)
    report = pub.publish(published(net), version=3)
    stats = report.snapshot_free
    assert stats is not None and report.kind == "delta"
    assert stats.snapshots["up.weight"].startswith("dtype")
    assert stats.absolute["up.weight"].startswith("dtype")
    assert stats.snapshots["embed.weight"].startswith("dtype")
    assert_exact(sub, published(net), 3)
    state["exp_avg"], state["exp_avg_sq"] = fp32  # the tensor stays a snapshot
    for v in range(4, 7):
        train_step(net, opt, v)
        stats = pub.publish(published(net), version=v).snapshot_free
        assert stats is not None and "up.weight" in stats.snapshots and not stats.absolute
        assert pub._held.tensors["up.weight"].words.size == net.up.weight.numel()  # type: ignore[index]
        assert_exact(sub, published(net), v)


def test_a_failed_publish_leaves_the_writer_at_its_version(
    tmp_path: Path, monkeypatch: Any
) -> None:
    net, opt, pub, sub = setup(tmp_path)
    pub.publish(published(net), version=1)
    train_step(net, opt, 2)
    pub.publish(published(net), version=2)
    digests = {n: d.copy() for n, d in pub._snapfree.digests.items()}  # type: ignore[union-attr]
    train_step(net, opt, 3)

    def broken(key: str, data: bytes) -> None:
        raise StoreError("injected: store unavailable")

    with monkeypatch.context() as m:
        m.setattr(pub.store, "put", broken)
        with pytest.raises(StoreError):
            pub.publish(published(net), version=3)
    assert pub.version == 2
    after = pub._snapfree.digests  # type: ignore[union-attr]
    assert all(np.array_equal(after[n], d) for n, d in digests.items())
    report = pub.publish(published(net), version=3)  # the same step, published again
    assert report.kind == "delta" and report.snapshot_free.blocks_raw == 0  # type: ignore[union-attr]
    assert_exact(sub, published(net), 3)
    train_step(net, opt, 4)
    assert pub.publish(published(net), version=4).kind == "delta"
    assert_exact(sub, published(net), 4)


def test_attach_holds_digests_and_continues_exactly(tmp_path: Path) -> None:
    net, opt, pub, sub = setup(tmp_path)
    pub.publish(published(net), version=1)
    train_step(net, opt, 2)
    pub.publish(published(net), version=2)
    pub._snapfree.close()  # type: ignore[union-attr]
    again = Publisher(tmp_path, snapshot="none", optimizer=opt, max_frame_bytes=8192)
    assert again.attach(published(net)) == 2
    assert all(s.words.size == 0 for s in again._held.tensors.values())  # type: ignore[union-attr]
    with torch.no_grad():
        net.up.bias.add_(1.0)
    with pytest.raises(Exception, match=r"differ|mismatch|Adler"):
        Publisher(tmp_path, snapshot="none", optimizer=opt).attach(published(net))
    with torch.no_grad():
        net.up.bias.sub_(1.0)
    train_step(net, opt, 3)
    report = again.publish(published(net), version=3)
    assert report.kind == "delta" and report.snapshot_free.blocks_raw == 0  # type: ignore[union-attr]
    assert_exact(sub, published(net), 3)


def test_anchor_copies_and_a_new_reader(tmp_path: Path) -> None:
    net, opt, pub, sub = setup(tmp_path, anchor_policy="every:3")
    pub.publish(published(net), version=1)
    copies = 0
    for v in range(2, 9):
        train_step(net, opt, v)
        report = pub.publish(published(net), version=v)
        copies += report.anchor_copy_bytes is not None
        assert_exact(sub, published(net), v)
    assert copies >= 2
    assert_exact(Subscriber(tmp_path), published(net), 8)


def test_warnings_are_logged_for_raw_blocks(tmp_path: Path, caplog: Any) -> None:
    net, _, pub, _ = setup(tmp_path, max_frame_bytes=2048)
    pub.publish(published(net), version=1)
    with torch.no_grad():
        net.down.weight.add_(0.5)
        net.up.weight.add_(0.5)
    with caplog.at_level(logging.WARNING, logger="deltastore.publish.publisher"):
        stats = pub.publish(published(net), version=2).snapshot_free
    assert stats is not None and stats.blocks_raw > 8
    raw = [r for r in caplog.records if "did not match its digest" in r.getMessage()]
    assert len(raw) == 8
    assert any("blocks in all" in r.getMessage() for r in caplog.records)


def test_block_resolution_tries_the_words_within_the_bound() -> None:
    from deltastore.publish.digests import candidate_lists, digest, resolve_block

    rng = np.random.default_rng(3)
    truth = rng.integers(0x3C00, 0x3D00, BLOCK, dtype=np.uint16).astype("<u2")
    expected = digest(truth)
    guess = truth.copy()
    unc = np.array([5, 900, 4000])
    guess[unc] = truth[unc] + np.array([3, 0, -2], dtype=np.int64).astype("<u2")
    guess[10] = 0  # a zero-initialised element whose bound touches zero
    unc = np.array([5, 10, 900, 4000])
    lo = guess[unc] - np.uint16(6)
    hi = guess[unc] + np.uint16(6)
    zero = np.array([False, True, False, False])
    truth[10] = 0
    expected = digest(truth)
    cands = candidate_lists(guess[unc], lo, hi, zero)
    assert cands[1][0] == 0 and all(len(c) == 13 for c in (cands[0], cands[2], cands[3]))
    best = guess.copy()
    assert resolve_block(guess, unc, cands, expected)
    assert np.array_equal(guess, truth)  # the matching words stay: the published ones
    guess = best.copy()
    guess[77] ^= 1  # a wrong word that is not uncertain: no choice matches
    before = guess.copy()
    assert not resolve_block(guess, unc, cands, expected)
    assert np.array_equal(guess, before)  # restored to the best guess
    negative = candidate_lists(
        np.array([0x8005], "<u2"), np.array([0x8009], "<u2"), np.array([0x0002], "<u2"), zero[:1]
    )
    # value order across zero: -0 (0x8000) sits between -tiny and +0
    assert negative[0][0] == 0x8005 and set(negative[0][1:3]) == {0x8004, 0x8006}
    assert 0x8000 in negative[0] and 0x0000 in negative[0] and 0x0002 in negative[0]


def test_a_lone_uncertain_word_far_from_its_guess_is_resolved() -> None:
    """An update that cancels the weight leaves a bound across zero spanning thousands of
    words; the true word, 58 ranks from the best guess (measured on the bench's model), is
    found by walking out from the guess, so the block is not sent whole."""
    from deltastore.publish.digests import candidate_lists, digest, resolve_block

    truth = np.full(BLOCK, 0x3C00, dtype="<u2")
    truth[3963] = 0x2900
    guess = truth.copy()
    guess[3963] = 0x293A
    unc = np.array([3963])
    cands = candidate_lists(
        guess[unc], np.array([0xAAF9], "<u2"), np.array([0x2B14], "<u2"), np.array([True])
    )
    assert 0x2900 in cands[0]
    assert resolve_block(guess, unc, cands, digest(truth))
    assert np.array_equal(guess, truth)


def test_row_slices_of_plain_tensors_are_whole() -> None:
    from deltastore.publish.sharded import RowSlice

    t = Net().up.weight
    s = RowSlice.of(t)
    assert s is not None and s.tensor is t and tuple(s.global_shape) == tuple(t.shape)
    assert s.row_start == 0 and s.param is None


def test_publish_memory_is_a_few_frames_not_a_copy_of_the_model(tmp_path: Path) -> None:
    """Traced (numpy) memory of a delta publish where nearly every element changes: a few
    frames' worth of entries, far below the bf16 bytes of the model (a copy would be all)."""
    import tracemalloc

    torch.manual_seed(0)
    lin = nn.Linear(2048, 4096)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3, weight_decay=0.1)
    pub = Publisher(
        tmp_path,
        snapshot="none",
        optimizer=opt,
        max_frame_bytes=64 << 10,
        max_object_bytes=1 << 20,  # data objects stream out: the payload is not held either
        anchor_policy="never",
    )
    tensors = dict(lin.named_parameters())

    def step() -> None:
        lin(torch.randn(16, 2048)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    pub.publish(tensors, version=1)
    step()
    pub.publish(tensors, version=2)  # the kernel is loaded
    step()
    model_bf16 = 2 * sum(t.numel() for t in tensors.values())
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        report = pub.publish(tensors, version=3)
        extra = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert report.changed_elements > 0.9 * report.total_elements
    assert report.snapshot_free is not None and report.snapshot_free.blocks_raw == 0
    assert extra < model_bf16 / 2, (extra, model_bf16)
